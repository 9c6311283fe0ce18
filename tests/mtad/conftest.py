"""Make ``tests/mtad_reference.py`` importable as ``mtad_reference`` (tests is not a package)."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
