"""Documentation sections generated from the code (docs/knobs.md's knob table, docs/metrics.md's
metric list), kept current by tests; `make docs` rewrites both."""

from __future__ import annotations

from pathlib import Path

from atomic_files import atomic_write


class MissingMarkers(ValueError):
    """The page lacks the start or end marker of a generated section."""


def replace_section(text: str, start: str, end: str, body: str) -> str:
    """``text`` with everything between the ``start`` and ``end`` marker lines replaced by ``body``."""
    try:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
    except ValueError:
        raise MissingMarkers(f"missing the markers {start!r} ... {end!r}") from None
    return f"{head}{start}\n{body}\n{end}{tail}"


def update_section(page: Path, start: str, end: str, body: str) -> bool:
    """Rewrite one generated section of ``page`` (atomically); True when the file changed."""
    text = page.read_text(encoding="utf-8")
    try:
        new = replace_section(text, start, end, body)
    except MissingMarkers as exc:
        raise MissingMarkers(f"{page}: {exc}") from None
    if new == text:
        return False
    atomic_write(page, lambda tmp: Path(tmp).write_text(new, encoding="utf-8"))
    return True
