"""script_languages' counting of letters by script without polars: what decoding with the
language given keeps to, and what train_tokenizer.py records per language."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import vocabulary
from script_languages import OTHER_SCRIPT, letter_script, script_letters, scripts_of

REPO = Path(__file__).resolve().parents[1]


def test_letters_and_marks_take_their_scripts_and_nothing_else_counts():
    assert letter_script("क") == "Devanagari" and letter_script("ि") == "Devanagari"  # a mark
    assert letter_script("।") is None and letter_script("७") is None  # danda, digit
    assert letter_script("த") == "Tamil" and letter_script("ক") == "Bengali"
    assert letter_script("ش") == "Arabic" and letter_script("é") == "Latin"
    assert letter_script("Ж") == OTHER_SCRIPT and letter_script("\u200d") is None  # joiner
    assert letter_script("▁") is None and letter_script("1") is None and letter_script(",") is None
    assert scripts_of("▁the") == {"Latin"} and scripts_of("▁") == frozenset()
    assert scripts_of("<0xE0>") == {"Latin"}  # a byte piece reads as its name...
    assert vocabulary.always_kept("<0xE0>") and vocabulary.always_kept("<unk>")  # ...and is kept
    assert not vocabulary.always_kept("<|hi|>") and not vocabulary.always_kept("<0xE0>x")
    counts = script_letters(["नमस्ते hello", "வணக்கம் 123", "Привет"])
    assert counts == {"Devanagari": 6, "Latin": 5, "Tamil": 7, OTHER_SCRIPT: 6}


def test_the_module_imports_where_polars_is_absent():
    """A training node's environment has no polars; decoding with the language given imports
    this module there."""
    code = (
        "import sys; sys.modules['polars'] = None; import script_languages; "
        "print(script_languages.scripts_of('कि'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert "Devanagari" in out.stdout
