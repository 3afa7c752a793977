"""Writing a file so that a crash never leaves a partial one under its final name.

Shared by the offline tools (build_manifest.py, scripts/), the training callbacks (checkpoints,
.nemo exports, run records) and config.py's README table; it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(
    path: str | os.PathLike, write: Callable[[str], None], suffix: str = ".tmp"
) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, fsync, then rename it to ``path``.

    A crash (or SIGKILL) before the rename leaves only a hidden ``.<name>.*<suffix>`` file, never a
    partial file under the final name; the rename is atomic within one file system. The file gets
    the mode a plain open() would give it, so teammates on a shared cluster can read it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus the umask).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def remove_stale_temporaries(path: str | os.PathLike, suffix: str = ".tmp") -> int:
    """Delete the temporary files that ``atomic_write(path, ..., suffix)`` calls killed before their
    rename left beside ``path``; the number deleted. Call it only where no other process is writing
    ``path`` at the same time."""
    path = Path(path)
    stale = list(path.parent.glob(f".{path.name}.*{suffix}"))
    for temp in stale:
        temp.unlink(missing_ok=True)
    return len(stale)


def check_writable(directory: str | os.PathLike) -> None:
    """Create ``directory`` when needed and create and delete a file in it: OSError when it cannot
    take one (permissions, a read-only file system), before any expensive work."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write-probe-{os.getpid()}"
    probe.touch()
    probe.unlink()


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable where the file system allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
