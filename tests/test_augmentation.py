"""Training-time augmentation: speed perturbation planned by the sampler (sampler.py, guarantee 9)
and played by the dataset (dataset.py), off by default.

The max-batch bound with speed perturbation: tests/test_max_batch.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import config
import dataset
from sampler import BatchingSettings, DurationBucketBatchSampler, PlannedBatch, SamplerStateError
from tests.test_dataset import Corpus

REPO = Path(__file__).resolve().parents[1]
SR = 16000
SPEEDS = (0.9, 1.0, 1.1)


@pytest.fixture(autouse=True)
def fresh_bad_audio_counters(monkeypatch):
    monkeypatch.setattr(dataset, "_bad_audio_pending", dataset.collections.Counter())
    monkeypatch.setattr(dataset, "_bad_audio_logged", dataset.collections.Counter())


# ------------------------------------------------------------------------------------------ helpers


def write_tone(path: Path, hz: float, seconds: float, sr: int = SR, amplitude: float = 0.3):
    t = np.arange(int(round(seconds * sr))) / sr
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32), sr)
    return path


def write_speech_like(path: Path, seconds: float, seed: int, sr: int = SR):
    """Noise under a slow random envelope: every utterance different, loud and quiet parts."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sr))
    envelope = np.repeat(rng.uniform(0.02, 0.4, n // 800 + 1), 800)[:n]
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), (envelope * rng.standard_normal(n)).astype(np.float32), sr)
    return path


def peak_hz(signal: np.ndarray, sr: int = SR) -> float:
    """The frequency of the strongest component (a Hann window, zero-padded to 0.01 Hz bins)."""
    x = np.asarray(signal, dtype=np.float64) * np.hanning(len(signal))
    n = 1 << math.ceil(math.log2(sr * 100))
    return float(np.argmax(np.abs(np.fft.rfft(x, n))) * sr / n)


def planned(rows, speeds=None) -> PlannedBatch:
    return PlannedBatch(rows, speeds=speeds)


@pytest.fixture
def tones(tmp_path, tokenizer):
    """Three 2 s tones of 1 kHz: at 16 kHz, at 48 kHz and at 8 kHz."""
    corpus = Corpus(tmp_path)
    for k, rate in enumerate((16000, 48000, 8000)):
        write_tone(corpus.shard_dir() / f"{k}.flac", 1000.0, 2.0, sr=rate)
        corpus.add(member=f"{k}.flac", duration=2.0)
    return corpus.write()


@pytest.fixture
def utterances(tmp_path, tokenizer):
    """24 speech-like utterances of 1-3 s in two languages."""
    corpus = Corpus(tmp_path)
    rng = np.random.default_rng(5)
    for k in range(24):
        lang = ("hi", "en")[k % 2]
        seconds = round(float(rng.uniform(1.0, 3.0)), 2)
        shard = f"src/{lang}/shard_0000"
        write_speech_like(corpus.shard_dir(shard) / f"{k}.flac", seconds, seed=k)
        text = "नमस्ते भारत" if lang == "hi" else "hello world"
        corpus.add(member=f"{k}.flac", duration=seconds, lang=lang, shard=shard, text=text)
    return corpus.write()


def load(manifest, tokenizer) -> dataset.LocalShardDataset:
    return dataset.LocalShardDataset(manifest, tokenizer, progress=False)


def settings(**changes) -> BatchingSettings:
    base = dict(
        boundaries=(2.0,),
        max_batch_duration=6.0,
        grad_accum=1,
        seed=11,
        base_languages=(),
        base_share=0.0,
        speed_factors=SPEEDS,
    )
    return BatchingSettings.from_config(**{**base, **changes})


# ------------------------------------------------------------------------------------------ speed


@pytest.mark.parametrize("factor", [0.9, 1.1])
@pytest.mark.parametrize("row", [0, 1, 2], ids=["16k", "48k", "8k"])
def test_a_speed_factor_divides_the_length_and_multiplies_the_pitch(tones, tokenizer, factor, row):
    ds = load(tones, tokenizer)
    clean = ds[row]["signal"].numpy()
    (item,) = ds.__getitems__(planned([row], speeds=(factor,)))
    played = item["signal"].numpy()
    assert abs(len(played) - 2.0 * SR / factor) <= 1
    assert peak_hz(played) == pytest.approx(1000.0 * factor, abs=0.5)
    assert peak_hz(clean) == pytest.approx(1000.0, abs=0.5)
    assert item["duration"] == pytest.approx(2.0 / factor)


def test_the_duration_check_compares_the_file_with_the_manifest_before_the_speed_change(
    tmp_path, tokenizer
):
    # 10 s played at 0.9 lasts 11.1 s, far beyond AUDIO_DURATION_TOLERANCE of the manifest's 10 s;
    # the file itself matches the manifest, so it is good audio.
    corpus = Corpus(tmp_path)
    write_tone(corpus.shard_dir() / "long.flac", 440.0, 10.0)
    corpus.add(member="long.flac", duration=10.0, text="नमस्ते भारत")
    ds = load(corpus.write(), tokenizer)
    (item,) = ds.__getitems__(planned([0], speeds=(0.9,)))
    assert item is not None and abs(len(item["signal"]) - 10.0 * SR / 0.9) <= 1
    assert dataset.drain_bad_audio_counts() == {}


def test_each_planned_row_plays_at_its_factor_and_the_batch_counts_the_seconds_played(
    utterances, tokenizer
):
    ds = load(utterances, tokenizer)
    sampler = DurationBucketBatchSampler(
        ds.durations,
        ds.lang_codes,
        settings(frame_seconds=ds.frame_seconds),
        language_names=ds.lang_names,
        token_lengths=ds.token_lengths,
    )
    factors = set()
    for batch in sampler:
        collated = dataset.collate_asr_batch(ds.__getitems__(batch))
        for row, factor, n, seconds in zip(
            batch, batch.speeds, collated.signal_len.tolist(), collated.durations
        ):
            factors.add(factor)
            assert abs(n - len(ds[row]["signal"]) / factor) <= 1
            assert seconds == pytest.approx(ds.durations[row] / factor)
    assert factors == set(SPEEDS)


# ------------------------------------------------------------------------------------------ the plan


def lognormal_corpus(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    durations = np.clip(rng.lognormal(np.log(6.0), 0.6, n), 0.5, 20.0)
    return durations, np.array(["hi", "en", "ta"])[rng.integers(0, 3, n)]


def sampler_for(durations, languages, **changes) -> DurationBucketBatchSampler:
    kwargs = {k: changes.pop(k) for k in ("world_size", "rank", "token_lengths") if k in changes}
    base = dict(boundaries=(3.0, 5.0, 8.0, 12.0, 16.0), max_batch_duration=90.0)
    return DurationBucketBatchSampler(
        durations, languages, settings(**{**base, **changes}), **kwargs
    )


def test_a_batch_holds_at_most_max_batch_duration_seconds_of_the_audio_it_plays():
    durations, languages = lognormal_corpus(20_000)
    sampler = sampler_for(durations, languages)
    fullest = 0.0
    for batch in sampler:
        played = durations[batch] / np.array(batch.speeds)
        assert len(batch) == 1 or played.sum() <= 90.0 + 1e-9, (batch, played.sum())
        fullest = max(fullest, played.sum())
    assert fullest > 0.98 * 90.0  # packed by the seconds played, up to the cap


def test_batch_mates_have_nearly_equal_played_lengths():
    durations, languages = lognormal_corpus(20_000)
    sampler = sampler_for(durations, languages)
    stats = sampler.epoch_stats()
    padded = played = 0.0
    for batch in sampler:
        seconds = durations[batch] / np.array(batch.speeds)
        padded += len(batch) * seconds.max()
        played += seconds.sum()
    assert played / padded >= 0.95
    assert stats["padding_efficiency"] >= 0.95


def test_factors_are_drawn_uniformly_and_afresh_each_epoch():
    durations, languages = lognormal_corpus(30_000)
    sampler = sampler_for(durations, languages)
    speed_of = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        drawn = {}
        for batch in sampler:
            drawn.update(zip(batch, batch.speeds))
        speed_of.append(drawn)
        counts = np.array([sum(s == f for s in drawn.values()) for f in SPEEDS])
        assert np.all(np.abs(counts / counts.sum() - 1 / 3) < 0.02), counts
        stats = sampler.epoch_stats()["speed_factors"]
        assert sum(stats.values()) >= counts.sum() and set(stats) == {"0.9", "1", "1.1"}
    common = set(speed_of[0]) & set(speed_of[1])
    changed = sum(speed_of[0][r] != speed_of[1][r] for r in common)
    assert changed / len(common) == pytest.approx(2 / 3, abs=0.03)


def test_a_row_with_more_tokens_than_frames_at_its_factor_plays_at_one():
    durations, languages = lognormal_corpus(5_000)
    frame = config.ENCODER_FRAME_SECONDS
    # Exactly as many tokens as frames at 1.0: feasible at 0.9 and 1.0, at 1.1 for few rows.
    tokens = np.floor(durations / frame + 1e-9).astype(np.int64)
    assert np.mean(tokens > np.floor(durations / 1.1 / frame + 1e-9)) > 0.8
    sampler = sampler_for(durations, languages, token_lengths=tokens, max_joint_cells=-1)
    for batch in sampler:
        for row, factor in zip(batch, batch.speeds):
            assert tokens[row] <= math.floor(durations[row] / factor / frame + 1e-9), (row, factor)
    played = sampler.epoch_stats()["speed_factors"]
    total = sum(played.values())
    assert played["1.1"] < 0.2 * played["0.9"]  # the draws of 1.1 went to 1 instead
    assert played["1"] == total - played["0.9"] - played["1.1"] > 0.55 * total


def test_speed_factors_of_one_or_none_are_the_plan_without_perturbation():
    durations, languages = lognormal_corpus(5_000)
    plain = sampler_for(durations, languages, speed_factors=())
    for factors in ((1.0,), (1.0, 1.0)):
        same = sampler_for(durations, languages, speed_factors=factors)
        assert same.speed_factors == ()
        assert list(same) == list(plain)
    assert all(batch.speeds is None for batch in plain)


@pytest.mark.parametrize("factors", [(0.0,), (90.0, 110.0), (float("nan"),), tuple([1.1] * 17)])
def test_a_speed_factor_outside_the_range_is_refused_naming_it(factors):
    durations, languages = lognormal_corpus(100)
    with pytest.raises(ValueError, match="speed_factors"):
        sampler_for(durations, languages, speed_factors=factors)


@pytest.mark.parametrize(
    "raw,expected",
    [("0.9,1.0,1.1", (0.9, 1.0, 1.1)), ("1", ()), ("", ()), (" 0.95 , 1.05 ", (0.95, 1.05))],
)
def test_speed_perturb_knob_reads_factors_and_one_means_off(raw, expected):
    assert config.read_config({"SPEED_PERTURB": raw})["SPEED_PERTURB"].value == expected


@pytest.mark.parametrize("raw", ["90,100,110", "fast", "0.9;1.1", "-1"])
def test_a_bad_speed_perturb_is_one_line_naming_the_variable(raw):
    with pytest.raises(config.ConfigError, match=r"SPEED_PERTURB=.*expected comma-separated speed"):
        config.read_config({"SPEED_PERTURB": raw})


def test_augmentation_is_off_by_default():
    assert config.read_config({})["SPEED_PERTURB"].value == ()
    assert BatchingSettings.from_config().speed_factors == ()


def test_a_resumed_sampler_replays_the_same_planned_batches():
    durations, languages = lognormal_corpus(8_000)
    s = sampler_for(durations, languages, world_size=2, rank=1)
    s.set_epoch(2)
    plan = list(s)
    fresh = sampler_for(durations, languages, world_size=2, rank=1)
    fresh.load_state_dict(s.state_dict() | {"position": 7})
    rest = list(fresh)
    assert rest == plan[7:]
    assert [b.speeds for b in rest] == [b.speeds for b in plan[7:]]


def test_a_checkpoint_planned_with_other_speed_factors_is_refused_mid_epoch():
    durations, languages = lognormal_corpus(2_000)
    state = sampler_for(durations, languages).state_dict() | {"position": 3}
    other = sampler_for(durations, languages, speed_factors=(0.95, 1.05))
    with pytest.raises(SamplerStateError, match=r"speed_factors: checkpoint \[0.9, 1.0, 1.1\]"):
        other.load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "speed_factors"}  # saved before the setting
    with pytest.raises(SamplerStateError, match="SPEED_PERTURB=1 reproduces its plan"):
        sampler_for(durations, languages).load_state_dict(older)
    sampler_for(durations, languages, speed_factors=()).load_state_dict(older)


# ------------------------------------------------------------------------------------------ off by default


def test_with_the_default_knobs_a_planned_batch_is_the_clean_audio_bit_for_bit(
    utterances, tokenizer
):
    ds = load(utterances, tokenizer)
    sampler = DurationBucketBatchSampler(
        ds.durations,
        ds.lang_codes,
        BatchingSettings.from_config(
            boundaries=(2.0,), max_batch_duration=6.0, grad_accum=1, base_languages=()
        ),
        language_names=ds.lang_names,
        token_lengths=ds.token_lengths,
    )
    for batch in sampler:
        assert batch.speeds is None
        for row, item in zip(batch, ds.__getitems__(batch)):
            clean = dataset.load_audio(
                ds.audio_path(row), expected_duration=float(ds.durations[row])
            )
            assert np.array_equal(item["signal"].numpy(), clean)
            assert item["duration"] == ds.durations[row]
