"""The training dataset: a memory-mapped manifest shared by every process of a node, and robust FLAC loading.

Usage (train.py builds it this way; the sampler takes ``durations`` and ``lang_codes``)::

    import config, dataset
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    tok = SentencePieceTokenizer(str(config.TOKENIZER_DIR / "tokenizer.model"))
    ds = dataset.LocalShardDataset(config.TRAIN_MANIFEST_PATH, tok)
    print(ds.load_summary)                      # rows read, kept, dropped as infeasible
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=dataset.collate_asr_batch,
                        num_workers=config.NUM_WORKERS)
    for batch in loader:                        # an AsrBatch
        if batch.is_empty: ...                  # every item of the micro-batch was bad audio
        loss(batch.signal, batch.signal_len, batch.tokens, batch.token_len)
        bad_audio_total.update(batch.bad_audio)

Memory. The pipeline we replace kept the manifest in pandas in each of the 8 ranks and read rows with
``.iloc``; every DataLoader worker (fork) then copied the pages of the Python objects it touched,
because touching an object writes its reference count (PyTorch issue 13246, NeMo issue 2718). Here
every rank and worker memory-maps the manifest's *training cache* (training_cache.py: durations,
language / shard / directory codes, member names and the transcripts' token ids, tokenized once per
manifest and tokenizer): one copy sits in the page cache for the whole node and no per-row Python
object exists anywhere. scripts/build_training_cache.py builds the cache offline; a dataset whose
cache is missing builds it the same way (in parallel, under a file lock, with no collective).

Tokens. ``[id of <|lang|>] + text_to_ids(transcript)``, truncated to ``MAX_TOKEN_LEN``: the tag is one
token and comes first (tokenizing the whole text would put a lone '▁' before it).

Transducer feasibility. An utterance with more tokens than encoder frames
(``floor(duration / ENCODER_FRAME_SECONDS)``) is dropped while the cache is built, counted in
``load_summary``.

Bad audio (missing, unreadable, empty, non-finite, or a decoded length that disagrees with the
manifest by more than ``AUDIO_DURATION_TOLERANCE``) makes ``__getitem__`` return ``None``; it is
logged with its shard and file at a limited rate and counted per reason; ``collate_asr_batch`` drops
it and hands the counts on in ``AsrBatch.bad_audio``.

Augmentation (training only). The training sampler's micro-batches are ``sampler.PlannedBatch``es,
and those alone are augmented, in ``__getitems__`` in the DataLoader worker: each row is played at
the speed factor its plan drew (SPEED_PERTURB: resampled with soxr, so it lasts duration / factor
and every frequency is factor times as high), then NOISE_PROB of the rows get noise at an SNR drawn
from NOISE_SNR_DB (from NOISE_DIR's recordings, or generated). Every draw comes from the row's own
random stream, keyed by (SEED, epoch, its position in the epoch's plan): the same audio whatever
the number of workers, and again after a resume. ``ds[i]`` and any plain list of indices
(validation, evaluation) are never augmented.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import soundfile as sf
import soxr
import torch

import config
import file_names
import process_control
import training_cache
from process_control import UserError
from sampler import PlannedBatch

log = logging.getLogger("dataset")

BAD_AUDIO_REASONS = ("missing", "unreadable", "empty", "non_finite", "duration_mismatch")
_LOG_FIRST_PER_REASON = 5


# --------------------------------------------------------------------------------------------------
# Bad audio: a process-local counter and rate-limited logging
# --------------------------------------------------------------------------------------------------


class BadAudio(Exception):
    """An audio file that must not be trained on; ``reason`` is one of BAD_AUDIO_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# DataLoader workers are separate processes, so a counter on the dataset object would never reach the
# main process. Each worker counts here and collate_asr_batch (which runs in the same worker, right
# after that batch's __getitem__ calls) drains the counts into the batch it returns: the batch is the
# one channel from a worker back to the training loop, which sums them across workers.
_bad_audio_pending: collections.Counter = collections.Counter()
# Never drained: the per-process totals that drive the rate limit of the warnings.
_bad_audio_logged: collections.Counter = collections.Counter()


def _record_bad_audio(reason: str, shard_id: str, path: str, detail: str) -> None:
    _bad_audio_pending[reason] += 1
    _bad_audio_logged[reason] += 1
    n = _bad_audio_logged[reason]
    # The first few of each reason, then one line at every power of ten: a corpus with millions of
    # bad files logs a few dozen lines per worker, not millions.
    if n <= _LOG_FIRST_PER_REASON or (n >= 10 and 10 ** round(math.log10(n)) == n):
        log.warning(
            "bad audio (%s, %d so far in pid %d): shard=%s file=%s: %s",
            reason,
            n,
            os.getpid(),
            shard_id,
            path,
            detail,
        )


def drain_bad_audio_counts() -> dict[str, int]:
    """Per-reason counts of bad audio seen by this process since the previous drain; resets them."""
    counts = {reason: n for reason, n in _bad_audio_pending.items() if n}
    _bad_audio_pending.clear()
    return counts


# --------------------------------------------------------------------------------------------------
# Audio
# --------------------------------------------------------------------------------------------------


def load_audio(
    path: str,
    *,
    expected_duration: float | None = None,
    sample_rate: int | None = None,
    duration_tolerance: float | None = None,
    speed: float = 1.0,
) -> np.ndarray:
    """Decode ``path`` to mono float32 at ``sample_rate`` (None = config.TARGET_SAMPLE_RATE).

    ``speed``: played ``speed`` times as fast (speed perturbation: 1.1 lasts 1/1.1 as long and
    every frequency is 1.1 times as high), by resampling it as if recorded at ``speed`` x its rate,
    in the same pass as the resampling to ``sample_rate``.

    Raises BadAudio("missing" | "unreadable" | "empty" | "non_finite" | "duration_mismatch"). The
    duration check (skipped when ``expected_duration`` is None) compares the decoded length with the
    manifest's, before resampling and speed perturbation.
    """
    sample_rate = config.TARGET_SAMPLE_RATE if sample_rate is None else sample_rate
    tolerance = (
        config.AUDIO_DURATION_TOLERANCE if duration_tolerance is None else duration_tolerance
    )
    try:
        with sf.SoundFile(path) as audio:
            sr = audio.samplerate
            integer_pcm = audio.subtype.startswith("PCM_")
            data = audio.read(dtype="float32", always_2d=True)
    except (
        Exception
    ) as exc:  # libsndfile reports every failure its own way; all of them are bad audio
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise BadAudio("missing", "no such file") from None
        except OSError:
            size = -1
        if size == 0:  # e.g. an extraction that was interrupted: not a decoding problem
            raise BadAudio("empty", "zero-byte file")
        raise BadAudio("unreadable", f"{type(exc).__name__}: {exc}") from None
    if data.shape[0] == 0:
        raise BadAudio("empty", "zero samples")
    signal = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    # Integer PCM (every FLAC) scales into [-1, 1] and cannot hold NaN or Inf; skipping the pass over
    # the samples saves ~5% of the decode time of a long utterance.
    if not integer_pcm and not np.isfinite(signal).all():
        raise BadAudio("non_finite", "NaN or Inf samples")
    decoded = data.shape[0] / sr
    if expected_duration is not None and abs(decoded - expected_duration) > tolerance:
        raise BadAudio(
            "duration_mismatch",
            f"decoded {decoded:.3f} s, manifest says {expected_duration:.3f} s "
            f"(AUDIO_DURATION_TOLERANCE={tolerance})",
        )
    played_rate = sr if speed == 1.0 else sr * speed
    if played_rate != sample_rate:
        signal = soxr.resample(signal, played_rate, sample_rate)
    return np.ascontiguousarray(signal, dtype=np.float32)


# --------------------------------------------------------------------------------------------------
# Additive noise
# --------------------------------------------------------------------------------------------------

NOISE_EXTENSIONS = (".flac", ".wav")
# Generated noise: one recording-like bank per colour, power spectral density ~ 1/f^b for each b
# here: white (0), pink (1), brown (2) and between, the colours of fans, traffic and rumble (bluer
# noise is rare in recordings). Below _NOISE_FLAT_BELOW_HZ the spectrum is flat, so a brown noise
# does not put most of its power (and so of the SNR) below what a microphone records.
GENERATED_NOISE_EXPONENTS = (0.0, 0.5, 1.0, 1.5, 2.0)
_NOISE_FLAT_BELOW_HZ = 20.0
# Samples of each colour's bank: 65.5 s at 16 kHz, 21 MB for the five. A power of two, so the FFT
# that makes it is fast; made by FFT it is periodic, so a segment that wraps around has no seam.
_NOISE_BANK_SAMPLES = 1 << 20
_NOISE_BANK_SEED = 0


class NoiseDirError(UserError, ValueError):
    """NOISE_DIR holds no noise this run can read; the message names the file or directory."""


@dataclass(frozen=True)
class NoiseSettings:
    """Additive noise of training items: ``prob`` (NOISE_PROB, 0 = off), ``snr_db`` (NOISE_SNR_DB:
    low, high) and ``directory`` (NOISE_DIR; None = generated noise)."""

    prob: float = 0.0
    snr_db: tuple[float, float] = (10.0, 20.0)
    directory: Path | None = None

    @classmethod
    def from_config(cls) -> NoiseSettings:
        return cls(
            prob=float(config.NOISE_PROB),
            snr_db=tuple(config.NOISE_SNR_DB),
            directory=config.NOISE_DIR,
        )


@dataclass(frozen=True)
class NoiseFiles:
    """The noise recordings of a directory, sorted by path (so every process draws alike), with
    each one's frames and sample rate from its header."""

    paths: tuple[str, ...]
    frames: np.ndarray
    rates: np.ndarray

    @classmethod
    def scan(cls, directory: Path) -> NoiseFiles:
        """Every FLAC and WAV file under ``directory``; NoiseDirError naming the directory when
        there is none, or naming the first file without a readable header or without samples."""
        directory = Path(directory)
        if not directory.is_dir():
            raise NoiseDirError(
                f"NOISE_DIR={directory} is not a directory: point it at a directory of noise "
                "recordings (FLAC or WAV), or leave it empty for generated noise"
            )
        # Absolute, so a worker or a later chdir reads the same files; sorted, so every process
        # numbers them alike.
        paths = sorted(
            str(p.absolute())
            for p in directory.rglob("*")
            if p.suffix.lower() in NOISE_EXTENSIONS and p.is_file()
        )
        if not paths:
            raise NoiseDirError(
                f"NOISE_DIR={directory} holds no {' or '.join(NOISE_EXTENSIONS)} file: point it "
                "at noise recordings, or leave it empty for generated noise"
            )
        frames, rates = np.zeros(len(paths), np.int64), np.zeros(len(paths), np.int64)
        for k, path in enumerate(paths):
            try:
                info = sf.info(os.fsencode(path))
            except Exception as exc:  # libsndfile reports every failure its own way
                raise NoiseDirError(
                    f"NOISE_DIR: noise file {file_names.printable(path)} is unreadable "
                    f"({type(exc).__name__}: {exc}): remove or replace it"
                ) from None
            if info.frames <= 0 or info.samplerate <= 0:
                raise NoiseDirError(
                    f"NOISE_DIR: noise file {file_names.printable(path)} has no samples: remove it"
                )
            frames[k], rates[k] = info.frames, info.samplerate
        return cls(tuple(paths), frames, rates)


def augmentation_in_force(
    noise: NoiseSettings, speed_factors: Sequence[float], recordings: int | None = None
) -> str:
    """One phrase: the augmentation a training run applies with these settings. NOISE_DIR is
    checked as the training dataset checks it: NoiseDirError, with that message, when it cannot
    serve (what train.py exits with at start-up); ``recordings``: how many it holds, where a
    dataset has already read it (``LocalShardDataset.noise_recordings``)."""
    speeds = (
        f"speed factors {','.join(f'{f:g}' for f in speed_factors)}"
        if speed_factors
        else "no speed perturbation"
    )
    if noise.prob <= 0:
        return f"{speeds}; no noise"
    if noise.directory is None:
        source = "generated noise"
    else:
        if recordings is None:
            recordings = len(NoiseFiles.scan(noise.directory).paths)
        source = f"{recordings} recordings in {noise.directory}"
    low, high = noise.snr_db
    return f"{speeds}; noise on {noise.prob:.0%} of utterances at {low:g}-{high:g} dB SNR, {source}"


def add_noise(signal: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """``signal + g x noise`` (float32, new), with the gain g that makes the signal-to-noise ratio
    10 log10(sum(signal^2) / sum((g x noise)^2)) equal ``snr_db``; ``signal`` unchanged when either
    has no power (no SNR exists). ``noise`` (float32) is as long as ``signal``."""
    # float32 BLAS dots: 1e-7 of the energy off at utterance lengths, 5e-7 dB; float64 copies of
    # both would cost as much as the rest of the noise.
    signal_energy = float(np.dot(signal, signal))
    noise_energy = float(np.dot(noise, noise))
    if not (signal_energy > 0 and noise_energy > 0):
        return signal
    out = noise * np.float32(math.sqrt(signal_energy / (noise_energy * 10.0 ** (snr_db / 10.0))))
    out += signal
    return out


def coloured_noise(
    n: int, exponent: float, sample_rate: int, rng: np.random.Generator
) -> np.ndarray:
    """``n`` samples (float32) of Gaussian noise whose power spectral density falls as
    1/f^``exponent`` (0 white, 1 pink, 2 brown), flat below _NOISE_FLAT_BELOW_HZ, without DC,
    and periodic (its end runs on into its start). Fast for ``n`` a power of two."""
    white = rng.standard_normal(n)
    if exponent == 0:
        return white.astype(np.float32)
    spectrum = np.fft.rfft(white)
    hz = np.fft.rfftfreq(n, 1.0 / sample_rate)
    spectrum *= np.maximum(hz, _NOISE_FLAT_BELOW_HZ) ** (-exponent / 2.0)
    spectrum[0] = 0.0
    return np.fft.irfft(spectrum, n).astype(np.float32)


@functools.cache
def generated_noise_bank(sample_rate: int) -> np.ndarray:
    """[colour, sample] float32, read-only: _NOISE_BANK_SAMPLES of ``coloured_noise`` per exponent
    of GENERATED_NOISE_EXPONENTS, the same in every process (a fixed seed). Made once per process
    and sample rate (a rank's training and validation datasets share it, and so do the workers it
    forks), so an utterance's noise costs a slice of it, not an FFT of its own length (whose cost
    jumps with the length's prime factors)."""
    rng = np.random.default_rng(_NOISE_BANK_SEED)
    bank = np.stack(
        [
            coloured_noise(_NOISE_BANK_SAMPLES, b, sample_rate, rng)
            for b in GENERATED_NOISE_EXPONENTS
        ]
    )
    bank.flags.writeable = False
    return bank


def bank_noise(bank: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` samples of a colour of ``bank`` drawn from ``rng``, from an offset drawn in it,
    wrapping around its end (seamless: the bank is periodic)."""
    colour = bank[int(rng.integers(len(bank)))]
    offset = int(rng.integers(len(colour)))
    if offset + n <= len(colour):
        return colour[offset : offset + n]
    return np.resize(np.roll(colour, -offset), n)


_noise_warned: set[str] = set()


def file_noise(
    files: NoiseFiles, n: int, sample_rate: int, rng: np.random.Generator
) -> np.ndarray | None:
    """``n`` samples at ``sample_rate`` of a noise file drawn from ``files``, from an offset drawn
    in it, looped when the file is shorter; None (and one warning per file and process) when the
    file cannot be read now."""
    k = int(rng.integers(len(files.paths)))
    path, frames, rate = files.paths[k], int(files.frames[k]), int(files.rates[k])
    need = math.ceil(n * rate / sample_rate) + 1
    # A segment starts where a whole one fits; a shorter file is looped from any sample.
    offset = int(rng.integers(frames - need + 1 if frames > need else frames))
    try:
        if frames > need:
            data, _ = sf.read(
                os.fsencode(path), start=offset, frames=need, dtype="float32", always_2d=True
            )
        else:
            data, _ = sf.read(os.fsencode(path), dtype="float32", always_2d=True)
    except Exception as exc:  # e.g. a file removed or a network mount gone since the scan
        if path not in _noise_warned:
            _noise_warned.add(path)
            log.warning(
                "noise file %s unreadable (%s): its utterances stay clean",
                file_names.printable(path),
                exc,
            )
        return None
    noise = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    if frames <= need:
        noise = np.roll(noise, -offset)
    if rate != sample_rate:
        noise = soxr.resample(noise, rate, sample_rate)
    if not len(noise):
        return None
    return np.resize(noise, n).astype(np.float32, copy=False)


# --------------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------------


class LocalShardDataset(torch.utils.data.Dataset):
    """Utterances of one manifest: ``ds[i]`` -> dict(signal, tokens, duration, lang, index) or None.

    Attributes for the sampler: ``durations`` (float64), ``lang_codes`` (int16) + ``lang_names``, or
    ``languages`` (str array, materialized per call), ``token_lengths``; all per item.

    - ``len(ds)`` counts the feasible rows (tokens <= encoder frames); ``ds.manifest_rows[i]`` is the
      parquet row of item ``i``; ``ds.load_summary`` says how many rows were read and dropped.
    - ``signal``: float32 1-D at ``sample_rate``, mono; ``tokens``: int64, ``<|lang|>``'s id first, at
      most ``max_token_len``; ``duration``: the manifest's seconds; ``lang``: the manifest's code.
    - Returns None for bad audio (see ``load_audio``), counted for ``collate_asr_batch``.
    - ``__getitems__`` of a ``sampler.PlannedBatch`` augments (speed factors as planned, ``noise``:
      NoiseSettings; None = no noise, what every reader but the training loader wants, so that
      evaluation, validation and preflight's reads never depend on the NOISE_* knobs; the training
      dataset passes ``NoiseSettings.from_config()``); see the module docstring. ``duration`` is then the
      seconds handed out: the manifest's divided by the speed factor.
    - Pickling (spawn/forkserver workers) carries the settings, not the table: the worker maps the
      training cache again on first use. Forked workers share the parent's mapping.
    """

    def __init__(
        self,
        manifest_path,
        tokenizer,
        sample_rate: int | None = None,
        *,
        max_token_len: int | None = None,
        frame_seconds: float | None = None,
        duration_tolerance: float | None = None,
        cache_dir=None,
        build_workers: int | None = None,
        progress: bool = True,
        noise: NoiseSettings | None = None,
    ):
        self.manifest_path = Path(manifest_path)
        if not self.manifest_path.is_file():
            raise FileNotFoundError(
                f"manifest {self.manifest_path} does not exist; build it with "
                f"build_manifest.py and scripts/make_train_val.py"
            )
        self.tokenizer = tokenizer
        self.sample_rate = int(config.TARGET_SAMPLE_RATE if sample_rate is None else sample_rate)
        self.max_token_len = int(config.MAX_TOKEN_LEN if max_token_len is None else max_token_len)
        self.frame_seconds = float(
            config.ENCODER_FRAME_SECONDS if frame_seconds is None else frame_seconds
        )
        self.duration_tolerance = float(
            config.AUDIO_DURATION_TOLERANCE if duration_tolerance is None else duration_tolerance
        )
        if self.max_token_len < 1:
            raise ValueError(
                f"max_token_len={self.max_token_len}: the language tag alone needs 1 token"
            )
        if self.frame_seconds <= 0:
            raise ValueError(
                f"frame_seconds={self.frame_seconds}: expected seconds per encoder frame > 0"
            )
        self.noise = NoiseSettings() if noise is None else noise
        self._noise_files = self._noise_bank = None
        if self.noise.prob > 0 and self.noise.directory is not None:
            self._noise_files = NoiseFiles.scan(self.noise.directory)
        elif self.noise.prob > 0:
            # Made here, before the DataLoader forks: its workers share the pages.
            self._noise_bank = generated_noise_bank(self.sample_rate)
        info = training_cache.ensure(
            self.manifest_path,
            tokenizer,
            frame_seconds=self.frame_seconds,
            max_token_len=self.max_token_len,
            cache_dir=config.CACHE_DIR if cache_dir is None else cache_dir,
            workers=config.CACHE_BUILD_WORKERS if build_workers is None else build_workers,
            progress=progress,
        )
        self.cache_path, self._key = info.path, info.key
        self._cols: training_cache.CacheColumns | None = None
        self._tag_ids: np.ndarray | None = None
        cols = self._columns()
        self.load_summary = dict(cols.summary, cache=str(self.cache_path), cache_built=info.built)
        dropped = self.load_summary["dropped"]
        if not len(cols.durations):
            log.warning(
                "dataset %s: no utterance is left after the feasibility filter (%s)",
                self.manifest_path,
                dropped,
            )
        log.info(
            "dataset %s: %d rows read, %d kept, dropped %d infeasible (tokens > duration / %.3f s) "
            "and %d with a bad duration, %d truncated to %d tokens; training cache %s (%s)",
            self.manifest_path,
            self.load_summary["rows_read"],
            len(cols.durations),
            dropped["infeasible_tokens_gt_frames"],
            self.frame_seconds,
            dropped["bad_duration"],
            self.load_summary["truncated_to_max_token_len"],
            self.max_token_len,
            self.cache_path,
            "built" if info.built else "mapped",
        )

    # -- the memory map, opened lazily so a pickled copy re-opens it in its own process -------------
    def _columns(self) -> training_cache.CacheColumns:
        if self._cols is None:
            try:
                self._cols = training_cache.CacheColumns(self.cache_path, self._key)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"training cache {self.cache_path} of {self.manifest_path} is gone; "
                    f"recreate the dataset (scripts/build_training_cache.py rebuilds it)"
                ) from None
            self._tag_ids = np.array(
                [
                    training_cache.tag_token_id(self.tokenizer, lang)
                    for lang in self._cols.lang_names
                ],
                dtype=np.int64,
            )
        return self._cols

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cols"] = None
        state["_tag_ids"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # -- arrays for the sampler ---------------------------------------------------------------------
    @property
    def durations(self) -> np.ndarray:
        """float64 seconds per item (a read-only view of the shared map)."""
        return self._columns().durations

    @property
    def lang_codes(self) -> np.ndarray:
        """int16 index into ``lang_names`` per item (a read-only view of the shared map)."""
        return self._columns().lang_codes

    @property
    def lang_names(self) -> list[str]:
        return list(self._columns().lang_names)

    @property
    def languages(self) -> np.ndarray:
        """Language code per item as a fixed-width NumPy string array (built on each call: prefer
        ``lang_codes`` + ``lang_names`` at scale)."""
        cols = self._columns()
        return np.array(cols.lang_names, dtype=str)[cols.lang_codes]

    @property
    def token_lengths(self) -> np.ndarray:
        """Tokens per item after truncation, the tag included (computed on each call)."""
        return np.diff(self._columns().id_offsets) + 1

    @property
    def manifest_rows(self) -> np.ndarray:
        return self._columns().manifest_row

    @property
    def noise_recordings(self) -> int | None:
        """How many recordings of NOISE_DIR the noise comes from (None: none read)."""
        return None if self._noise_files is None else len(self._noise_files.paths)

    def __len__(self) -> int:
        return len(self._columns().durations)

    def audio_path(self, i: int) -> str:
        cols = self._columns()
        return os.path.join(cols.dir_names[cols.dir_codes[i]], cols.member_name(i))

    def __getitem__(self, i: int) -> dict | None:
        return self._item(i)

    def __getitems__(self, indices: Sequence[int]) -> list[dict | None]:
        """The items of one micro-batch (the DataLoader's fetch). A ``sampler.PlannedBatch`` is
        augmented as planned, each row from its own random stream (``PlannedBatch.item_rng``);
        any other list of indices gives exactly ``[self[i] for i in indices]``."""
        if not isinstance(indices, PlannedBatch):
            return [self._item(i) for i in indices]
        speeds = indices.speeds
        return [
            self._item(i, 1.0 if speeds is None else speeds[j], indices, j)
            for j, i in enumerate(indices)
        ]

    def _item(
        self, i: int, speed: float = 1.0, batch: PlannedBatch | None = None, j: int = 0
    ) -> dict | None:
        """Item ``i`` played at ``speed``, with noise when it is row ``j`` of a planned ``batch``."""
        cols = self._columns()
        n = len(cols.durations)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(
                f"index {i} out of range for a dataset of {n} items ({self.manifest_path})"
            )
        i %= n
        duration = float(cols.durations[i])
        path = self.audio_path(i)
        try:
            signal = load_audio(
                path,
                expected_duration=duration,
                sample_rate=self.sample_rate,
                duration_tolerance=self.duration_tolerance,
                speed=speed,
            )
        except BadAudio as bad:
            _record_bad_audio(bad.reason, cols.shard_names[cols.shard_codes[i]], path, bad.detail)
            return None
        if batch is not None and self.noise.prob > 0:
            signal = self._noisy(signal, batch.item_rng(j))
        lang_code = cols.lang_codes[i]
        ids = cols.token_ids_of(i)
        tokens = np.empty(1 + len(ids), dtype=np.int64)
        tokens[0] = self._tag_ids[lang_code]
        tokens[1:] = ids
        return {
            "signal": torch.from_numpy(signal),
            "tokens": torch.from_numpy(tokens),
            "duration": duration / speed,
            "lang": cols.lang_names[lang_code],
            "index": i,
        }

    def _noisy(self, signal: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``signal`` with noise added at an SNR drawn from ``noise.snr_db``, with probability
        ``noise.prob``; every draw from ``rng``, in a fixed order."""
        if rng.random() >= self.noise.prob:
            return signal
        snr_db = float(rng.uniform(*self.noise.snr_db))
        if self._noise_files is None:
            noise = bank_noise(self._noise_bank, len(signal), rng)
        else:
            noise = file_noise(self._noise_files, len(signal), self.sample_rate, rng)
            if noise is None:
                return signal
        return add_noise(signal, noise, snr_db)


# --------------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------------


class AsrBatch(NamedTuple):
    """A padded micro-batch in the layout NeMo's transducer models take, plus what metrics need.

    ``signal`` [B, T] float32 (zero-padded), ``signal_len`` [B] int64, ``tokens`` [B, U] int64
    (zero-padded), ``token_len`` [B] int64, ``langs``, ``durations`` and dataset ``indices`` per
    utterance (``durations``: the seconds trained on, the manifest's divided by the item's speed
    factor), ``bad_audio``: per-reason counts of bad items this worker saw since its previous batch.
    B == 0 when every item of the micro-batch was bad audio (``is_empty``); there is never a dummy
    utterance.
    """

    signal: torch.Tensor
    signal_len: torch.Tensor
    tokens: torch.Tensor
    token_len: torch.Tensor
    langs: list[str]
    durations: list[float]
    bad_audio: dict[str, int]
    indices: list[int] = []
    # Sums of token_len and signal_len, known on the host when the batch is made: the metrics read
    # these instead of the tensors (whose values live on the GPU once Lightning moved the batch).
    token_count: int = 0
    sample_count: int = 0

    @property
    def is_empty(self) -> bool:
        return self.signal.shape[0] == 0

    @property
    def batch_size(self) -> int:
        return self.signal.shape[0]

    def on_device(self, device: torch.device | str) -> AsrBatch:
        """The batch with its tensors on ``device``, for code outside Lightning (which moves them
        itself, non-blocking; a method named ``to`` would make Lightning call it instead)."""
        return self._replace(
            signal=self.signal.to(device),
            signal_len=self.signal_len.to(device),
            tokens=self.tokens.to(device),
            token_len=self.token_len.to(device),
        )


def collate_asr_batch(items: list[dict | None]) -> AsrBatch:
    """Pad the good items of ``items`` into an AsrBatch; drop the Nones; drain the bad-audio counts."""
    good = [item for item in items if item is not None]
    bad_audio = drain_bad_audio_counts()
    b = len(good)
    signal_len = torch.tensor([item["signal"].shape[0] for item in good], dtype=torch.int64)
    token_len = torch.tensor([item["tokens"].shape[0] for item in good], dtype=torch.int64)
    signal = torch.zeros((b, int(signal_len.max()) if b else 0), dtype=torch.float32)
    tokens = torch.zeros((b, int(token_len.max()) if b else 0), dtype=torch.int64)
    for row, item in enumerate(good):
        signal[row, : item["signal"].shape[0]] = item["signal"]
        tokens[row, : item["tokens"].shape[0]] = item["tokens"]
    return AsrBatch(
        signal=signal,
        signal_len=signal_len,
        tokens=tokens,
        token_len=token_len,
        langs=[item["lang"] for item in good],
        durations=[float(item["duration"]) for item in good],
        bad_audio=bad_audio,
        indices=[int(item["index"]) for item in good],
        token_count=sum(int(item["tokens"].shape[0]) for item in good),
        sample_count=sum(int(item["signal"].shape[0]) for item in good),
    )


# A healthy worker reaches its init function within a second of the fork, even on a loaded node.
WORKER_START_SECONDS = 60.0
WORKER_START_ATTEMPTS = 3
_started_pipe: int | None = None  # the write end each worker forked now reports its start on


class WorkersNeverStarted(RuntimeError):
    """DataLoader workers stayed stuck at their fork in every attempt."""


class SignalSafeDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose worker processes leave stop signals to the process that iterates it
    (``process_control``): torchrun's SIGTERM reaches a rank's whole process group and SLURM's every
    process of the job, and a worker that died of it would end the rank with "DataLoader worker is
    killed by signal" before it could save. Workers are forked with the stop signals blocked and
    ignore them from their first instruction on; they still die with their rank.

    ``worker_init_fn`` runs after that; without one, Lightning's worker seeding applies as it would
    to a plain DataLoader (``seed_everything(workers=True)``).

    Every worker reports that it started. A fork in a multi-threaded process (a rank has the
    process group's threads) can leave the child stuck inside ``os.fork`` for good, where it never
    runs a line of its own and the rank would wait on it until the DataLoader's timeout. A worker
    alive but not started after ``WORKER_START_SECONDS`` is killed and the workers are forked again
    (``WORKER_START_ATTEMPTS`` in all), with the batch sampler's position and torch's random state
    as they were, so the batches and the run are those of a first fork that worked.
    """

    def __init__(self, *args, worker_init_fn=None, **kwargs):
        super().__init__(
            *args,
            worker_init_fn=functools.partial(_init_worker, os.getpid(), worker_init_fn),
            **kwargs,
        )

    def _get_iterator(self):
        # Workers are forked here (once, with persistent_workers).
        if self.num_workers == 0:
            return super()._get_iterator()
        sampler = self.batch_sampler
        sampler_state = sampler.state_dict() if hasattr(sampler, "load_state_dict") else None
        rng = torch.get_rng_state()
        for attempt in range(1, WORKER_START_ATTEMPTS + 1):
            iterator, stuck = self._fork_workers()
            if not stuck:
                # A rank stuck waiting on them has the watchdog print their stacks too.
                process_control.add_helpers(w.pid for w in iterator._workers)
                return iterator
            log.warning(
                "DataLoader worker(s) %s alive but not started %.0f s after the fork (stuck in "
                "it); killed and forked again (attempt %d of %d)",
                ", ".join(str(w.pid) for w in stuck),
                WORKER_START_SECONDS,
                attempt,
                WORKER_START_ATTEMPTS,
            )
            _discard(iterator, stuck)
            if sampler_state is not None:
                sampler.load_state_dict(sampler_state)
            torch.set_rng_state(rng)
        raise WorkersNeverStarted(
            f"DataLoader workers stayed stuck at their fork in {WORKER_START_ATTEMPTS} attempts of "
            f"{WORKER_START_SECONDS:.0f} s: the node is overloaded or a library's fork handler "
            f"deadlocks; NUM_WORKERS=0 loads in the rank itself"
        )

    def _fork_workers(self):
        """A new multi-process iterator, and its workers that are alive but never reported."""
        global _started_pipe
        read_end, write_end = os.pipe()
        _started_pipe = write_end
        try:
            with process_control.stop_signals_blocked():
                iterator = super()._get_iterator()
        finally:
            _started_pipe = None
            os.close(write_end)
        try:
            started = _read_starts(read_end, len(iterator._workers), WORKER_START_SECONDS)
        finally:
            os.close(read_end)
        stuck = [w for i, w in enumerate(iterator._workers) if i not in started and w.is_alive()]
        return iterator, stuck


def _read_starts(fd: int, workers: int, seconds: float) -> set[int]:
    """The worker ids reported on ``fd`` within ``seconds`` (all ``workers`` of them, or fewer)."""
    import select

    # poll, not select: a rank with many sockets and mapped files has descriptors past select's 1024.
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    started: set[int] = set()
    pending = b""
    deadline = time.monotonic() + seconds
    while len(started) < workers:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            break
        data = os.read(fd, 4096)
        if not data:  # every worker closed its end: the rest died (the DataLoader reports them)
            break
        pending += data
        whole = len(pending) - len(pending) % 4
        started.update(int.from_bytes(pending[i : i + 4], "little") for i in range(0, whole, 4))
        pending = pending[whole:]
    return started


def _discard(iterator, stuck) -> None:
    """Shut down an iterator whose ``stuck`` workers never started. They hold the stop signals
    blocked since the fork, so SIGTERM would not end them: SIGKILL, after the iterator's pids are
    taken off torch's SIGCHLD check (which would report the kill as a failed worker)."""
    import signal

    from torch.utils.data import _utils

    if iterator._worker_pids_set:
        _utils.signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
    for worker in stuck:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)
    iterator._shutdown_workers()


def _init_worker(parent: int, then, worker_id: int) -> None:
    process_control.leave_stop_signals_to_parent(parent)
    if then is not None:
        then(worker_id)
    elif os.environ.get("PL_SEED_WORKERS") == "1":
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id, rank=int(os.environ.get("RANK", 0)))
    if _started_pipe is not None:
        os.write(_started_pipe, worker_id.to_bytes(4, "little"))
        os.close(_started_pipe)


# --------------------------------------------------------------------------------------------------
# Audio files outside a training manifest (transcription, NeMo JSON manifests)
# --------------------------------------------------------------------------------------------------


class AudioFileDataset(torch.utils.data.Dataset):
    """Audio files by path, for decoding only: ``ds[i]`` -> dict(signal, tokens, duration, lang,
    index) like LocalShardDataset's items (``tokens`` a single 0: there is no transcript to train
    on), or None for bad audio (logged and counted as in training).

    ``durations``: the given ones, or each file's from its header (``soundfile.info``, no decoding);
    an unreadable header gives 0.0 and the item is bad audio when read. ``durations`` with
    ``duration_tolerance`` check the decoded length as training does; without them nothing is checked.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        durations: Sequence[float] | None = None,
        langs: Sequence[str] | None = None,
        sample_rate: int | None = None,
        duration_tolerance: float | None = None,
    ):
        self.paths = [os.fspath(p) for p in paths]
        self.sample_rate = int(config.TARGET_SAMPLE_RATE if sample_rate is None else sample_rate)
        self._check_duration = durations is not None
        self.duration_tolerance = duration_tolerance
        if durations is None:
            durations = [_header_seconds(p) for p in self.paths]
        self.durations = np.asarray(durations, dtype=np.float64)
        self.langs = list(langs) if langs is not None else [""] * len(self.paths)
        if not len(self.durations) == len(self.langs) == len(self.paths):
            raise ValueError("AudioFileDataset: one duration and one language per path")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict | None:
        path = self.paths[i]
        try:
            signal = load_audio(
                path,
                expected_duration=float(self.durations[i]) if self._check_duration else None,
                sample_rate=self.sample_rate,
                duration_tolerance=self.duration_tolerance,
            )
        except BadAudio as bad:
            _record_bad_audio(bad.reason, os.path.dirname(path), path, bad.detail)
            return None
        return {
            "signal": torch.from_numpy(signal),
            "tokens": torch.zeros(1, dtype=torch.int64),
            "duration": float(self.durations[i]),
            "lang": self.langs[i],
            "index": i,
        }


def _header_seconds(path: str) -> float:
    try:
        info = sf.info(path)
    except Exception:  # reported as bad audio when the item is read
        return 0.0
    return info.frames / info.samplerate if info.samplerate else 0.0
