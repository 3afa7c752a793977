"""benchmarks/bench_validation.py: a whole run on the tiny model prints the timings, the ratio to NeMo's
own validation step and the share of training time, consistent with its formula."""

from __future__ import annotations

import re

import config
from benchmarks import bench_validation
from tests.tiny_training_data import make_training_data


def test_a_run_prints_the_timings_and_a_share_that_follows_its_formula(
    tmp_path, monkeypatch, capsys
):
    data = make_training_data(tmp_path, per_lang=4, vocab_size=64)
    monkeypatch.setattr(config, "TOKENIZER_DIR", data["tokenizer"])
    monkeypatch.setattr(config, "MODEL_CONFIG", config.REPO_DIR / "configs" / "tiny_tdt.yaml")
    monkeypatch.setattr(config, "INIT_MODEL", "")
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 12.0)
    args = ["--repeats", "1", "--files", "2", "--work-dir", str(tmp_path / "work")]
    assert bench_validation.main([*args, "--world-size", "2", "--val-utterances", "10"]) == 0
    out = capsys.readouterr().out
    number = r"([0-9.]+)"
    train = float(re.search(rf"train micro-batch .*? {number} s", out).group(1))
    ours = float(re.search(rf"ours \(decode \+ loss\) +{number} s", out).group(1))
    assert train > 0 and ours > 0 and "ours/NeMo = " in out
    audio = float(re.search(rf"A = {number} s", out).group(1))
    load = float(re.search(rf"audio loading +{number} ms", out).group(1)) / 1e3
    per_validation = float(re.search(rf"one validation {number} s per rank", out).group(1))
    # V / W = 10 x 6 s / 2 ranks
    assert abs(per_validation - 30.0 * (ours / audio + load)) <= 0.05 + 0.01 * per_validation
    assert "share" in out and ("stays under 2%" in out or "above 2% at any speed" in out)
