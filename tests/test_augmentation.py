"""Training-time augmentation: speed perturbation planned by the sampler (sampler.py, guarantee 9)
and played by the dataset, additive noise in the dataset workers (dataset.py), deterministic per
(SEED, epoch, plan position), never applied to validation or evaluation, off by default.

The max-batch bound with speed perturbation: tests/test_max_batch.py. A real train.py run
interrupted and resumed with augmentation on: test_a_resumed_run_trains_on_the_same_augmented_audio.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

import config
import dataset
from dataset import NoiseDirError, NoiseSettings
from sampler import BatchingSettings, DurationBucketBatchSampler, PlannedBatch, SamplerStateError
from tests.test_dataset import Corpus
from training_step import build_dataloader

REPO = Path(__file__).resolve().parents[1]
SR = 16000
SPEEDS = (0.9, 1.0, 1.1)
NOISY = NoiseSettings(prob=1.0, snr_db=(5.0, 15.0))


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


def low_share(noise: np.ndarray, below_hz: float = 500.0) -> float:
    """The share of ``noise``'s power below ``below_hz``."""
    power = np.abs(np.fft.rfft(np.asarray(noise, dtype=np.float64))) ** 2
    return float(power[np.fft.rfftfreq(len(noise), 1 / SR) < below_hz].sum() / power.sum())


def snr_db(clean: np.ndarray, noisy: np.ndarray) -> float:
    """The definition: 10 log10(energy of the clean signal / energy of what was added)."""
    clean = np.asarray(clean, dtype=np.float64)
    added = np.asarray(noisy, dtype=np.float64) - clean
    return 10 * math.log10(np.sum(clean**2) / np.sum(added**2))


def planned(rows, speeds=None, seed=1, epoch=0, start=0) -> PlannedBatch:
    return PlannedBatch(rows, seed=seed, epoch=epoch, start=start, speeds=speeds)


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


def load(manifest, tokenizer, noise=None) -> dataset.LocalShardDataset:
    return dataset.LocalShardDataset(manifest, tokenizer, progress=False, noise=noise)


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


def epoch_batches(loader, sampler, epoch: int) -> list[tuple]:
    """(rows, speeds, plan start, each signal) of every batch of ``epoch``, as the loader hands them."""
    sampler.set_epoch(epoch)
    plan = list(sampler)  # the attributes of each PlannedBatch, in the order the loader follows
    sampler.set_epoch(epoch)
    out = []
    for planned_batch, batch in zip(plan, loader, strict=True):
        assert batch.indices == list(planned_batch)
        signals = [batch.signal[r, :n].clone() for r, n in enumerate(batch.signal_len.tolist())]
        out.append((list(planned_batch), planned_batch.speeds, planned_batch.start, signals))
    return out


def same_batches(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(
        x[:3] == y[:3] and all(torch.equal(s, t) for s, t in zip(x[3], y[3], strict=True))
        for x, y in zip(a, b)
    )


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


@pytest.mark.parametrize(
    "env,message",
    [
        ({"NOISE_PROB": "1.5"}, "NOISE_PROB='1.5': expected a probability"),
        ({"NOISE_SNR_DB": "20,5"}, "NOISE_SNR_DB='20,5': expected 'low,high'"),
        ({"NOISE_SNR_DB": "loud"}, "NOISE_SNR_DB='loud': expected 'low,high'"),
    ],
)
def test_bad_noise_knobs_are_refused_naming_them(env, message):
    with pytest.raises(config.ConfigError, match=message):
        config.read_config(env)


def test_augmentation_is_off_by_default():
    knobs = config.read_config({})
    assert knobs["SPEED_PERTURB"].value == () and knobs["NOISE_PROB"].value == 0.0
    assert NoiseSettings.from_config().prob == 0.0
    assert BatchingSettings.from_config().speed_factors == ()


def test_plan_positions_are_unique_and_the_same_on_every_rank_and_world_size():
    durations, languages = lognormal_corpus(8_000)

    def played(world_size):
        out = {}
        for rank in range(world_size):
            s = sampler_for(durations, languages, world_size=world_size, rank=rank)
            for batch in s:
                for j, (row, speed) in enumerate(zip(batch, batch.speeds)):
                    assert batch.start + j not in out
                    out[batch.start + j] = (row, speed)
        return out

    one, four = played(1), played(4)
    common = set(one) & set(four)
    assert len(common) > 0.95 * len(four)  # only the few trimmed batches differ
    assert all(one[p] == four[p] for p in common)


def test_a_resumed_sampler_replays_the_same_planned_batches():
    durations, languages = lognormal_corpus(8_000)
    s = sampler_for(durations, languages, world_size=2, rank=1)
    s.set_epoch(2)
    plan = list(s)
    fresh = sampler_for(durations, languages, world_size=2, rank=1)
    fresh.load_state_dict(s.state_dict() | {"position": 7})
    rest = list(fresh)
    assert rest == plan[7:]
    assert [(b.speeds, b.start, b.epoch, b.seed) for b in rest] == [
        (b.speeds, b.start, b.epoch, b.seed) for b in plan[7:]
    ]


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


# ------------------------------------------------------------------------------------------ noise


def test_generated_noise_is_added_at_an_snr_within_the_asked_range(utterances, tokenizer):
    ds = load(utterances, tokenizer, noise=NOISY)
    rows = list(range(len(ds)))
    items = ds.__getitems__(planned(rows))
    measured = [
        snr_db(ds[i]["signal"].numpy(), item["signal"].numpy()) for i, item in zip(rows, items)
    ]
    assert all(5.0 - 1e-3 <= m <= 15.0 + 1e-3 for m in measured), measured
    assert max(measured) - min(measured) > 5  # drawn per utterance, not one value
    # and the colour too: white noise has 1/16 of its power below 500 Hz, brown nearly all
    low = [low_share(it["signal"].numpy() - ds[i]["signal"].numpy()) for i, it in zip(rows, items)]
    assert min(low) < 0.15 and max(low) > 0.9, low


def test_a_fixed_snr_is_met_to_a_hundredth_of_a_decibel(utterances, tokenizer):
    ds = load(utterances, tokenizer, noise=NoiseSettings(prob=1.0, snr_db=(12.0, 12.0)))
    (item,) = ds.__getitems__(planned([3]))
    assert snr_db(ds[3]["signal"].numpy(), item["signal"].numpy()) == pytest.approx(12.0, abs=0.01)


def test_noise_prob_is_the_share_of_rows_that_get_noise(utterances, tokenizer):
    ds = load(utterances, tokenizer, noise=NoiseSettings(prob=0.3, snr_db=(10.0, 10.0)))
    noisy = 0
    for epoch in range(10):
        rows = list(range(len(ds)))
        items = ds.__getitems__(planned(rows, epoch=epoch))
        noisy += sum(not torch.equal(ds[i]["signal"], it["signal"]) for i, it in zip(rows, items))
    assert noisy / (10 * len(ds)) == pytest.approx(0.3, abs=0.06)


def test_generated_noise_takes_colours_from_white_to_brown():
    rng = np.random.default_rng(0)

    def share(exponent):
        return low_share(dataset.coloured_noise(4 * SR, exponent, SR, rng))

    # white: power spread evenly (500 of 8000 Hz); brown: most of it at the lowest frequencies
    assert share(0.0) == pytest.approx(500 / 8000, abs=0.01)
    assert 0.2 < share(0.5) < share(1.0) < share(1.5) < share(2.0)
    assert share(2.0) > 0.9


def test_the_generated_noise_is_made_once_per_process_for_every_dataset(
    utterances, tokenizer, monkeypatch
):
    made = []
    real = dataset.coloured_noise
    monkeypatch.setattr(dataset, "coloured_noise", lambda *a: made.append(a[1]) or real(*a))
    dataset.generated_noise_bank.cache_clear()
    first = load(utterances, tokenizer, noise=NOISY)  # as train.py's dataset
    second = load(utterances, tokenizer, noise=NOISY)  # as validation's, in the same rank
    assert made == list(dataset.GENERATED_NOISE_EXPONENTS)
    rows = list(range(4))
    a, b = first.__getitems__(planned(rows)), second.__getitems__(planned(rows))
    assert all(torch.equal(x["signal"], y["signal"]) for x, y in zip(a, b))
    dataset.generated_noise_bank.cache_clear()


def test_noise_from_a_directory_is_a_recording_of_it_looped_and_resampled(
    utterances, tokenizer, tmp_path
):
    # One noise file: a 3 kHz tone of 0.5 s at 8 kHz, shorter than every utterance.
    noise_dir = tmp_path / "musan" / "noise" / "free-sound"
    write_tone(noise_dir / "hum.wav", 3000.0, 0.5, sr=8000)
    (noise_dir / "ANNOTATIONS").write_text("not audio")
    ds = load(utterances, tokenizer, noise=NoiseSettings(1.0, (5.0, 15.0), tmp_path / "musan"))
    rows = list(range(len(ds)))
    for i, item in zip(rows, ds.__getitems__(planned(rows))):
        clean = ds[i]["signal"].numpy()
        added = item["signal"].numpy() - clean
        assert 5.0 - 1e-3 <= snr_db(clean, item["signal"].numpy()) <= 15.0 + 1e-3
        assert peak_hz(added) == pytest.approx(3000.0, abs=1.0)
        # looped over the whole utterance, not 0.5 s of it and silence
        quarters = np.array_split(added.astype(np.float64) ** 2, 4)
        assert min(q.mean() for q in quarters) > 0.5 * max(q.mean() for q in quarters)


def test_a_long_noise_file_gives_each_utterance_a_segment_from_its_own_offset(
    utterances, tokenizer, tmp_path
):
    # Noise whose frequency sweeps over 60 s: where a segment starts shows in its frequency.
    t = np.arange(60 * SR) / SR
    sweep = 0.3 * np.sin(2 * np.pi * (100 * t + 30 * t**2))  # 100 Hz rising 60 Hz a second
    (tmp_path / "noise").mkdir()
    sf.write(str(tmp_path / "noise" / "sweep.flac"), sweep.astype(np.float32), SR)
    ds = load(utterances, tokenizer, noise=NoiseSettings(1.0, (10.0, 10.0), tmp_path / "noise"))
    rows = list(range(len(ds)))
    starts = set()
    for i, item in zip(rows, ds.__getitems__(planned(rows))):
        added = item["signal"].numpy() - ds[i]["signal"].numpy()
        starts.add(round(peak_hz(added[: SR // 10]) / 500))
    assert len(starts) > 5


def test_a_relative_noise_dir_is_read_from_where_the_run_started(
    utterances, tokenizer, tmp_path, monkeypatch
):
    write_tone(tmp_path / "noise" / "Hum.FLAC", 3000.0, 0.5)  # the extension in any case
    monkeypatch.chdir(tmp_path)
    ds = load(utterances, tokenizer, noise=NoiseSettings(1.0, (10.0, 10.0), Path("noise")))
    monkeypatch.chdir("/")
    (item,) = ds.__getitems__(planned([0]))
    added = item["signal"].numpy() - ds[0]["signal"].numpy()
    assert peak_hz(added) == pytest.approx(3000.0, abs=1.0)


def test_noise_files_named_in_latin_1_are_read_and_named_by_their_bytes(
    utterances, tokenizer, tmp_path
):
    # A file name that is not UTF-8 (a Latin-1 byte from an old archive): its recording is used...
    (tmp_path / "noise").mkdir()
    write_tone(tmp_path / "noise" / "x.wav", 3000.0, 0.5)
    os.rename(tmp_path / "noise" / "x.wav", os.fsencode(tmp_path / "noise") + b"/caf\xe9.wav")
    ds = load(utterances, tokenizer, noise=NoiseSettings(1.0, (10.0, 10.0), tmp_path / "noise"))
    (item,) = ds.__getitems__(planned([0]))
    assert peak_hz(item["signal"].numpy() - ds[0]["signal"].numpy()) == pytest.approx(3000, abs=1)
    # ...and one that cannot be read is named as its bytes, in a message that prints anywhere
    (tmp_path / "noise" / "x.wav").write_bytes(b"RIFF garbage")
    os.rename(tmp_path / "noise" / "x.wav", os.fsencode(tmp_path / "noise") + b"/b\xe9d.wav")
    with pytest.raises(NoiseDirError) as caught:
        load(utterances, tokenizer, noise=NoiseSettings(1.0, (10.0, 10.0), tmp_path / "noise"))
    message = str(caught.value)
    assert f"noise file {tmp_path / 'noise'}/b\\xe9d.wav is unreadable" in message
    message.encode("utf-8")  # no lone surrogate left in it


def test_a_noise_dir_without_noise_files_is_refused_naming_it(tmp_path, utterances, tokenizer):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("no audio here")
    with pytest.raises(NoiseDirError, match=f"NOISE_DIR={tmp_path / 'empty'} holds no"):
        load(utterances, tokenizer, noise=NoiseSettings(0.5, (10.0, 20.0), tmp_path / "empty"))
    with pytest.raises(NoiseDirError, match="is not a directory"):
        load(utterances, tokenizer, noise=NoiseSettings(0.5, (10.0, 20.0), tmp_path / "nowhere"))


def test_an_unreadable_noise_file_is_refused_naming_it(tmp_path, utterances, tokenizer):
    (tmp_path / "noise").mkdir()
    write_tone(tmp_path / "noise" / "a.flac", 500.0, 1.0)
    (tmp_path / "noise" / "b.wav").write_bytes(b"RIFF garbage")
    with pytest.raises(NoiseDirError, match=r"noise file .*b\.wav is unreadable"):
        load(utterances, tokenizer, noise=NoiseSettings(0.5, (10.0, 20.0), tmp_path / "noise"))


def test_a_noise_dir_is_not_read_while_noise_is_off(tmp_path, utterances, tokenizer):
    ds = load(utterances, tokenizer, noise=NoiseSettings(0.0, (10.0, 20.0), tmp_path / "nowhere"))
    assert len(ds) == 24


def test_a_silent_utterance_stays_silent(tmp_path, tokenizer):
    corpus = Corpus(tmp_path)
    corpus.add(member="quiet.flac", audio=dict(seconds=1.0, value=0.0), text="नमस्ते भारत")
    ds = load(corpus.write(), tokenizer, noise=NOISY)
    (item,) = ds.__getitems__(planned([0]))
    assert not item["signal"].any()


# ------------------------------------------------------------------------------------------ determinism


def test_the_same_seed_gives_the_same_audio_and_another_seed_other_audio(utterances, tokenizer):
    ds = load(utterances, tokenizer, noise=NOISY)
    rows = list(range(8))
    speeds = (0.9, 1.1) * 4

    def audio(**key):
        return [it["signal"] for it in ds.__getitems__(planned(rows, speeds=speeds, **key))]

    first = audio(seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, audio(seed=1)))
    for other in (dict(seed=2), dict(seed=1, epoch=1), dict(seed=1, start=100)):
        assert not any(torch.equal(a, b) for a, b in zip(first, audio(**other))), other


def test_a_row_gets_its_audio_from_its_plan_position_whatever_batch_it_is_fetched_in(
    utterances, tokenizer
):
    ds = load(utterances, tokenizer, noise=NOISY)
    whole = ds.__getitems__(planned([4, 5, 6, 7], start=40))
    alone = ds.__getitems__(planned([6], start=42))
    assert torch.equal(whole[2]["signal"], alone[0]["signal"])


@pytest.mark.parametrize("workers", [1, 2])
def test_any_number_of_dataloader_workers_hands_out_the_same_batches(
    utterances, tokenizer, workers
):
    ds = load(utterances, tokenizer, noise=NOISY)
    batching = settings()
    loader0, sampler0 = build_dataloader(
        ds, batching, world_size=1, rank=0, pin_memory=False, workers=0
    )
    loaderw, samplerw = build_dataloader(
        ds, batching, world_size=1, rank=0, pin_memory=False, workers=workers
    )
    for epoch in (0, 1):
        serial = epoch_batches(loader0, sampler0, epoch)
        assert same_batches(serial, epoch_batches(loaderw, samplerw, epoch))
    assert any(speeds != (1.0,) * len(speeds) for _, speeds, _, _ in serial)


def test_a_dataloader_resumed_mid_epoch_hands_out_the_straight_runs_augmented_batches(
    utterances, tokenizer
):
    batching = settings()
    straight_loader, straight_sampler = build_dataloader(
        load(utterances, tokenizer, noise=NOISY), batching, world_size=1, rank=0,
        pin_memory=False, workers=2,
    )  # fmt: skip
    straight = epoch_batches(straight_loader, straight_sampler, epoch=1)
    position = len(straight) // 2
    state = straight_sampler.state_dict() | {"epoch": 1, "position": position}

    resumed_loader, resumed_sampler = build_dataloader(
        load(utterances, tokenizer, noise=NOISY), batching, world_size=1, rank=0,
        pin_memory=False, workers=2,
    )  # fmt: skip
    resumed_sampler.load_state_dict(state)
    plan = list(resumed_sampler)
    resumed_sampler.load_state_dict(state)
    resumed = []
    for planned_batch, batch in zip(plan, resumed_loader, strict=True):
        signals = [batch.signal[r, :n].clone() for r, n in enumerate(batch.signal_len.tolist())]
        resumed.append((list(planned_batch), planned_batch.speeds, planned_batch.start, signals))
    assert position > 0 and same_batches(resumed, straight[position:])


# ------------------------------------------------------------------------------------------ never outside training


def test_items_fetched_by_index_or_plain_lists_are_never_augmented(utterances, tokenizer):
    # What validation (evaluation.decode: dataset[i]) and any plain batch list fetch.
    ds = load(utterances, tokenizer, noise=NOISY)
    rows = list(range(len(ds)))
    for i, item in zip(rows, ds.__getitems__(rows)):
        clean = dataset.load_audio(ds.audio_path(i), expected_duration=float(ds.durations[i]))
        assert np.array_equal(item["signal"].numpy(), clean)
        assert np.array_equal(ds[i]["signal"].numpy(), clean)
        assert item["duration"] == ds.durations[i]


def test_validation_with_augmentation_knobs_on_decodes_clean_audio(
    utterances, tokenizer, monkeypatch
):
    import types

    import evaluation

    monkeypatch.setattr(config, "NOISE_PROB", 1.0)
    monkeypatch.setattr(config, "NOISE_DIR", Path("/nonexistent/noise"))  # not read either
    ds = load(utterances, tokenizer)  # as the validation callback builds it
    assert ds.noise.prob == 0.0
    decoded = []

    def decode_batch(model, signal, signal_len, **kwargs):
        decoded.append((signal.clone(), signal_len.tolist()))
        texts = ["x"] * len(signal_len)
        return types.SimpleNamespace(loss=None, first_tokens=None, texts=texts, given_texts=None)

    monkeypatch.setattr(evaluation.decoding, "decode_batch", decode_batch)
    rows = [0, 1, 2, 3]
    evaluation.decode(torch.nn.Linear(1, 1), ds, rows, max_batch_seconds=1e6, device="cpu")
    ((padded, lengths),) = decoded
    clean = {
        len(a): a
        for a in (
            dataset.load_audio(ds.audio_path(i), expected_duration=float(ds.durations[i]))
            for i in rows
        )
    }
    for row, n in enumerate(lengths):
        assert np.array_equal(padded[row, :n].numpy(), clean[n])


# ------------------------------------------------------------------------------------------ off by default


def test_with_the_default_knobs_a_planned_batch_is_the_clean_audio_bit_for_bit(
    utterances, tokenizer
):
    ds = load(utterances, tokenizer)  # NOISE_* as configured: off
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


# ------------------------------------------------------------------------------------------ a real run resumed

RESUME_PROBE = textwrap.dedent('''
    """train.main() that logs the audio of each micro-batch it trains, per rank, and can hold
    inside a step to be killed there."""
    import hashlib, json, os, sys, time
    from pathlib import Path
    import lightning.pytorch as pl
    import torch
    import train

    LOG = Path(os.environ["PROBE_OUT"]) / f"rank{os.environ['RANK']}_batches.jsonl"
    HOLD_AT = int(os.environ.get("PROBE_HOLD_AT_STEP", "-1"))

    class Trained(pl.Callback):
        """The audio as the loader handed it (before the step: NeMo's dither adds to it in place),
        logged once the micro-batch has trained."""
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            rows = [batch.signal[r, :n] for r, n in enumerate(batch.signal_len.tolist())]
            clean = [module.dataset[i]["signal"] for i in batch.indices]
            self.seen = {
                "epoch": trainer.current_epoch,
                "position": batch_idx,
                "indices": batch.indices,
                "lengths": batch.signal_len.tolist(),
                "clean_lengths": [len(c) for c in clean],
                "as_clean": [bool(torch.equal(r, c)) for r, c in zip(rows, clean)],
                "audio": hashlib.sha256(batch.signal.numpy().tobytes()).hexdigest(),
            }

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            with open(LOG, "a") as f:
                f.write(json.dumps(self.seen) + "\\n")

    class Hold(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == HOLD_AT:
                time.sleep(600)  # the test kills the job here

    callbacks = train.build_callbacks
    train.build_callbacks = lambda: callbacks() + [Trained(), Hold()]
    sys.exit(train.main([]))
''')


def trained_batches(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}_batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_resumed_run_trains_on_the_same_augmented_audio(tmp_path):
    """train.py under torchrun with 2 ranks and a worker each, speed perturbation and noise on:
    straight for 6 steps, and killed after its step 2 checkpoint (mid-epoch) then resumed (RESUME_FROM=last).
    Every rank trains on the same audio, bit for bit, in both."""
    from tests.tiny_training_data import make_training_data
    from tests.torchrun_jobs import run_torchrun, tiny_train_env, torchrun_command

    data = make_training_data(tmp_path, per_lang=16, vocab_size=64)
    script = tmp_path / "probe_train.py"
    script.write_text(RESUME_PROBE)
    base = tiny_train_env(
        data,
        GRAD_ACCUM="2",
        MAX_STEPS="6",
        UNFREEZE_STEP="4",
        CHECKPOINT_EVERY="2",
        EVAL_EVERY_STEPS="0",
        WANDB_RUN_NAME="run",
        SPEED_PERTURB="0.9,1.0,1.1",
        NOISE_PROB="0.5",
        NOISE_SNR_DB="5,20",
    )

    def env_for(name: str, **extra) -> dict:
        (tmp_path / name).mkdir()
        return {
            **base,
            "DATA_DIR": str(tmp_path / f"{name}_data"),
            "PROBE_OUT": str(tmp_path / name),
            **extra,
        }

    done = run_torchrun(script, env_for("straight"), REPO, 300, tmp_path / "straight.log")
    assert done.returncode == 0, done.stdout[-4000:]

    killed_env = env_for("killed", PROBE_HOLD_AT_STEP="2")
    checkpoint = tmp_path / "killed_data" / "checkpoints" / "step_00000002.ckpt"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            torchrun_command(script), cwd=REPO, env=killed_env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 300
    while not checkpoint.exists():  # the final name appears only once the file is complete
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {checkpoint.name}: {(tmp_path / 'killed.log').read_text()[-3000:]}")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    resumed_env = env_for("resumed", RESUME_FROM="last", DATA_DIR=killed_env["DATA_DIR"])
    done = run_torchrun(script, resumed_env, REPO, 300, tmp_path / "resumed.log")
    assert done.returncode == 0, done.stdout[-4000:]

    state = torch.load(checkpoint, weights_only=False)["sampler_state"]
    resume_at = (state["epoch"], state["position"])
    assert resume_at[1] > 0, "the checkpoint should fall mid-epoch for this test to mean something"
    assert state["speed_factors"] == [0.9, 1.0, 1.1]
    for rank in (0, 1):
        straight = trained_batches(tmp_path / "straight", rank)
        before = [
            b
            for b in trained_batches(tmp_path / "killed", rank)
            if (b["epoch"], b["position"]) < resume_at
        ]
        resumed = trained_batches(tmp_path / "resumed", rank)
        assert (resumed[0]["epoch"], resumed[0]["position"]) == resume_at
        assert before + resumed == straight
        assert len(straight) == 12
        rows = [(n, c, same) for b in straight for n, c, same in zip(
            b["lengths"], b["clean_lengths"], b["as_clean"])]  # fmt: skip
        assert any(n != c for n, c, _ in rows)  # played at another speed
        assert any(n == c and not same for n, c, same in rows)  # noise at speed 1
        assert any(same for _, _, same in rows)  # NOISE_PROB=0.5 leaves some clean


def test_the_augmentation_phrase_counts_the_recordings_a_dataset_already_read(tmp_path):
    """train.py's start-up line names the recordings its dataset scanned, without a second scan of
    NOISE_DIR (whose every header is read): given the count, the directory is not read again."""
    gone = tmp_path / "unmounted_noise"  # a scan would raise NoiseDirError
    noise = NoiseSettings(prob=0.25, snr_db=(5.0, 15.0), directory=gone)
    phrase = dataset.augmentation_in_force(noise, (0.9, 1.0, 1.1), recordings=12)
    assert phrase == (
        f"speed factors 0.9,1,1.1; noise on 25% of utterances at 5-15 dB SNR, 12 recordings in {gone}"
    )
    with pytest.raises(NoiseDirError):
        dataset.augmentation_in_force(noise, (0.9, 1.0, 1.1))
