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


def demo_step_settings() -> dict[str, int]:
    """The step counts scripts/demo.sh sets unless exported: NAME=${NAME:-N}."""
    text = (REPO / "scripts" / "demo.sh").read_text(encoding="utf-8")
    found = re.findall(
        r"^(?:export )?([A-Z_0-9]*(?:STEPS?|WARMUP)|CHECKPOINT_EVERY)=\$\{\1:-(\d+)\}", text, re.M
    )
    return {name: int(value) for name, value in found}


def test_the_docs_quote_the_demos_step_counts_as_demo_sh_sets_them():
    """A sentence of the README or docs/ (benchmarks.md dates its figures and keeps old runs') that
    speaks of the demo and counts steps counts them as demo.sh does."""
    demo = demo_step_settings()
    assert {"MAX_STEPS", "DEMO_BASE_STEPS", "WARMUP_STEPS", "PHASE2_WARMUP"} <= set(demo), demo
    pages_ = [REPO / "README.md"] + [
        p for p in (REPO / "docs").glob("*.md") if p.name != "benchmarks.md"
    ]
    checked = 0
    for page in pages_:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        for sentence in re.split(r"(?<=[.;:])\s", text):
            # about the demo's run, not experiments with its model or its corpus
            if (
                "demo" not in sentence.lower()
                or "demo's model" in sentence
                or "demo_tdt" in sentence
            ):
                continue
            for count in re.findall(
                r"(?<![\d.])(\d[\d,]*) (?:optimizer |finetuning |training )?steps\b(?!/)", sentence
            ):
                checked += 1
                assert int(count.replace(",", "")) in demo.values(), (page.name, sentence)
            warmups = re.search(r"uses (\d+) and (\d+) of its (\d+) steps", sentence)
            if warmups:
                assert [int(g) for g in warmups.groups()] == [
                    demo["WARMUP_STEPS"],
                    demo["PHASE2_WARMUP"],
                    demo["MAX_STEPS"],
                ], (page.name, sentence)
    assert checked  # the docs do count the demo's steps somewhere
