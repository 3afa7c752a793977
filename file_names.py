"""File names as the file system holds them: bytes, which need not be UTF-8.

Python holds a byte of a name that is not UTF-8 as a surrogate escape (PEP 383). Such a path
opens, but it cannot be printed, logged or stored as text (a parquet string column, a summary
meant for people) without an encoding error. A directory walk over a user's corpus or noise
recordings meets such names on systems set up in Latin-1 or a legacy code page; this module
tells them and shows them.
"""

from __future__ import annotations

import os


def is_utf8(path: str | os.PathLike[str]) -> bool:
    """Whether every byte of ``path`` as the file system holds it is UTF-8."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(path: str | os.PathLike[str]) -> str:
    """``path`` as a message can print it: each byte that is not UTF-8 shown as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def not_utf8(path: str | os.PathLike[str], what: str, fix: str) -> dict[str, str]:
    """The report of a file or directory skipped because ``path`` is not UTF-8: its printable
    path and why, ``what`` naming the part at fault ("path", "name") and ``fix`` what to do."""
    return {
        "path": printable(path),
        "reason": f"its {what} is not UTF-8 (such bytes shown as \\xNN): {fix}",
    }
