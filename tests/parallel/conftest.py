import sys
from pathlib import Path

# spawned ranks import the worker modules of this folder by their top-level names
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
