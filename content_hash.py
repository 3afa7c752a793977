"""A large file's sha256, read once per state of the file: ``content_sha256``.

A 10M-row manifest takes tens of seconds to hash; every rank of every job that trains on it asks
for its hash (the training cache is keyed by the manifest's content, never its name). The hash is
remembered beside the caches, keyed by the file's state, and the ranks of a node that miss the
memo at once take turns under a file lock, so the file is read once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from pathlib import Path

from atomic_files import atomic_write

_HASH_CHUNK = 8 << 20


def _file_identity(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def content_sha256(manifest_path: Path, memo_dir: Path, progress: bool = False) -> str:
    """sha256 of the manifest's bytes, remembered in ``memo_dir`` for this exact file state.

    The memo is keyed by path, inode, size, mtime and ctime: a write to the file (or a replacement
    by rename) changes at least the ctime or the inode, so a remembered hash is never stale. Processes
    that miss the memo at once (the ranks of a node) hash one at a time under a file lock, so the
    file is read once and the others find the memo.
    """
    manifest_path = Path(manifest_path)
    ident = _file_identity(manifest_path)
    name = hashlib.sha256(ident[0].encode()).hexdigest()[:12]
    memo = Path(memo_dir) / f".{manifest_path.name}.{name}.sha256.json"
    value = _remembered(memo, ident)
    if value is not None:
        return value
    try:
        lock = open(memo.with_suffix(".lock"), "a+")
    except OSError:  # a directory this process cannot write: hash without the memo
        return _hash_file(manifest_path, ident[2], progress)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        value = _remembered(memo, ident)
        if value is not None:
            return value
        value = _hash_file(manifest_path, ident[2], progress)
        if _file_identity(manifest_path) == ident:  # not rewritten while it was read
            with contextlib.suppress(OSError):
                atomic_write(
                    memo,
                    lambda tmp: Path(tmp).write_text(
                        json.dumps({"identity": ident, "sha256": value})
                    ),
                )
    return value


def _remembered(memo: Path, ident: list) -> str | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        remembered = json.loads(memo.read_text())
        if remembered["identity"] == ident:
            return remembered["sha256"]
    return None


def _hash_file(path: Path, size: int, progress: bool) -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with (
        open(path, "rb") as fh,
        tqdm(
            total=size,
            desc=f"hashing {path.name}",
            unit="B",
            unit_scale=True,
            disable=None if progress else True,  # None: no bar where stderr is a log file
            leave=False,
        ) as bar,
    ):
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
