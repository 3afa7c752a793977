"""The application's modules import the standard way: installed by `make setup`, no path edits."""

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_top_level_module_is_installed():
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(settings["py-modules"]) == {p.stem for p in REPO.glob("*.py")}
    assert settings["packages"] == ["scripts", "benchmarks", "source_readers"]


def test_no_source_file_edits_the_import_path():
    edit = "sys" + ".path"  # spelled in two parts so this file does not match itself
    offenders = [
        str(p.relative_to(REPO))
        for d in ("", "scripts", "benchmarks", "source_readers", "tests")
        for p in (REPO / d).glob("*.py")
        if edit in p.read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_a_script_runs_from_any_directory(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "evaluate.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout
