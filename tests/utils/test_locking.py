import subprocess
import sys

import pytest

from moelab.utils.locking import FolderBusyError, folder_lock


def test_second_lock_is_refused_and_released_after(tmp_path):
    with (
        folder_lock(tmp_path, what="run folder"),
        pytest.raises(FolderBusyError, match="another moelab process is writing to this folder"),
        folder_lock(tmp_path),
    ):
        pass
    with folder_lock(tmp_path):  # released
        pass


@pytest.mark.slow
def test_lock_held_by_another_process(tmp_path):
    code = (
        "import sys; from moelab.utils.locking import folder_lock\n"
        f"with folder_lock({str(tmp_path)!r}):\n"
        "    print('locked', flush=True); sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(FolderBusyError), folder_lock(tmp_path):
            pass
    finally:
        p.kill()
        p.wait()
    with folder_lock(tmp_path):  # a killed holder leaves no stale lock
        pass
