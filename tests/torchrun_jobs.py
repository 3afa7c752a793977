"""Launching the multi-process tests' jobs: a free loopback port and the torchrun command line."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: Path, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` with ``nproc`` local ranks on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
    ]
