"""Lightning callbacks of the training job (train.py wires them up)."""
from __future__ import annotations
