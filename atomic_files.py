"""Writing a file so that a crash never leaves a partial one under its final name.

Shared by the offline tools (build_manifest.py, scripts/), the training callbacks (checkpoints,
.nemo exports, run records) and the generated tables of docs/; it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import errno
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


SET_SUFFIX = ".set-tmp"


def write_together(writers: dict[Path, Callable[[str], None]], tag: str) -> None:
    """Write a set of files that belong together so that a reader never takes a mixed set for a
    whole one: each ``writers[path](tmp)`` writes a hidden temporary beside ``path`` (fsynced), and
    only once all are complete are they renamed into place. The last path of ``writers`` is the
    set's seal (a summary): it is removed before the first rename and renamed last, so a crash
    between renames leaves the set without its seal, never with an old one. Temporaries a killed
    run left are removed first. When a write fails, every temporary is removed and the previous
    set is untouched; the error (any writer's: polars reports a full disk as a ComputeError) comes
    back as an OSError whose ``filename`` is the file of the set being written and whose
    ``strerror`` starts with "disk full" when it was. ``tag`` names this run's temporaries."""
    targets = [Path(t) for t in writers]
    for target in targets:
        remove_stale_temporaries(target, SET_SUFFIX)
    temps = {t: t.with_name(f".{t.name}.{tag}{SET_SUFFIX}") for t in targets}
    try:
        for target, write in zip(targets, writers.values()):
            target.parent.mkdir(parents=True, exist_ok=True)
            write(str(temps[target]))
            with open(temps[target], "rb+") as f:
                os.fsync(f.fileno())
    except BaseException as exc:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
        if not isinstance(exc, Exception):
            raise
        full = disk_full(exc)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        code = errno.ENOSPC if full else getattr(exc, "errno", None) or errno.EIO
        raise OSError(code, f"disk full: {reason}" if full else reason, str(target)) from exc
    seal = targets[-1]
    seal.unlink(missing_ok=True)
    for target in targets:
        os.replace(temps[target], target)
    for directory in {t.parent for t in targets}:
        _fsync_dir(directory)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` reports a full file system or quota, as an OSError or in a library's own
    exception (polars and pyarrow put the OS message in theirs)."""
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return any(m in text for m in ("No space left on device", "Disk quota exceeded", "os error 28"))


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
