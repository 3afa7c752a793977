"""README is the front door: short, and every page and section it links to exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    lines = page.read_text(encoding="utf-8").splitlines()
    return {slug(line.lstrip("#")) for line in lines if re.match(r"#{1,6} ", line)}


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_stays_short():
    assert len((REPO / "README.md").read_bytes()) <= 15_000


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in (REPO / "docs").glob("*.md") if f"(docs/{p.name}" not in readme]
    assert missing == []


def test_every_relative_link_reaches_a_page_and_a_heading():
    broken = []
    for page in pages():
        for target, anchor in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []


def test_the_test_files_started_first_exist():
    # conftest.LONG_FILES orders the suite's longest files first; a renamed file would silently
    # fall back to the end of the run.
    from tests.conftest import LONG_FILES

    here = Path(__file__).resolve().parent
    assert [name for name in LONG_FILES if not (here / name).is_file()] == []
