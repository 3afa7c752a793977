"""dataset.py: audio loading, bad-audio handling, tokens, feasibility filter, collation (the training
cache itself: tests/test_training_cache.py)."""

from __future__ import annotations

import logging
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataset
import training_cache
import vocabulary
from manifest_schema import lang_tag, tagged_text
from sampler import BatchingSettings
from tests.conftest import LANGS, WORDS

# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(autouse=True)
def fresh_bad_audio_counters(monkeypatch):
    # The counters are process-global by design; each test starts from zero.
    monkeypatch.setattr(dataset, "_bad_audio_pending", dataset.collections.Counter())
    monkeypatch.setattr(dataset, "_bad_audio_logged", dataset.collections.Counter())


def write_audio(path, seconds=1.0, sr=16000, channels=1, value=0.1, subtype=None):
    n = int(round(seconds * sr))
    data = np.full((n, channels), value, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), data, sr, subtype=subtype)
    return path


class Corpus:
    """A manifest in the contract's schema over audio files in shard directories under ``root``."""

    def __init__(self, root):
        self.root = root
        self.rows: list[dict] = []

    def shard_dir(self, shard="src/hi/shard_0000"):
        return self.root / "shards" / shard

    def add(
        self,
        member="a.flac",
        text="नमस्ते भारत",
        lang="hi",
        duration=1.0,
        shard="src/hi/shard_0000",
        audio: dict | None = None,
    ):
        """One manifest row; ``audio`` = kwargs of write_audio, None = no file."""
        if audio is not None:
            write_audio(self.shard_dir(shard) / member, **audio)
        self.rows.append(
            dict(
                segment_id=f"seg{len(self.rows)}",
                shard_id=shard,
                text=tagged_text(lang, text).rstrip(),
                duration=float(duration),
                lang=lang,
                audio_filepath=str((self.shard_dir(shard) / member).absolute()),
                source="src",
            )
        )
        return self

    def write(self, name="train_manifest.parquet"):
        path = self.root / name
        pq.write_table(pa.Table.from_pylist(self.rows), path)
        return path


@pytest.fixture
def corpus(tmp_path):
    return Corpus(tmp_path)


def load(corpus, tokenizer, **kwargs):
    return dataset.LocalShardDataset(corpus.write(), tokenizer, progress=False, **kwargs)


# ------------------------------------------------------------------------------------------ audio


def test_stereo_is_averaged_to_one_channel(corpus, tokenizer, tmp_path):
    path = tmp_path / "shards" / "src/hi/shard_0000" / "a.flac"
    path.parent.mkdir(parents=True)
    left_right = np.stack([np.full(16000, 0.5), np.full(16000, 0.1)], axis=1).astype(np.float32)
    sf.write(str(path), left_right, 16000)
    item = load(corpus.add(), tokenizer)[0]
    assert item["signal"].dim() == 1 and item["signal"].dtype == torch.float32
    np.testing.assert_allclose(item["signal"].numpy(), 0.3, atol=1e-4)


@pytest.mark.parametrize("sr", [22050, 44100, 8000])
def test_other_sample_rates_are_resampled_to_16k(corpus, tokenizer, sr):
    item = load(corpus.add(duration=1.5, audio=dict(seconds=1.5, sr=sr)), tokenizer)[0]
    assert abs(item["signal"].shape[0] - 24000) <= 1
    assert item["signal"].dtype == torch.float32


def test_16k_mono_is_returned_as_decoded(corpus, tokenizer):
    item = load(corpus.add(audio=dict(seconds=1.0, value=0.25)), tokenizer)[0]
    assert item["signal"].shape == (16000,)
    np.testing.assert_allclose(item["signal"].numpy(), 0.25, atol=1e-4)
    assert item["duration"] == 1.0 and item["lang"] == "hi" and item["index"] == 0


def test_audio_path_is_tar_dirname_joined_with_member(corpus, tokenizer):
    ds = load(corpus.add(member="sub/x.flac", audio={}), tokenizer)
    assert ds.audio_path(0) == str(corpus.shard_dir() / "sub/x.flac")
    assert ds[0] is not None


# ------------------------------------------------------------------------------------------ bad audio


def assert_bad(ds, reason):
    assert ds[0] is None
    assert dataset.drain_bad_audio_counts() == {reason: 1}


def test_missing_file_is_none_counted_missing(corpus, tokenizer):
    assert_bad(load(corpus.add(audio=None), tokenizer), "missing")


def test_corrupt_file_is_none_counted_unreadable(corpus, tokenizer):
    path = corpus.shard_dir() / "a.flac"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"fLaC" + os.urandom(2000))
    assert_bad(load(corpus.add(), tokenizer), "unreadable")


def test_truncated_flac_is_none(corpus, tokenizer):
    path = write_audio(corpus.shard_dir() / "a.flac", seconds=4.0)
    path.write_bytes(path.read_bytes()[:200])
    ds = load(corpus.add(duration=4.0), tokenizer)
    assert ds[0] is None
    assert set(dataset.drain_bad_audio_counts()) <= {"unreadable", "empty", "duration_mismatch"}


def test_zero_byte_file_is_none_counted_empty(corpus, tokenizer):
    path = corpus.shard_dir() / "a.flac"
    path.parent.mkdir(parents=True)
    path.touch()
    assert_bad(load(corpus.add(), tokenizer), "empty")


def test_file_with_zero_samples_is_none_counted_empty(corpus, tokenizer):
    assert_bad(load(corpus.add(member="a.wav", audio=dict(seconds=0.0)), tokenizer), "empty")


def test_non_finite_samples_are_none_counted_non_finite(corpus, tokenizer):
    path = corpus.shard_dir() / "a.wav"
    path.parent.mkdir(parents=True)
    samples = np.full(16000, 0.1, dtype=np.float32)
    samples[100] = np.nan
    sf.write(str(path), samples, 16000, subtype="FLOAT")
    assert_bad(load(corpus.add(member="a.wav"), tokenizer), "non_finite")


def test_decoded_length_far_from_manifest_is_duration_mismatch(corpus, tokenizer):
    assert_bad(
        load(corpus.add(duration=3.0, audio=dict(seconds=1.0)), tokenizer), "duration_mismatch"
    )


def test_decoded_length_within_tolerance_is_accepted(corpus, tokenizer):
    ds = load(corpus.add(duration=1.2, audio=dict(seconds=1.0)), tokenizer, duration_tolerance=0.25)
    assert ds[0] is not None


def test_bad_audio_warnings_are_rate_limited(corpus, tokenizer, caplog):
    for k in range(120):
        corpus.add(member=f"missing_{k}.flac")
    ds = load(corpus, tokenizer)
    with caplog.at_level(logging.WARNING, logger="dataset"):
        assert all(ds[i] is None for i in range(len(ds)))
    lines = [r.getMessage() for r in caplog.records if r.name == "dataset"]
    assert len(lines) == 5 + 2  # the first five, then the 10th and the 100th
    assert "shard=src/hi/shard_0000" in lines[0] and "missing_0.flac" in lines[0]
    assert dataset.drain_bad_audio_counts() == {"missing": 120}


# ------------------------------------------------------------------------------------------ collate


def item(n_samples, tokens, lang="hi", duration=1.0):
    return {
        "signal": torch.ones(n_samples),
        "tokens": torch.tensor(tokens, dtype=torch.int64),
        "duration": duration,
        "lang": lang,
        "index": 0,
    }


def test_collate_pads_to_longest_and_drops_none():
    batch = dataset.collate_asr_batch(
        [item(5, [1, 2, 3], "hi", 0.5), None, item(8, [4], "en", 0.8)]
    )
    assert batch.signal.shape == (2, 8) and batch.signal.dtype == torch.float32
    assert batch.tokens.shape == (2, 3) and batch.tokens.dtype == torch.int64
    assert batch.signal_len.tolist() == [5, 8] and batch.signal_len.dtype == torch.int64
    assert batch.token_len.tolist() == [3, 1] and batch.token_len.dtype == torch.int64
    assert batch.signal[0, 5:].abs().sum() == 0 and batch.tokens[1, 1:].abs().sum() == 0
    assert batch.langs == ["hi", "en"] and batch.durations == [0.5, 0.8]
    assert not batch.is_empty


def test_batch_whose_items_all_failed_is_explicitly_empty(corpus, tokenizer):
    ds = load(corpus.add(audio=None).add(member="b.flac", audio=None), tokenizer)
    batch = dataset.collate_asr_batch([ds[0], ds[1]])
    assert batch.is_empty and batch.batch_size == 0
    assert batch.signal.shape == (0, 0) and batch.tokens.shape == (0, 0)
    assert batch.signal_len.shape == (0,) and batch.token_len.shape == (0,)
    assert batch.langs == [] and batch.durations == []
    assert batch.bad_audio == {"missing": 2}


def test_collate_drains_the_counts_so_each_bad_item_is_reported_once(corpus, tokenizer):
    ds = load(corpus.add(audio=None).add(member="b.flac", audio={}), tokenizer)
    assert dataset.collate_asr_batch([ds[0], ds[1]]).bad_audio == {"missing": 1}
    assert dataset.collate_asr_batch([ds[1]]).bad_audio == {}


# ------------------------------------------------------------------------------------------ tokens


def test_language_tag_is_the_first_token_and_a_single_id(corpus, tokenizer):
    tokens = load(corpus.add(text="नमस्ते भारत", audio={}), tokenizer)[0]["tokens"].tolist()
    assert tokens[0] == tokenizer.token_to_id("<|hi|>")
    assert tokenizer.ids_to_tokens(tokens)[0] == "<|hi|>"
    assert tokens[1:] == tokenizer.text_to_ids("नमस्ते भारत")


def test_plain_text_to_ids_would_put_a_lone_separator_before_the_tag(tokenizer):
    # The reason for building [tag] + text_to_ids(rest): the whole text gives '▁' first.
    pieces = tokenizer.ids_to_tokens(tokenizer.text_to_ids("<|hi|> नमस्ते भारत"))
    assert pieces[:2] == ["▁", "<|hi|>"]


def test_tokens_are_truncated_to_max_token_len(corpus, tokenizer):
    ds = load(
        corpus.add(text=" ".join(["hello world"] * 20), duration=10.0, audio=dict(seconds=10.0)),
        tokenizer,
        max_token_len=7,
    )
    tokens = ds[0]["tokens"].tolist()
    assert len(tokens) == 7 and tokens[0] == tokenizer.token_to_id("<|hi|>")
    assert tokens[1:] == tokenizer.text_to_ids(" ".join(["hello world"] * 20))[:6]
    assert ds.token_lengths[0] == 7 and ds.load_summary["truncated_to_max_token_len"] == 1


def test_tokenizer_without_a_tag_piece_fails_at_load_naming_the_tag(corpus, tokenizer):
    with pytest.raises(ValueError, match=r"<\|ta\|>.*TOKENIZER_DIR"):
        load(corpus.add(lang="ta", audio={}), tokenizer)


def test_text_without_its_language_tag_fails_at_load_naming_the_row(corpus, tokenizer):
    corpus.add(audio={}).add(audio={})
    corpus.rows[1]["text"] = "<|en|> hello"  # lang stays "hi"
    with pytest.raises(ValueError, match=r"row 1.*<\|lang\|>"):
        load(corpus, tokenizer)


class PerRowTokenizer:
    """Wraps a tokenizer so that only its public per-row methods are visible (no bulk processor)."""

    def __init__(self, inner):
        self.inner = inner
        self.vocab_size = inner.vocab_size

    def text_to_ids(self, text):
        return self.inner.text_to_ids(text)

    def token_to_id(self, token):
        return self.inner.token_to_id(token)

    def ids_to_tokens(self, ids):
        return self.inner.ids_to_tokens(ids)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    texts=st.lists(st.text(alphabet="नमस्तेभारतhelowrd ।,'", max_size=40), min_size=1, max_size=30),
    max_ids=st.one_of(st.none(), st.integers(0, 6)),
    per_row=st.booleans(),
)
def test_bulk_encoding_equals_per_item_text_to_ids_truncated(tokenizer, texts, max_ids, per_row):
    tok = PerRowTokenizer(tokenizer) if per_row else tokenizer
    offsets, ids, full = training_cache.encode_transcripts(
        training_cache.encoder_for(tok), pa.array(texts, pa.large_string()), max_ids
    )
    expected = [tokenizer.text_to_ids(t) for t in texts]
    assert full.tolist() == [len(e) for e in expected]
    assert [ids[offsets[r] : offsets[r + 1]].tolist() for r in range(len(texts))] == [
        e[:max_ids] for e in expected
    ]


def test_items_carry_the_same_tokens_as_tokenizing_on_the_fly(corpus, tokenizer):
    texts = ["नमस्ते भारत", "hello world speech", "आज कल मराठी data", "test"]
    for k, text in enumerate(texts):
        corpus.add(member=f"{k}.flac", text=text, lang=LANGS[k % 3], audio={})
    ds = load(corpus, tokenizer)
    for k, text in enumerate(texts):
        tag = tokenizer.token_to_id(lang_tag(LANGS[k % 3]))
        assert ds[k]["tokens"].tolist() == vocabulary.tokenize_transcript(tokenizer, tag, text, 512)
        assert ds[k]["tokens"].dtype == torch.int64


@pytest.mark.parametrize("workers", [1, 2])
def test_text_read_in_batches_gives_the_same_tokens_and_row_numbers(
    corpus, tokenizer, monkeypatch, workers
):
    monkeypatch.setattr(training_cache, "_BATCH_ROWS", 2)
    texts = [" ".join(WORDS[k % 7 : k % 7 + 1 + k % 4]) for k in range(10)]
    for k, text in enumerate(texts):
        corpus.add(member=f"{k}.flac", text=text, audio={})
    path = corpus.root / "train_manifest.parquet"
    pq.write_table(pa.Table.from_pylist(corpus.rows), path, row_group_size=3)
    ds = dataset.LocalShardDataset(
        path, tokenizer, progress=False, max_token_len=4, build_workers=workers
    )
    tag = tokenizer.token_to_id("<|hi|>")
    assert [ds[k]["tokens"].tolist() for k in range(10)] == [
        vocabulary.tokenize_transcript(tokenizer, tag, t, 4) for t in texts
    ]
    corpus.rows[7]["text"] = "<|en|> hello"
    pq.write_table(pa.Table.from_pylist(corpus.rows), path, row_group_size=3)
    with pytest.raises(ValueError, match="row 7"):
        dataset.LocalShardDataset(path, tokenizer, progress=False, build_workers=workers)


# ------------------------------------------------------------------------------------------ feasibility


def test_utterances_with_more_tokens_than_encoder_frames_are_dropped_and_counted(corpus, tokenizer):
    long_text = " ".join(["hello world speech"] * 10)  # far more than 12 tokens
    corpus.add(member="ok.flac", audio={})  # 1 s = 12 frames
    corpus.add(member="long.flac", text=long_text, audio={})  # infeasible at 1 s
    corpus.add(member="ok_en.flac", lang="en", text="hello", audio={})
    corpus.add(
        member="long_en.flac", lang="en", text=long_text, duration=10.0, audio=dict(seconds=10.0)
    )  # 125 frames: fine
    ds = load(corpus, tokenizer, frame_seconds=0.08)
    assert len(ds) == 3
    assert ds.manifest_rows.tolist() == [0, 2, 3]
    assert ds.load_summary["rows_read"] == 4 and ds.load_summary["rows_kept"] == 3
    assert ds.load_summary["dropped"]["infeasible_tokens_gt_frames"] == 1
    assert ds.load_summary["dropped_by_lang"] == {"hi": {"infeasible_tokens_gt_frames": 1}}
    assert ds.durations.tolist() == [1.0, 1.0, 10.0]
    assert ds.languages.tolist() == ["hi", "en", "en"]
    frames = np.floor(ds.durations / 0.08 + 1e-9)
    assert (ds.token_lengths <= frames).all()


def test_feasibility_counts_the_truncated_length(corpus, tokenizer):
    long_text = " ".join(["hello world speech"] * 10)
    ds = load(corpus.add(text=long_text, audio={}), tokenizer, max_token_len=12)  # 12 frames in 1 s
    assert len(ds) == 1


def test_a_shorter_frame_makes_the_same_utterance_feasible(corpus, tokenizer):
    corpus.add(text=" ".join(["hello world"] * 4), duration=1.0, audio={})
    assert len(load(corpus, tokenizer, frame_seconds=0.5)) == 0
    assert len(load(corpus, tokenizer, frame_seconds=0.01)) == 1


# ------------------------------------------------------------------------------------------ mapping


def test_reopening_the_cache_copies_nothing(corpus, tokenizer):
    for k in range(3000):
        corpus.add(member=f"{k}.flac", text=" ".join(WORDS[: 1 + k % 5]), duration=5.0)
    path = corpus.write()
    dataset.LocalShardDataset(path, tokenizer, progress=False)
    before = pa.total_allocated_bytes()
    ds = dataset.LocalShardDataset(path, tokenizer, progress=False)
    assert not ds.load_summary["cache_built"]
    assert ds.durations.base is not None and not ds.durations.flags.writeable
    assert pa.total_allocated_bytes() - before < 4096


def test_pickled_dataset_carries_settings_not_the_table(corpus, tokenizer):
    for k in range(3000):
        corpus.add(member=f"{k}.flac", text=" ".join(WORDS * 3), duration=10.0)
    corpus.add(member="real.flac", audio={})
    ds = load(corpus, tokenizer)
    extra = len(pickle.dumps(ds)) - len(pickle.dumps(tokenizer))
    assert extra < 8192  # the transcripts alone are > 300 kB
    clone = pickle.loads(pickle.dumps(ds))
    assert (
        len(clone) == len(ds)
        and clone[len(ds) - 1]["tokens"].tolist() == ds[len(ds) - 1]["tokens"].tolist()
    )


def test_missing_manifest_column_fails_naming_it(corpus, tokenizer):
    corpus.add(audio={})
    for row in corpus.rows:
        del row["audio_filepath"]
    with pytest.raises(ValueError, match="audio_filepath"):
        load(corpus, tokenizer)


# ------------------------------------------------------------------------------------------ end to end


def test_dataloader_with_two_workers_yields_every_good_item_and_sums_bad_counts(corpus, tokenizer):
    for k in range(24):
        corpus.add(member=f"{k}.flac", audio=None if k % 6 == 0 else dict(seconds=1.0))
    ds = load(corpus, tokenizer)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=3,
        num_workers=2,
        collate_fn=dataset.collate_asr_batch,
        multiprocessing_context="fork",
    )
    batches = list(loader)
    assert sum(b.batch_size for b in batches) == 20
    assert sum(b.bad_audio.get("missing", 0) for b in batches) == 4
    assert all(b.signal.shape[1] == 16000 for b in batches if not b.is_empty)


# ------------------------------------------------------------------------------------------ start-up check


def test_a_manifest_whose_audio_is_all_missing_fails_the_start_up_check_naming_the_directory(
    corpus, tokenizer
):
    from training_step import NoTrainingData, check_audio_sample

    for k in range(10):
        corpus.add(member=f"{k}.flac")  # no file written
    ds = load(corpus, tokenizer)
    with pytest.raises(
        NoTrainingData, match=r"none of 8 sampled audio files.*expected under .*shard_0000"
    ):
        check_audio_sample(ds, samples=8, rank=1)


def test_some_missing_audio_only_warns_at_start_up(corpus, tokenizer):
    from training_step import check_audio_sample

    for k in range(10):
        corpus.add(member=f"{k}.flac", audio={} if k % 2 else None)
    ds = load(corpus, tokenizer)
    bad = check_audio_sample(ds, samples=10, rank=0)  # no exception: a warning
    assert sorted(os.path.basename(p) for p, _ in bad) == [f"{k}.flac" for k in (0, 2, 4, 6, 8)]
    assert {reason for _, reason in bad} == {"no such file"}


def test_a_dataloader_worker_that_delivers_nothing_fails_the_job_instead_of_hanging(
    corpus, tokenizer, monkeypatch
):
    import config
    from training_step import build_dataloader

    for k in range(8):
        corpus.add(member=f"{k}.flac", audio={})
    ds = load(corpus, tokenizer)
    monkeypatch.setattr(config, "NUM_WORKERS", 1)
    monkeypatch.setattr(config, "GRAD_ACCUM", 1)
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 2.0)
    monkeypatch.setattr(config, "COLLECTIVE_TIMEOUT_MINUTES", 2 / 60)
    monkeypatch.setattr(dataset, "load_audio", lambda *a, **k: __import__("time").sleep(600))
    batching = BatchingSettings.from_config()
    loader, _ = build_dataloader(ds, batching, world_size=1, rank=0, pin_memory=False)
    assert loader.timeout == 2
    with pytest.raises(RuntimeError, match="DataLoader timed out after 2"):
        next(iter(loader))


def stuck_loader(corpus, tokenizer, monkeypatch, tmp_path, stuck_attempts: int):
    """A training DataLoader with 2 workers whose first ``stuck_attempts`` forks never report
    their start (alive, stuck before their first line, as a child stuck inside os.fork is)."""
    import config
    from training_step import build_dataloader

    for k in range(12):
        corpus.add(member=f"{k}.flac", audio={})
    ds = load(corpus, tokenizer)
    monkeypatch.setattr(config, "NUM_WORKERS", 2)
    monkeypatch.setattr(config, "GRAD_ACCUM", 1)
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 2.0)
    monkeypatch.setattr(dataset, "WORKER_START_SECONDS", 2.0)
    batching = BatchingSettings.from_config()
    clean = build_dataloader(ds, batching, world_size=1, rank=0, pin_memory=False)[0]
    torch.manual_seed(5)
    expected = [b.indices for b in clean]
    expected_rng = torch.get_rng_state()

    attempts = tmp_path / "attempts"
    attempts.write_text("0")
    real_init, real_discard = dataset._init_worker, dataset._discard

    def init(parent, then, worker_id):
        if int(attempts.read_text()) < stuck_attempts:
            __import__("time").sleep(600)
        real_init(parent, then, worker_id)

    def discard(iterator, stuck):
        attempts.write_text(str(int(attempts.read_text()) + 1))
        real_discard(iterator, stuck)

    monkeypatch.setattr(dataset, "_init_worker", init)
    monkeypatch.setattr(dataset, "_discard", discard)
    loader = build_dataloader(ds, batching, world_size=1, rank=0, pin_memory=False)[0]
    torch.manual_seed(5)
    return loader, expected, expected_rng


def test_workers_stuck_at_their_fork_are_forked_again_and_give_the_same_batches(
    corpus, tokenizer, monkeypatch, tmp_path, caplog
):
    loader, expected, expected_rng = stuck_loader(corpus, tokenizer, monkeypatch, tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="dataset"):
        batches = [b.indices for b in loader]
    assert batches == expected  # the sampler's position as it was before the first fork
    assert torch.equal(torch.get_rng_state(), expected_rng)  # one seed drawn, as without a retry
    warnings = [r.getMessage() for r in caplog.records if "not started" in r.getMessage()]
    assert len(warnings) == 1 and "killed and forked again (attempt 1 of 3)" in warnings[0]


def test_workers_stuck_at_every_fork_end_the_job_naming_num_workers(
    corpus, tokenizer, monkeypatch, tmp_path
):
    monkeypatch.setattr(dataset, "WORKER_START_ATTEMPTS", 2)
    loader, _, _ = stuck_loader(corpus, tokenizer, monkeypatch, tmp_path, 2)
    with pytest.raises(dataset.WorkersNeverStarted, match="in 2 attempts of 2 s.*NUM_WORKERS=0"):
        next(iter(loader))


def test_the_worker_start_check_works_in_a_process_with_descriptors_past_1024():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # a rank's sockets and maps
    try:
        loader = dataset.SignalSafeDataLoader(list(range(8)), batch_size=2, num_workers=2)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
