"""Shared test set-up: single-threaded torch (the CI machine has 2 cores; tests run one at a time)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
