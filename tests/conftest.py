"""Shared test set-up: the repository root on sys.path, single-threaded torch."""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")
