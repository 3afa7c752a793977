"""benchmarks/bench_train_step.py: a whole run times both phases on both sides and prints the ratio."""

from __future__ import annotations

import pytest

import config
from benchmarks import bench_train_step as bench
from tests.tiny_training_data import make_training_data


@pytest.mark.slow
def test_bench_times_both_phases_against_nemo_and_prints_the_ratio(tmp_path, monkeypatch, capsys):
    data = make_training_data(tmp_path, per_lang=4, langs=("hi", "en"), vocab_size=64)
    monkeypatch.setattr(config, "TOKENIZER_DIR", data["tokenizer"])
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 20.0)
    assert bench.main(["--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    # at MAX_BATCH_DURATION 20: two copies of the 20 s longest reach the most padded frames packed
    assert "B parameters" in out and "2 utterances, 40.0 s of audio, longest 20.0 s" in out
    for phase in (1, 2):
        assert (
            f"phase {phase} project: median step" in out
            and f"phase {phase} nemo   : median step" in out
        )
        assert f"phase {phase} ratio project / NeMo step time:" in out
