"""benchmarks/bench_train_step.py: the batch it times, its search for MAX_BATCH_DURATION, and a whole run."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import config
from tests.tiny_training_data import make_training_data

spec = importlib.util.spec_from_file_location(
    "bench_train_step", config.REPO_DIR / "benchmarks" / "bench_train_step.py"
)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # its dataclasses look their module up there
spec.loader.exec_module(bench)


def test_timed_batch_is_the_samplers_heaviest_in_the_longest_bucket():
    shape = bench.heaviest_batch_shape(90.0, tokens_per_second=5.0)
    assert min(shape.durations) >= config.BUCKET_BOUNDARIES[-1]
    assert max(shape.durations) <= config.MAX_DURATION
    assert 90.0 - config.MAX_DURATION < shape.audio_seconds <= 90.0
    assert shape.tokens == [1 + round(5.0 * d) for d in shape.durations]


@pytest.mark.parametrize("limit", [20.0, 37.0, 90.0, 412.5, 600.0])
def test_search_finds_the_largest_five_second_multiple_that_fits(limit):
    tried = []

    def fits_at(cap):
        tried.append(cap)
        return cap <= limit

    assert bench.bisect_max_batch_duration(fits_at, 20.0, 600.0) == 5.0 * (limit // 5.0)
    assert len(tried) <= 9  # bisection, not a scan of 117 candidates


def test_search_reports_none_when_even_the_longest_utterance_does_not_fit():
    assert bench.bisect_max_batch_duration(lambda cap: False, 20.0, 600.0) is None


@pytest.mark.slow
def test_bench_times_both_phases_against_nemo_and_prints_the_ratio(tmp_path, monkeypatch, capsys):
    data = make_training_data(tmp_path, per_lang=4, langs=("hi", "en"), vocab_size=64)
    monkeypatch.setattr(config, "TOKENIZER_DIR", data["tokenizer"])
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 20.0)
    assert bench.main(["--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "B parameters" in out and "1 utterances, 20.0 s of audio" in out
    for phase in (1, 2):
        assert (
            f"phase {phase} project: median step" in out
            and f"phase {phase} nemo   : median step" in out
        )
        assert f"phase {phase} ratio project / NeMo step time:" in out
