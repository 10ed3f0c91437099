"""Suite-wide setup."""

from moelab.core.experts import cpu_kernel


def pytest_sessionstart(session):
    # Compile the fused CPU expert kernel before any test runs (once per machine, ~30 s; a
    # second xdist worker waits on torch's build lock), so no timed subprocess pays for it.
    cpu_kernel.kernel()
