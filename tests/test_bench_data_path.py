"""benchmarks/bench_data_path.py: one worker's rate, the step fed by train.py's loader, and the
workers a GPU needs."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import config
from benchmarks import bench_data_path as bench
from sampler import BatchingSettings, DurationBucketBatchSampler
from tests.tiny_training_data import make_training_data


def test_the_repeated_corpus_holds_every_row_k_times_under_new_ids(tmp_path):
    data = make_training_data(tmp_path, per_lang=3, langs=("hi", "en"), vocab_size=64)
    out = bench.repeated_manifest(data["manifest"], 4, tmp_path / "work")
    original = pq.read_table(data["manifest"])
    repeated = pq.read_table(out)
    assert repeated.num_rows == 4 * original.num_rows
    ids = repeated.column("segment_id").to_pylist()
    assert len(set(ids)) == len(ids)
    # the same audio files, each four times
    paths = repeated.column("audio_filepath").to_pylist()
    assert sorted(set(paths)) == sorted(original.column("audio_filepath").to_pylist())
    assert all(paths.count(p) == 4 for p in set(paths))
    assert not list((tmp_path / "work").glob("*.partial"))


@pytest.mark.parametrize(
    "demand,per_worker,expected",
    [(1000.0, 2000.0, 1), (2000.0, 2000.0, 2), (4000.0, 2100.0, 3), (10.0, 5000.0, 1)],
)
def test_workers_cover_the_demand_with_a_quarter_to_spare(demand, per_worker, expected):
    need = bench.workers_needed(demand, per_worker)
    assert need == expected
    assert need * per_worker >= 1.25 * demand
    assert need == 1 or (need - 1) * per_worker < 1.25 * demand
    assert math.isclose(bench.HEADROOM, 1.25)


def test_a_worker_rate_that_is_not_positive_gives_no_worker_count():
    for rate in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="expected a measured rate > 0"):
            bench.workers_needed(1000.0, rate)


def test_one_workers_rate_is_timed_across_epochs_past_what_it_had_ready(tmp_path, monkeypatch):
    """An epoch of a few micro-batches, shorter than the timing: the worker is timed over later
    epochs for the seconds asked, never over the batches it had ready (they arrive at once)."""
    import asr_model

    data = make_training_data(tmp_path, per_lang=3, langs=("hi", "en"), vocab_size=64)
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 4.0)
    monkeypatch.setattr(config, "GRAD_ACCUM", 1)
    tokenizer = asr_model.build_model(
        "", Path(config.REPO_DIR) / "configs" / "tiny_tdt.yaml", data["tokenizer"]
    ).tokenizer
    dataset = bench.load_dataset(data["manifest"], tokenizer, tmp_path / "work")
    per_epoch = len(
        DurationBucketBatchSampler(
            dataset.durations,
            dataset.languages,
            BatchingSettings.from_config(),
            token_lengths=dataset.token_lengths,
        )
    )
    assert dataset.noise.prob == 0.0  # NOISE_PROB's default
    monkeypatch.setattr(config, "NOISE_PROB", 0.5)
    noisy = bench.load_dataset(data["manifest"], tokenizer, tmp_path / "work")
    assert noisy.noise.prob == 0.5  # the workers are timed with the noise train.py would add
    rate, batches, elapsed, _ = bench.one_worker_rate(dataset, 1.5)
    assert elapsed >= 1.5 and batches > per_epoch  # timed over several epochs
    assert rate is not None and rate > 0
    # timed too briefly: no rate, so no worker advice
    rate, batches, _, _ = bench.one_worker_rate(dataset, 0.0)
    assert rate is None and batches < bench.MIN_TIMED_BATCHES


@pytest.mark.slow
def test_the_loader_feeds_the_step_and_the_workers_a_node_needs_are_printed(
    tmp_path, monkeypatch, capsys
):
    data = make_training_data(tmp_path, per_lang=6, langs=("hi", "en"), vocab_size=64)
    monkeypatch.setattr(config, "TOKENIZER_DIR", data["tokenizer"])
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 8.0)
    monkeypatch.setattr(config, "GRAD_ACCUM", 2)
    monkeypatch.setattr(config, "NUM_WORKERS", 1)
    argv = [
        "--manifest",
        str(data["manifest"]),
        "--repeat",
        "6",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--worker-seconds",
        "2",
        "--work-dir",
        str(tmp_path / "work"),
    ]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    # every feasible row six times (rows with more tokens than frames are dropped, each copy alike)
    utterances = int(out.split("x 6 = ")[1].split(" utterances")[0])
    assert 0 < utterances <= 72 and utterances % 6 == 0
    worker = float(out.split("one worker: ")[1].split(" audio s/s")[0])
    assert worker > 0
    fed = out.split("fed by the loader: phase 2, NUM_WORKERS=1: ")[1].splitlines()[0]
    assert "data wait" in fed and "over 1 steps" in fed
    need = int(out.split("workers per GPU for a data wait under 2%: ")[1].split(" ")[0])
    audio = float(fed.split(" s, ")[1].split(" audio s/s")[0])
    assert need == bench.workers_needed(audio, worker)
    assert f"a 8-GPU node needs 8 x ({need} + 1) = {8 * (need + 1)} cores" in out


def test_the_repeated_corpus_follows_its_manifest_when_made_again(tmp_path):
    first = make_training_data(tmp_path / "a", per_lang=3, langs=("hi", "en"), vocab_size=64)
    out = bench.repeated_manifest(first["manifest"], 2, tmp_path / "work")
    # another manifest of the same name, at the same repeat: its own rows, not the first one's
    second = make_training_data(tmp_path / "b", per_lang=2, langs=("hi",), vocab_size=64, seed=1)
    (tmp_path / "b" / first["manifest"].name).write_bytes(second["manifest"].read_bytes())
    again = bench.repeated_manifest(tmp_path / "b" / first["manifest"].name, 2, tmp_path / "work")
    assert again == out
    assert pq.read_table(again).num_rows == 2 * pq.read_table(second["manifest"]).num_rows
