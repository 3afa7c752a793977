"""Duration-bucket batch sampler with real temperature rebalancing of languages, for 10M+ utterances.

Usage (a torch batch sampler; ``BatchingSettings`` holds the knobs it reads)::

    from sampler import BatchingSettings, DurationBucketBatchSampler
    settings = BatchingSettings.from_config()          # the knobs, read once; from_config(seed=3) changes one
    sampler = DurationBucketBatchSampler(dataset.durations, dataset.languages, settings,
                                         world_size=8, rank=local_rank)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_asr_batch)
    sampler.set_epoch(epoch)          # Lightning does this for you
    sampler.epoch_stats()             # shares, padding efficiency, rank balance, ... of this epoch

    python benchmarks/bench_sampler.py   # speed / memory / share comparison with the pure-Python baseline

An epoch plan is a handful of NumPy passes (per-language shuffles, one integer sort of packed keys, a
greedy packing loop whose iterations are batches of a lane, never utterances), about 1.5 s for 10M
utterances, and every rank builds the same global plan without communicating. With speed
perturbation (SPEED_PERTURB) the plan also draws each utterance's factor and packs by the durations
played (guarantee 9 of DurationBucketBatchSampler).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

import config
from process_control import UserError
from sampler_inputs import (
    CHUNK,
    check_durations,
    check_settings,
    encode_languages,
    slices,
    speed_factors,
)

log = logging.getLogger("sampler")

# Batches a packing lane holds (a lane is cut every _LANE_BATCHES x cap seconds of audio and at
# bucket starts). The greedy loop runs about once per batch of a lane, vectorized across lanes; each
# lane ends in a partial batch of arbitrary cost, so this also bounds the share of such batches
# (1 in 2,048) that can unbalance a step across ranks.
_LANE_BATCHES = 2048
# Iterations of the greedy loop between prunings of finished lanes.
_PRUNE_EVERY = 16
# Durations below this are treated as this when jittered, so a 0 s row still gets a sort position.
_MIN_SORT_SECONDS = 1e-3
# Guards floor(duration / frame) against 0.24 / 0.08 = 2.9999999999999996, as the training cache's
# feasibility filter does.
_FRAME_EPS = 1e-9
# The random streams of a plan (SeedSequence spawn keys, first entry): 1 each language's base
# order, 2 the sort jitter, 3 the deal, 4 the passes over a language, 5 the speed factors, and 6
# each planned row's augmentation in the dataset (PlannedBatch.item_rng).
_SPEED_STREAM = 5
_ITEM_STREAM = 6


@dataclass
class _Plan:
    """One epoch's global plan (identical on every rank) and this rank's slice of it."""

    flat: np.ndarray  # int32 manifest rows, batches laid out back to back
    offsets: np.ndarray  # int64 [num_batches + 1]: batch b is flat[offsets[b]:offsets[b+1]]
    rank_batches: np.ndarray  # int32 [num_batches_per_rank]: this rank's batch ids in step order
    stats: dict[str, Any]
    # int8 per entry of ``flat``: its factor's index in the sampler's speed table (None: no speed
    # perturbation)
    speed_codes: np.ndarray | None = None


@dataclass
class _Packing:
    """One epoch's micro-batches as packed and dealt, the input of its statistics."""

    flat: np.ndarray  # int32 manifest rows, batches laid out back to back
    offsets: np.ndarray  # int64 [num_batches + 1]: batch b is flat[offsets[b]:offsets[b+1]]
    counts: np.ndarray  # utterances per batch
    max_dur: np.ndarray  # seconds of each batch's longest utterance
    audio: np.ndarray  # seconds of audio per batch
    cost: np.ndarray  # the cost model's cost per batch
    bucket: np.ndarray  # int16 duration bucket per batch
    steps: np.ndarray  # [optimizer steps, world_size]: the batch each rank gets in each step
    dropped: np.ndarray  # batches left out so every rank gets whole optimizer steps


@dataclass(frozen=True)
class BatchingSettings:
    """The settings of the sampler, one knob each: BUCKET_BOUNDARIES, MAX_BATCH_DURATION, TEMPERATURE,
    GRAD_ACCUM, SEED, EPOCH_SIZE (0 = the number of utterances), LANG_WEIGHTING,
    BATCH_COST_QUADRATIC, BUCKET_SORT_JITTER, ENCODER_FRAME_SECONDS, MAX_BATCH_JOINT_CELLS (0 =
    derived from the token lengths, below 0 = no cap), BATCH_COST_JOINT and SPEED_PERTURB (the
    speed factors, () = none). The sampler checks them."""

    boundaries: Sequence[float] | str
    max_batch_duration: float
    temperature: float
    grad_accum: int
    seed: int
    epoch_size: int
    lang_weighting: str
    cost_quadratic: float
    sort_jitter: float
    frame_seconds: float
    max_joint_cells: float
    cost_joint: float
    # Replay: the least combined share of ``base_languages`` (those the base model was trained on;
    # None: unknown, refused when the floor could act) when the data also has other languages;
    # 0 = no floor.
    base_languages: tuple[str, ...] | None = ()
    base_share: float = 0.0
    # Speed perturbation: the factors each planned utterance is played at, one drawn per utterance
    # and epoch (1.1 = 10 % faster, so shorter); () = none.
    speed_factors: tuple[float, ...] = ()

    @classmethod
    def from_config(cls, **changes: Any) -> BatchingSettings:
        """The knobs' values now, with ``changes`` (field=value) applied. The base's languages are
        BASE_LANGUAGES, else those INIT_MODEL records (``model_languages.base_languages``)."""
        import model_languages

        settings = cls(
            boundaries=config.BUCKET_BOUNDARIES,
            max_batch_duration=config.MAX_BATCH_DURATION,
            temperature=config.TEMPERATURE,
            grad_accum=config.GRAD_ACCUM,
            seed=config.SEED,
            epoch_size=config.EPOCH_SIZE,
            lang_weighting=config.LANG_WEIGHTING,
            cost_quadratic=config.BATCH_COST_QUADRATIC,
            sort_jitter=config.BUCKET_SORT_JITTER,
            frame_seconds=config.ENCODER_FRAME_SECONDS,
            max_joint_cells=config.MAX_BATCH_JOINT_CELLS,
            cost_joint=config.BATCH_COST_JOINT,
            base_languages=model_languages.base_languages(),
            base_share=config.BASE_LANGUAGE_SHARE,
            speed_factors=config.SPEED_PERTURB,
        )
        return dataclasses.replace(settings, **changes)


class PlannedBatch(list):
    """One micro-batch of an epoch plan: its manifest rows (a list of ints, as any batch sampler
    yields) and what the dataset needs to augment each row alike in every run.

    ``speeds``: the factor each row is played at (None: no speed perturbation); the plan packed
    the batch by the durations these give. ``seed``, ``epoch`` and ``start`` (the plan position of
    the first row: the same on every rank and at every world size) key ``item_rng``, so what
    happens to a row depends on (SEED, epoch, its position in the epoch's plan) alone: never on the
    rank, the number of DataLoader workers or their scheduling, and a resume at this batch
    replays it.
    """

    def __init__(
        self,
        rows,
        *,
        seed: int,
        epoch: int,
        start: int,
        speeds: tuple[float, ...] | None = None,
    ):
        super().__init__(rows)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.start = int(start)
        self.speeds = speeds

    def item_rng(self, j: int) -> np.random.Generator:
        """The random stream of the batch's ``j``-th row (its plan position ``start + j``)."""
        key = (_ITEM_STREAM, self.epoch, self.start + int(j))
        return np.random.default_rng(np.random.SeedSequence(self.seed % 2**64, spawn_key=key))


class DurationBucketBatchSampler(Sampler[list[int]]):
    """Yields lists of manifest row indices (``PlannedBatch``es: each also carries its rows' speed
    factors and the key of their augmentation): duration-bucketed, language-rebalanced,
    rank-balanced.

    Cost model: a micro-batch of n utterances whose longest lasts m seconds and holds at most u
    tokens costs n x m + cost_quadratic x n x m^2 + cost_joint x n x T x (u + 1) (padded frames, an
    attention-like term when asked for, and the transducer joint: T = ceil(m / frame_seconds)
    encoder frames by u + 1 label positions, padded as the batch will be).

    Joint cap. With ``token_lengths``, no micro-batch holds more than ``max_joint_cells`` joint cells
    n x T x (u + 1) (the joint's logits, and its fp32 gradient NeMo keeps until backward, grow with
    them, not with the seconds of audio): a batch packed by seconds that exceeds it is cut into
    consecutive parts that fit (its utterances stay, in their order, so padding and the language
    mix barely move). The default cap (``joint_cell_cap``) is the cells of MAX_BATCH_DURATION
    seconds of copies of the longest utterance at the manifest's 99.9th-percentile tokens per
    second (``joint_cap_batch``). A lone utterance over the cap is a batch of its own
    (``epoch_stats()["over_joint_cap_batches"]``). ``batch_bound.heaviest_packed_batch`` bounds every packed
    batch in padded frames and joint cells: what preflight and the max-batch finder test.

    Guarantees (each has a test in tests/test_sampler.py):

    1. Temperature. Language l gets the target share pi_l ~ n_l^T of an epoch of ``epoch_size``
       utterances (0 = the number of utterances): T=1 natural, T=0 uniform. With
       ``lang_weighting="hours"`` shares are of audio hours, pi_l ~ hours_l^T. Replay floor: when
       the data holds both some of ``base_languages`` and other languages, and the former's shares
       sum to less than ``base_share``, theirs are scaled up to sum to it and the others' scaled
       down, each group keeping its temperature proportions; ``base_languages`` None (the base's
       are unknown) with ``base_share`` > 0 and two or more languages in the data is refused
       (``model_languages.BaseLanguagesUnknown``). Quotas are rounded by
       largest remainder, so the realized shares are within 1/epoch_size of the targets before the
       grad-accum trim, and within 0.5 percentage points after it whenever the epoch packs into at
       least 200 x world_size x grad_accum batches (the trim drops fewer than world_size x grad_accum
       batches). Hour shares also carry the noise of which utterances were drawn (small at scale).
       A downsampled language (quota q_l < n_l) reads the next q_l rows of an endless chain of
       passes over its rows, one reshuffled pass after another: every epoch sees a fresh subset,
       no utterance appears twice in an epoch, and after e epochs every utterance has been drawn
       floor or ceil(e x q_l / n_l) times, i.e. all are seen before any repeats. An upsampled
       language gets q_l // n_l whole passes plus q_l % n_l rows read from that same chain.
    2. Buckets and packing. Batches never cross bucket boundaries (``boundaries`` seconds, or
       ``"auto:K"``: K buckets at duration quantiles). Batches are filled greedily up to
       ``max_batch_duration`` seconds of raw audio; an utterance longer than that gets a batch of its
       own (``epoch_stats()["over_cap_batches"]``) and is never dropped.
    3. Padding efficiency >= 0.95 on realistic corpora (0.98 on lognormal(6 s, 0.6)). Inside a
       bucket the epoch is sorted by duration x (1 + sort_jitter x U), U ~ uniform(0, 1) drawn
       afresh each epoch: batch mates have nearly equal lengths, yet are a random draw among the
       utterances within ~sort_jitter (5 %) of that length, so two epochs do not produce the same
       batches. (Chosen over Lhotse-style sorting inside shuffled chunks: one global integer sort,
       no chunk-size knob, and the efficiency does not fall as chunks get sparse.)
    4. Rank balance. Batches sorted by cost are cut into groups of world_size neighbours; a group
       is one step (micro-batch index) on every rank, so at every step the ranks' costs are nearly
       equal (p99 over steps of max/mean <= 1.02 at world_size 8 once an epoch gives every rank
       a few hundred micro-batches; the steps that can miss it hold the partial batches at lane and
       bucket ends, one per bucket per 2,048 full batches, whose costs are sparse). The
       grad_accum dearest groups run first (an OOM shows in minute one), the other groups in
       random order, and within a group batches go to ranks at random. Every rank gets the same
       number of micro-batches, a multiple of grad_accum: the cheapest (fewer than world_size x
       grad_accum) batches are dropped, the least audio to lose; ``epoch_stats()["trimmed"]``.
    5. Determinism. The plan is a pure function of (seed, epoch, inputs, settings): integer keys,
       IEEE +, *, comparisons and NumPy's PCG64 streams, ties broken by position, so every rank
       and machine (same NumPy version) builds the same global plan without communicating.
       Different epochs and different seeds give different plans.
    6. Exact O(1) resume. ``state_dict()`` holds epoch and position (micro-batches of this rank
       consumed this epoch) and the plan's settings; ``load_state_dict()`` continues with the very
       next batch for the cost of one plan build. A checkpoint taken with another world_size (or
       other plan settings) is refused with a ValueError naming both values, unless its position
       is 0: a plan for a different rank count is a different plan.
    7. Statistics. ``epoch_stats()``, computed with the plan and cached: target, realized and
       natural shares, padding efficiency, batches per bucket, p99 rank cost balance, utterances
       repeated / skipped / trimmed per language, and this rank's first (most expensive) step.
    8. Bad input (empty, NaN / inf / negative durations, mismatched lengths, world_size < 1, rank
       outside [0, world_size), bad settings) raises a ValueError that names the value.
    9. Speed perturbation (``speed_factors``, e.g. (0.9, 1.0, 1.1)). Each planned utterance is
       played at a factor f drawn uniformly from them, afresh each epoch (a pure function of seed,
       epoch and plan position, like the rest of the plan), and lasts duration / f; an utterance
       whose tokens would outnumber its encoder frames at f (floor(duration / f / frame_seconds),
       the training cache's rule) is played at 1.0. Everything the plan does with durations (the
       buckets, the sort, the packing up to ``max_batch_duration``, the joint cap, the cost, the
       statistics, ``batch_bound.packed_batch_bound``) uses these perturbed durations, so a batch still holds
       at most ``max_batch_duration`` seconds of the audio it trains on and batch mates still have
       nearly equal lengths. The batches are ``PlannedBatch``es that carry each row's factor to the
       dataset, which resamples the audio. ``epoch_stats()["speed_factors"]`` counts the planned
       utterances per factor played.

    Memory: 5 bytes per utterance held (rows grouped by language, language codes), 4 bytes per
    planned utterance for the epoch plan (5 with speed perturbation: the factor of each),
    ~12 bytes per planned utterance transiently while building it (the selection and the sort
    key, then the plan and the running sum of durations; 2 more with speed perturbation); all
    other epoch-sized work runs in slices.
    """

    def __init__(
        self,
        durations: Any,
        languages: Any,
        settings: BatchingSettings,
        *,
        world_size: int = 1,
        rank: int = 0,
        language_names: Sequence[str] | None = None,
        token_lengths: Any = None,
    ) -> None:
        self.settings = settings
        self.max_batch_duration = float(settings.max_batch_duration)
        self.temperature = float(settings.temperature)
        self.grad_accum = int(settings.grad_accum)
        self.seed = int(settings.seed)
        self.lang_weighting = str(settings.lang_weighting)
        self.cost_quadratic = float(settings.cost_quadratic)
        self.sort_jitter = float(settings.sort_jitter)
        self.world_size = int(world_size)
        self.rank = int(rank)
        check_settings(self)
        self.speed_factors = speed_factors(settings.speed_factors)
        # The factors by their code in a plan, and 1.0 last: the factor of an utterance that would
        # be infeasible at the one drawn.
        self._speed_table = np.array((*self.speed_factors, 1.0))

        self.durations = check_durations(durations)
        n = len(self.durations)
        codes, self.languages = encode_languages(languages, n, language_names)
        self.num_utterances = n
        requested = int(settings.epoch_size)
        if requested < 0:
            raise ValueError(
                f"epoch_size={requested}: expected >= 0 (0 = the number of utterances)"
            )
        self.epoch_size = requested or n
        if self.epoch_size >= 2**31:
            raise ValueError(f"epoch_size={self.epoch_size}: expected < 2**31 utterances per epoch")
        self.boundaries = _resolve_boundaries(settings.boundaries, self.durations)
        self.frame_seconds = float(settings.frame_seconds)
        self.cost_joint = float(settings.cost_joint)
        self.token_lengths = None
        self.max_joint_cells = 0.0
        if token_lengths is not None:
            self.token_lengths = np.asarray(token_lengths)
            if len(self.token_lengths) != n or (n and int(self.token_lengths.min()) < 1):
                raise ValueError(
                    f"token_lengths: expected one count >= 1 per utterance ({n}), got "
                    f"{len(self.token_lengths)} values, smallest "
                    f"{int(self.token_lengths.min()) if len(self.token_lengths) else None}"
                )
            cap = float(settings.max_joint_cells)
            if cap == 0:
                cap = joint_cell_cap(
                    self.durations, self.token_lengths, self.max_batch_duration, self.frame_seconds
                )
            self.max_joint_cells = cap

        # Per-language totals slice by slice: a whole-array bincount would make an int64 copy.
        self._codes = codes
        num_langs = len(self.languages)
        counts = np.zeros(num_langs, dtype=np.int64)
        seconds = np.zeros(num_langs)
        for lo, hi in slices(n):
            counts += np.bincount(codes[lo:hi], minlength=num_langs)
            seconds += np.bincount(codes[lo:hi], weights=self.durations[lo:hi], minlength=num_langs)
        self._lang_offsets = np.concatenate([[0], np.cumsum(counts)])
        # A stable sort of small integer codes is a radix sort: one O(n) pass.
        self._lang_rows = np.argsort(codes, kind="stable").astype(np.int32)
        # Each language's rows in a fixed random order (its base order, see _pass_order).
        for lang in range(num_langs):
            self._rng(1, lang).shuffle(
                self._lang_rows[self._lang_offsets[lang] : self._lang_offsets[lang + 1]]
            )
        self._counts = counts
        self._seconds = seconds
        if settings.base_languages is None:
            from model_languages import check_base_languages

            held = [name for name, c in zip(self.languages, counts.tolist()) if c > 0]
            check_base_languages(None, held, float(settings.base_share))
        known = set(settings.base_languages or ())
        base = np.array([name in known for name in self.languages], bool)
        self._natural_share, self._target_share, self._quotas, lifted = _language_quotas(
            counts,
            seconds,
            self.temperature,
            self.lang_weighting,
            self.epoch_size,
            self.languages,
            floor=(base, float(settings.base_share)),
        )
        # The floor as the plan felt it: none unless it raised the base languages' share.
        self.base_languages = [n for n, b in zip(self.languages, base) if b] if lifted else []
        self.base_share = float(settings.base_share) if lifted else 0.0

        self._epoch = 0
        self._position = 0
        self._plan_cache: _Plan | None = None

    # ---- torch sampler protocol -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._plan().rank_batches)

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._plan()
        total = len(plan.rank_batches)
        while self._position < total:
            b = int(plan.rank_batches[self._position])
            self._position += 1
            lo, hi = int(plan.offsets[b]), int(plan.offsets[b + 1])
            speeds = None
            if plan.speed_codes is not None:
                speeds = tuple(self._speed_table[plan.speed_codes[lo:hi]].tolist())
            yield PlannedBatch(
                plan.flat[lo:hi].tolist(),
                seed=self.seed,
                epoch=self._epoch,
                start=lo,
                speeds=speeds,
            )
        # Like any torch sampler, the next iterator makes a full pass (of this epoch, until set_epoch).
        self._position = 0

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch``; the position resets only when the epoch actually changes."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"set_epoch({epoch}): expected an epoch >= 0")
        if epoch != self._epoch:
            self._epoch = epoch
            self._position = 0
            self._plan_cache = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    # ---- resume -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position and every setting the plan depends on (rank-independent)."""
        return {"epoch": self._epoch, "position": self._position, **self._plan_settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the very next batch of ``state``; refuse a plan this run cannot reproduce."""
        missing = [k for k in ("epoch", "position") if k not in state]
        if missing:
            raise ValueError(
                f"sampler state is missing {missing}: expected a DurationBucketBatchSampler.state_dict()"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise ValueError(
                f"sampler state has epoch={epoch}, position={position}: expected both >= 0"
            )
        if position > 0:
            mine = _comparable(self._plan_settings())
            older = [k for k in _SETTINGS_BEFORE_THEY_EXISTED if k not in state]
            theirs = _comparable({**_SETTINGS_BEFORE_THEY_EXISTED, **state})
            clashes = [
                f"{k}: checkpoint {theirs[k]!r}"
                + (" (written before the setting existed)" if k in older else "")
                + f", this run {mine[k]!r}"
                for k in mine
                if k in theirs and _differs(theirs[k], mine[k])
            ]
            if clashes:
                exact = [
                    _SETTINGS_BEFORE_THEY_EXISTED_KNOBS[k]
                    for k in older
                    if any(c.startswith(f"{k}:") for c in clashes)
                ]
                raise SamplerStateError(
                    f"cannot continue epoch {epoch} at micro-batch {position}: the epoch plan depends on "
                    + "; ".join(clashes)
                    + ". Resume with the checkpoint's settings (e.g. the same number of ranks"
                    + (f"; {' '.join(exact)} reproduces its plan" if exact else "")
                    + "), or from a checkpoint at an epoch boundary."
                )
        self.set_epoch(epoch)
        self._epoch, self._position = epoch, position
        total = len(self)
        if position > total:
            raise ValueError(
                f"sampler state position={position} but epoch {epoch} has only {total} "
                f"micro-batches per rank: the checkpoint does not match this data"
            )

    def _plan_settings(self) -> dict[str, Any]:
        """What the epoch plan depends on besides the data (``state_dict`` saves it with the
        position); keys added later get an entry in ``_SETTINGS_BEFORE_THEY_EXISTED``."""
        return {
            "seed": self.seed,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "num_utterances": self.num_utterances,
            "epoch_size": self.epoch_size,
            "temperature": self.temperature,
            "lang_weighting": self.lang_weighting,
            "boundaries": list(self.boundaries),
            "max_batch_duration": self.max_batch_duration,
            "cost_quadratic": self.cost_quadratic,
            "max_joint_cells": self.max_joint_cells,
            "cost_joint": self.cost_joint,
            "sort_jitter": self.sort_jitter,
            "languages": list(self.languages),
            "base_languages": list(self.base_languages),
            "base_share": self.base_share,
            "speed_factors": list(self.speed_factors),
        }

    # ---- statistics -------------------------------------------------------------------------

    def epoch_stats(self) -> dict[str, Any]:
        """Statistics of the current epoch's plan (cached; see the class docstring, guarantee 7)."""
        return self._plan().stats

    # ---- the plan ---------------------------------------------------------------------------

    def _plan(self) -> _Plan:
        if self._plan_cache is None:
            self._plan_cache = self._build_plan(self._epoch)
        return self._plan_cache

    def _rng(self, *stream: int) -> np.random.Generator:
        # The stream id goes in spawn_key, which SeedSequence keeps apart from the seed and hashes
        # length-aware, so (1, 2) and (1, 2, 0) are different streams.
        return np.random.default_rng(np.random.SeedSequence(self.seed % 2**64, spawn_key=stream))

    def _select(self, epoch: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """The epoch's multiset of rows: whole passes plus the next window of each language's chain.

        Also returns the window rows of each upsampled language (the ones drawn once more than the
        rest), which the statistics need to tell repeated from skipped utterances.
        """
        out = np.empty(self.epoch_size, dtype=np.int32)
        extra: dict[int, np.ndarray] = {}
        at = 0
        for lang, (quota, size) in enumerate(zip(self._quotas.tolist(), self._counts.tolist())):
            if quota == 0:
                continue
            rows = self._lang_rows[self._lang_offsets[lang] : self._lang_offsets[lang + 1]]
            whole, part = divmod(quota, size)
            if whole:
                out[at : at + whole * size].reshape(whole, size)[:] = rows
                at += whole * size
                window_from = at
            # The partial draws of all epochs read one endless chain of passes over the language
            # (pass k = _pass_order(k)): this epoch's window starts at position epoch * part.
            start = epoch * part
            while part:
                k, offset = divmod(start, size)
                take = min(part, size - offset)
                out[at : at + take] = self._pass_order(lang, k, size - (quota % size))[
                    offset : offset + take
                ]
                at, start, part = at + take, start + take, part - take
            if whole:
                extra[lang] = out[window_from:at]
        assert at == self.epoch_size
        return out, extra

    def _pass_order(self, lang: int, k: int, block: int) -> np.ndarray:
        """Pass k over a language: its base order with every ``block`` consecutive rows shuffled.

        Shuffling only inside fixed blocks of size n - part keeps a window of ``part`` rows that
        straddles two passes free of duplicates: the tail of pass k and the head of pass k+1 lie in
        different blocks, hence hold different rows. A strongly downsampled language has ~2 blocks,
        so each pass is close to a full reshuffle.
        """
        rows = self._lang_rows[self._lang_offsets[lang] : self._lang_offsets[lang + 1]]
        rng = self._rng(4, lang, k)
        full = len(rows) // block * block
        order = np.empty_like(rows)
        order[:full] = rng.permuted(rows[:full].reshape(-1, block), axis=1).ravel()
        order[full:] = rng.permutation(rows[full:])
        return order

    def _speed_codes(self, selected: np.ndarray, epoch: int) -> np.ndarray | None:
        """Per entry of ``selected``, the code (index into ``_speed_table``) of the factor it is
        played at this epoch: uniform over ``speed_factors``, or 1.0 (the last code) where the
        drawn one would leave fewer encoder frames than tokens. None without speed perturbation."""
        if not self.speed_factors:
            return None
        fallback = len(self.speed_factors)
        codes = self._rng(_SPEED_STREAM, epoch).integers(
            0, fallback, size=len(selected), dtype=np.int8
        )
        if self.token_lengths is not None:
            for lo, hi in slices(len(selected)):
                rows = selected[lo:hi]
                part = codes[lo:hi]
                frames = np.floor(
                    self.durations[rows] / self._speed_table[part] / self.frame_seconds + _FRAME_EPS
                )
                part[self.token_lengths[rows] > frames] = fallback
        return codes

    def _build_plan(self, epoch: int) -> _Plan:
        selected, extra = self._select(epoch)
        extra = {lang: rows.copy() for lang, rows in extra.items()}  # small: < n_l rows each
        size = len(selected)
        num_buckets = len(self.boundaries) + 1
        codes = self._speed_codes(selected, epoch)

        # One integer sort orders the epoch by (bucket, jittered duration, position). The packed key
        # is exact (its float part stays below 2**52 - 1), so the order is identical on every machine:
        # no float ties, no SIMD-dependent libm, only +, *, comparisons and a truncation. Epoch-sized
        # float work runs in slices so the only epoch-sized arrays are the int32 rows and the key.
        index_bits = max(1, int(size - 1).bit_length())
        bucket_bits = max(1, int(num_buckets - 1).bit_length())
        key_bits = min(52 - bucket_bits, 63 - index_bits - bucket_bits)
        longest = max(float(self.durations.max()), _MIN_SORT_SECONDS) * (1.0 + self.sort_jitter)
        if codes is not None:
            longest /= float(self._speed_table.min())
        scale = ((1 << key_bits) - 2) / longest
        jitter_rng = self._rng(2, epoch)
        key = np.empty(size, dtype=np.uint64)
        for lo, hi in slices(size):
            dur = self.durations[selected[lo:hi]]
            if codes is not None:
                dur /= self._speed_table[codes[lo:hi]]
            part = jitter_rng.random(hi - lo)
            part *= self.sort_jitter
            part += 1.0
            part *= np.maximum(dur, _MIN_SORT_SECONDS)
            part *= scale
            # The bucket index as a count of boundaries passed (a masked add per edge is ~8x slower).
            bucket = np.zeros(hi - lo)
            for edge in self.boundaries:
                bucket += dur >= edge
            bucket *= float(1 << key_bits)
            part += bucket
            chunk = part.astype(np.uint64)
            chunk <<= np.uint64(index_bits)
            chunk |= np.arange(lo, hi, dtype=np.uint64)
            key[lo:hi] = chunk
        key.sort()
        bucket_starts = np.searchsorted(
            key, np.arange(1, num_buckets, dtype=np.uint64) << np.uint64(key_bits + index_bits)
        )
        key &= np.uint64((1 << index_bits) - 1)
        # The rows are written over the key buffer's already-read front half: no third epoch array.
        flat = key.view(np.int32)[:size]
        flat_codes = None if codes is None else np.empty(size, dtype=np.int8)
        for lo, hi in slices(size):
            at = key[lo:hi].astype(np.intp)
            flat[lo:hi] = selected[at]
            if codes is not None:
                flat_codes[lo:hi] = codes[at]
        del selected, codes
        flat = flat.copy()
        del key
        speed = None if flat_codes is None else (self._speed_table, flat_codes)

        starts, audio, max_dur = _greedy_pack(
            self.durations, flat, bucket_starts, self.max_batch_duration, speed
        )
        cells = np.zeros(len(starts))
        if self.token_lengths is not None:
            starts, cells = _cap_joint(
                self.durations,
                self.token_lengths,
                flat,
                starts,
                self.frame_seconds,
                self.max_joint_cells,
                speed,
            )
            audio, max_dur = _batch_audio(self.durations, flat, starts, speed)
        offsets = np.append(starts, size)
        counts = np.diff(offsets)
        cost = counts * max_dur * (1.0 + self.cost_quadratic * max_dur) + self.cost_joint * cells
        batch_bucket = np.searchsorted(bucket_starts, starts, side="right").astype(np.int16)

        if len(cost) < self.world_size * self.grad_accum:
            raise TooLittleData(
                too_little_data_message(
                    len(cost),
                    self.world_size,
                    self.grad_accum,
                    self.epoch_size,
                    self.max_batch_duration,
                )
            )
        steps, dropped = _deal(cost, self.world_size, self.grad_accum, self._rng(3, epoch))
        rank_batches = steps[:, self.rank].astype(np.int32)
        packing = _Packing(
            flat=flat,
            offsets=offsets,
            counts=counts,
            max_dur=max_dur,
            audio=audio,
            cost=cost,
            bucket=batch_bucket,
            steps=steps,
            dropped=dropped,
        )
        stats = self._stats(epoch, packing, rank_batches, extra)
        stats["max_joint_cells"] = float(self.max_joint_cells)
        stats["largest_joint_cells"] = float(cells.max()) if len(cells) else 0.0
        stats["over_joint_cap_batches"] = (
            int(np.count_nonzero((counts == 1) & (cells > self.max_joint_cells)))
            if self.max_joint_cells > 0
            else 0
        )
        stats["first_step"]["joint_cells"] = float(cells[int(rank_batches[0])])
        stats["speed_factors"] = {}
        if flat_codes is not None:
            played = np.bincount(flat_codes, minlength=len(self._speed_table))
            for factor, count in zip(self._speed_table.tolist(), played.tolist()):
                key = f"{factor:g}"
                stats["speed_factors"][key] = stats["speed_factors"].get(key, 0) + count
            if self.rank == 0:
                log.info(
                    "epoch %d: planned utterances per speed factor played %s (%d at 1 because "
                    "their tokens would outnumber the encoder frames at the factor drawn)",
                    epoch,
                    stats["speed_factors"],
                    int(played[-1]),
                )
        return _Plan(
            flat=flat,
            offsets=offsets,
            rank_batches=rank_batches,
            stats=stats,
            speed_codes=flat_codes,
        )

    def _stats(
        self,
        epoch: int,
        packing: _Packing,
        rank_batches: np.ndarray,
        window_rows: dict[int, np.ndarray],
    ) -> dict[str, Any]:
        """Epoch statistics from the quotas and the few trimmed batches: no pass over the epoch.
        ``window_rows``: the rows each upsampled language draws once more than the rest
        (``_select``)."""
        flat, offsets, counts = packing.flat, packing.offsets, packing.counts
        max_dur, audio, cost = packing.max_dur, packing.audio, packing.cost
        batch_bucket, steps, dropped = packing.bucket, packing.steps, packing.dropped
        names = self.languages
        num_langs = len(names)
        kept_batch = np.ones(len(counts), dtype=bool)
        kept_batch[dropped] = False
        lost = np.concatenate(
            [flat[offsets[b] : offsets[b + 1]] for b in dropped.tolist()] + [flat[:0]]
        )
        lost_lang = self._codes[lost]
        trimmed = np.bincount(lost_lang, minlength=num_langs)
        used_count = self._quotas - trimmed
        if self.lang_weighting == "hours":
            used = np.zeros(num_langs)
            for lo, hi in slices(len(flat)):
                rows = flat[lo:hi]
                used += np.bincount(
                    self._codes[rows], weights=self.durations[rows], minlength=num_langs
                )
            used -= np.bincount(lost_lang, weights=self.durations[lost], minlength=num_langs)
        else:
            used = used_count.astype(np.float64)
        realized = used / max(used.sum(), 1e-12)
        # Distinct utterances in the plan: a downsampled language has no duplicate in an epoch, so
        # each trimmed copy is an utterance lost; an upsampled one loses an utterance only when all
        # of its copies (whole passes, plus one if it is in the window) were trimmed.
        whole = self._quotas // self._counts
        distinct = np.where(whole == 0, used_count, self._counts)
        rows, copies = np.unique(lost, return_counts=True)
        for lang in np.flatnonzero(whole > 0).tolist():
            mine = (self._codes[rows] == lang) & (copies >= whole[lang])
            if mine.any():
                needed = whole[lang] + _members(rows[mine], window_rows.get(lang, rows[:0]))
                distinct[lang] -= int(np.count_nonzero(copies[mine] == needed))

        step_cost = cost[steps]
        balance = step_cost.max(axis=1) / np.maximum(step_cost.mean(axis=1), 1e-12)
        first = int(rank_batches[0])
        labels = _bucket_labels(self.boundaries)
        per_bucket = np.bincount(batch_bucket[kept_batch], minlength=len(labels))
        padded = float(np.sum(counts[kept_batch] * max_dur[kept_batch]))
        return {
            "epoch": epoch,
            "languages": list(names),
            "share_unit": "hours" if self.lang_weighting == "hours" else "utterances",
            "target_share": _by_lang(names, self._target_share),
            "realized_share": _by_lang(names, realized),
            "natural_share": _by_lang(names, self._natural_share),
            "padding_efficiency": float(np.sum(audio[kept_batch])) / max(padded, 1e-12),
            "batches_per_bucket": {lab: int(c) for lab, c in zip(labels, per_bucket)},
            "rank_cost_balance_p99": float(np.quantile(balance, 0.99)),
            "repeated": _by_lang(names, used_count - distinct, int),
            "skipped": _by_lang(names, self._counts - distinct, int),
            "trimmed": _by_lang(names, trimmed, int),
            "trimmed_batches": int(len(dropped)),
            "over_cap_batches": int(
                np.count_nonzero((counts == 1) & (max_dur > self.max_batch_duration))
            ),
            "utterances_in_plan": int(len(flat) - len(lost)),
            "epoch_size": self.epoch_size,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "num_batches_per_rank": int(len(rank_batches)),
            "first_step": {
                "utterances": int(counts[first]),
                "audio_seconds": float(audio[first]),
                "max_duration": float(max_dur[first]),
                "cost": float(cost[first]),
            },
        }


# ---- pure helpers ---------------------------------------------------------------------------


# What a state saved before a plan setting existed planned with: the joint cap and its cost term
# came later, and before them no batch was cut and the cost had no joint term. A resume compares
# these with its own settings like any other (a missing key is no licence to differ), and the
# refusal names the knobs that reproduce the older plan.
_SETTINGS_BEFORE_THEY_EXISTED = {
    "max_joint_cells": 0.0,
    "cost_joint": 0.0,
    "base_languages": [],
    "base_share": 0.0,
    "speed_factors": [],
}
_SETTINGS_BEFORE_THEY_EXISTED_KNOBS = {
    "max_joint_cells": "MAX_BATCH_JOINT_CELLS=-1",
    "cost_joint": "BATCH_COST_JOINT=0",
    "base_languages": "BASE_LANGUAGE_SHARE=0",
    "base_share": "BASE_LANGUAGE_SHARE=0",
    "speed_factors": "SPEED_PERTURB=1",
}


def _comparable(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with equal plans written alike: every joint cap <= 0 means no cap."""
    out = dict(settings)
    if "max_joint_cells" in out:
        out["max_joint_cells"] = max(float(out["max_joint_cells"]), 0.0)
    return out


class SamplerStateError(UserError, ValueError):
    """A saved sampler state this run cannot continue exactly; the message names each setting that
    differs and what to do."""


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return not math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return a != b


def _resolve_boundaries(
    boundaries: Sequence[float] | str, durations: np.ndarray
) -> tuple[float, ...]:
    if isinstance(boundaries, str):
        text = boundaries.strip()
        if not (text.startswith("auto:") and text[5:].isdigit() and int(text[5:]) >= 2):
            raise ValueError(
                f"boundaries={boundaries!r}: expected 'auto:K' with K >= 2, or increasing seconds"
            )
        k = int(text[5:])
        # A regular subsample of at most ~1M rows pins quantiles to well under a millisecond and
        # spares a full float64 copy of the durations (np.quantile partitions a copy).
        edges = np.quantile(durations[:: max(1, len(durations) // 1_000_000)], np.arange(1, k) / k)
        # Ties in the quantiles (many equal durations) collapse to fewer buckets; a bucket boundary
        # at the minimum would leave bucket 0 empty.
        edges = np.unique(edges[edges > durations.min()])
        return tuple(float(e) for e in edges)
    try:
        edges = tuple(float(b) for b in boundaries)
    except (TypeError, ValueError):
        raise ValueError(
            f"boundaries={boundaries!r}: expected increasing seconds or 'auto:K'"
        ) from None
    if any(not (b > 0 and math.isfinite(b)) for b in edges) or any(
        b <= a for a, b in zip(edges, edges[1:])
    ):
        raise ValueError(
            f"boundaries={boundaries!r}: expected strictly increasing positive seconds"
        )
    return edges


def _bucket_labels(boundaries: Sequence[float]) -> list[str]:
    edges = [0.0, *boundaries]
    labels = [f"{a:g}-{b:g}s" for a, b in zip(edges, edges[1:])]
    return labels + [f"{edges[-1]:g}s+"]


def _by_lang(names: Sequence[str], values: np.ndarray, cast: type = float) -> dict[str, Any]:
    return {name: cast(v) for name, v in zip(names, np.asarray(values).tolist())}


def _language_quotas(
    counts: np.ndarray,
    seconds: np.ndarray,
    temperature: float,
    weighting: str,
    epoch_size: int,
    names: Sequence[str],
    floor: tuple[np.ndarray, float] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(natural share, target share, utterances per language per epoch, whether the floor raised
    the target) for the chosen weighting; ``floor`` = (base-language mask, least combined share):
    the class docstring's replay floor. It raises the target when some but not all languages are
    base languages and their shares sum to less than the floor."""
    if weighting == "hours":
        empty = [names[i] for i in np.flatnonzero(seconds <= 0)]
        if empty:
            raise ValueError(
                f"lang_weighting='hours' but languages {empty} have 0 s of audio: "
                "use lang_weighting='count' or drop them"
            )
        base = seconds
    else:
        base = counts.astype(np.float64)
    natural = base / base.sum()
    # Scalar math.pow, not NumPy's SIMD-dispatched power: the quotas must not depend on the CPU.
    target = np.array([math.pow(b / base.max(), temperature) for b in base.tolist()])
    target /= target.sum()
    mask, share = floor if floor is not None else (np.zeros(len(target), bool), 0.0)
    lifted = bool(share > 0 and mask.any() and not mask.all() and target[mask].sum() < share)
    if lifted:
        below = target[mask].sum()
        target[mask] *= share / below
        target[~mask] *= (1.0 - share) / (1.0 - below)
    # Utterance quotas that realize the target share in the weighting's unit.
    per_utt = target if weighting != "hours" else target / (seconds / counts)
    quotas = _largest_remainder(per_utt / per_utt.sum() * epoch_size, epoch_size)
    return natural, target, quotas, lifted


def _largest_remainder(raw: np.ndarray, total: int) -> np.ndarray:
    floor = np.floor(raw).astype(np.int64)
    short = int(total - floor.sum())
    if short > 0:
        # Stable ordering by descending remainder: ties go to the lower language index, deterministically.
        floor[np.argsort(-(raw - floor), kind="stable")[:short]] += 1
    return floor


def _members(few: np.ndarray, many: np.ndarray) -> np.ndarray:
    """For each of the (unique) ``few`` values: does it occur in ``many``? One pass over ``many``."""
    order = np.argsort(few)
    ordered = few[order]
    at = np.minimum(np.searchsorted(ordered, many), len(ordered) - 1)
    found = np.zeros(len(few), dtype=bool)
    found[order[at[ordered[at] == many]]] = True
    return found


def _durations_of(
    durations: np.ndarray, flat: np.ndarray, speed, lo: int = 0, hi: int | None = None
) -> np.ndarray:
    """Seconds of the rows ``flat[lo:hi]`` as played: their ``durations``, each divided by its
    speed factor when ``speed`` = (factor table, int8 code per entry of ``flat``) is given."""
    hi = len(flat) if hi is None else hi
    d = durations[flat[lo:hi]]
    if speed is not None:
        table, codes = speed
        d /= table[codes[lo:hi]]
    return d


def _greedy_pack(
    durations: np.ndarray,
    flat: np.ndarray,
    bucket_starts: np.ndarray,
    cap: float,
    speed=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch starts in ``flat``, seconds of audio, longest duration) per batch: greedy fill to
    ``cap``, with the durations as played (``_durations_of``: ``speed`` as there).

    The plan order is cut into lanes, at every bucket start and every ``_LANE_BATCHES`` x ``cap``
    seconds of audio; each lane is packed greedily on its own. The loop advances every lane by one
    batch per iteration (one vectorized searchsorted on the epoch's running sum), so it runs about
    ``_LANE_BATCHES`` times (at most ~2x that: two neighbouring batches hold more than ``cap``),
    whatever the corpus size: never once per utterance.
    """
    size = len(flat)
    # The running sum is the one epoch-sized float array (8 bytes per utterance, no more than the
    # sort key it follows); durations are gathered into it a slice at a time.
    cum = np.empty(size + 1)
    cum[0] = 0.0
    for lo, hi in slices(size):
        np.take(durations, flat[lo:hi], out=cum[lo + 1 : hi + 1])
        if speed is not None:
            cum[lo + 1 : hi + 1] /= speed[0][speed[1][lo:hi]]
    np.cumsum(cum[1:], out=cum[1:])
    lane_seconds = _LANE_BATCHES * cap
    marks = np.arange(1, int(min(cum[-1] // lane_seconds, size)) + 1) * lane_seconds
    cuts = np.union1d(np.concatenate([[0], bucket_starts]), cum.searchsorted(marks, side="left"))
    cuts = cuts[cuts < size].astype(np.int64)  # empty top buckets start at ``size``
    end = np.append(cuts[1:], size)
    cur, found = cuts, []
    while len(cur):
        for _ in range(_PRUNE_EVERY):
            # Finished lanes stay parked at their end; they are pruned every few iterations.
            found.append(cur)
            nxt = cum.searchsorted(cum[cur] + cap, side="right") - 1
            # An utterance longer than the cap still advances the lane: it becomes a batch of its own.
            np.maximum(nxt, cur + 1, out=nxt)
            np.minimum(nxt, end, out=nxt)
            cur = nxt
        alive = cur < end
        cur, end = cur[alive], end[alive]
    starts = np.concatenate(found)
    del found
    starts.sort()
    # A parked lane sits on the next lane's first start (or on ``size``): drop the repeats in one
    # pass (np.unique is several times slower).
    keep = np.empty(len(starts), dtype=bool)
    keep[0] = True
    np.not_equal(starts[1:], starts[:-1], out=keep[1:])
    keep &= starts < size
    starts = starts[keep]
    del keep
    bounds = np.append(starts, size)
    seconds = np.diff(cum[bounds])
    del cum
    longest = np.empty(len(starts))
    b = 0
    while b < len(starts):
        # Batches covering about one slice of items (at least one batch): one gather, one reduceat.
        e = min(
            max(int(bounds.searchsorted(bounds[b] + CHUNK, side="right")) - 1, b + 1), len(starts)
        )
        lo, hi = int(bounds[b]), int(bounds[e])
        longest[b:e] = np.maximum.reduceat(
            _durations_of(durations, flat, speed, lo, hi), bounds[b:e] - lo
        )
        b = e
    return starts, seconds, longest


def batch_joint_cells(
    batch_durations: Sequence[float], batch_tokens: Sequence[int], frame_seconds: float
) -> float:
    """Joint cells of one micro-batch, padded as collated: n x ceil(longest / frame) x (most tokens + 1)."""
    frames = math.ceil(max(batch_durations) / frame_seconds)
    return float(len(batch_durations) * frames * (max(batch_tokens) + 1))


def token_density(
    durations: np.ndarray, token_lengths: np.ndarray, quantile: float = 0.999
) -> float:
    """Tokens per second of audio at ``quantile`` of the utterances: the density the heaviest
    batch (and so the joint cap and the max-batch search) assumes."""
    density = np.asarray(token_lengths) / np.maximum(durations, 1e-3)
    return float(np.quantile(density, quantile))


def joint_cap_batch(
    durations: np.ndarray,
    token_lengths: np.ndarray,
    max_batch_duration: float,
    quantile: float = 0.999,
) -> tuple[list[float], list[int]]:
    """The batch whose joint cells are the default joint cap, as (durations, tokens): the longest
    utterance repeated to fill ``max_batch_duration`` seconds (at least once), each with the tokens
    of the ``quantile`` tokens-per-second of the manifest. Not the heaviest batch the packer deals
    (a fill by the sum of seconds pads more): that is ``batch_bound.heaviest_packed_batch``."""
    longest = float(np.max(durations))
    density = token_density(durations, token_lengths, quantile)
    n = max(1, int(max_batch_duration // longest))
    tokens = max(1, int(math.ceil(density * longest)))
    return [longest] * n, [tokens] * n


def joint_cell_cap(
    durations: np.ndarray,
    token_lengths: np.ndarray,
    max_batch_duration: float,
    frame_seconds: float,
    quantile: float = 0.999,
) -> float:
    """The joint cells of ``joint_cap_batch``: the default MAX_BATCH_JOINT_CELLS."""
    batch = joint_cap_batch(durations, token_lengths, max_batch_duration, quantile)
    return batch_joint_cells(*batch, frame_seconds)


def _batch_audio(durations, flat, starts, speed=None) -> tuple[np.ndarray, np.ndarray]:
    """(seconds of audio, longest duration) per batch of ``flat`` cut at ``starts``, as played
    (``_durations_of``)."""
    d = _durations_of(durations, flat, speed)
    return np.add.reduceat(d, starts), np.maximum.reduceat(d, starts)


def _cap_joint(durations, token_lengths, flat, starts, frame_seconds, cap, speed=None):
    """``starts`` with every batch over ``cap`` joint cells cut into consecutive parts that fit
    (as few as its largest rows allow), and the joint cells of every resulting batch; durations
    as played (``_durations_of``)."""
    d, u = _durations_of(durations, flat, speed), np.asarray(token_lengths)[flat]
    frames = np.ceil(np.maximum.reduceat(d, starts) / frame_seconds)
    most = np.maximum.reduceat(u, starts)
    counts = np.diff(np.append(starts, len(flat)))
    cells = counts * frames * (most + 1)
    if cap > 0 and np.any(cells > cap):
        # Rows per part: as many as the batch's widest shape fits under the cap (at least one).
        per_part = np.maximum(1, np.floor(cap / (frames * (most + 1)))).astype(np.int64)
        parts = np.where(cells > cap, -(-counts // per_part), 1)
        first = np.repeat(starts, parts)
        within = np.arange(len(first)) - np.repeat(np.cumsum(parts) - parts, parts)
        starts = first + within * np.repeat(np.where(cells > cap, per_part, 0), parts)
        frames = np.ceil(np.maximum.reduceat(d, starts) / frame_seconds)
        most = np.maximum.reduceat(u, starts)
        counts = np.diff(np.append(starts, len(flat)))
        cells = counts * frames * (most + 1)
    return starts, cells


class TooLittleData(UserError, ValueError):
    """The data cannot fill one optimizer step on every rank; the message says what to change."""


def too_little_data_message(
    num_batches: int,
    world_size: int,
    grad_accum: int,
    epoch_size: int,
    max_batch_duration: float,
) -> str:
    """What to change when an epoch of ``epoch_size`` utterances packs into fewer micro-batches
    than one optimizer step takes on every rank, with values computed for each knob: the largest
    GRAD_ACCUM that fits, the EPOCH_SIZE and MAX_BATCH_DURATION that give one step (batches grow
    about linearly with utterances and shrink with the cap). MAX_BATCH_DURATION is named only where
    a value can work: an epoch of at least one utterance per micro-batch of the step."""
    need = world_size * grad_accum
    fixes = []
    if num_batches >= world_size:
        fixes.append(f"GRAD_ACCUM={num_batches // world_size}")
    # A fifth more than the linear estimate: packing per duration bucket leaves partial batches.
    fixes.append(f"EPOCH_SIZE={math.ceil(1.2 * epoch_size * need / max(num_batches, 1))}")
    shrunk = math.floor(max_batch_duration * num_batches / need / 1.2 * 10) / 10
    if epoch_size >= need and shrunk >= 0.1:
        fixes.append(f"MAX_BATCH_DURATION={shrunk:g}")
    return (
        f"an epoch of {epoch_size} utterances packs into {num_batches} micro-batches, fewer than "
        f"the {need} of one optimizer step (world size {world_size} x GRAD_ACCUM={grad_accum}): "
        f"set {' or '.join(fixes)}, or add data"
    )


def _deal(
    cost: np.ndarray, world_size: int, grad_accum: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Batch ids per (step, rank) and the dropped batch ids.

    Batches sorted by cost are cut into groups of ``world_size`` neighbours (one step each), so a
    step's ranks get near-equal cost. The cheapest batches that do not fill a whole
    ``grad_accum`` x ``world_size`` block are dropped. The ``grad_accum`` dearest steps go first,
    the rest are shuffled, and within a step the batches are dealt to ranks at random.
    """
    num = len(cost)
    steps_per_rank = num // world_size // grad_accum * grad_accum
    if steps_per_rank == 0:
        raise TooLittleData(
            f"the epoch packs into only {num} batches, fewer than world_size x grad_accum = "
            f"{world_size} x {grad_accum}: raise epoch_size (EPOCH_SIZE), lower MAX_BATCH_DURATION, "
            "or use more data"
        )
    order = np.argsort(-cost, kind="stable")
    used = steps_per_rank * world_size
    steps = order[:used].reshape(steps_per_rank, world_size)
    rest = grad_accum + rng.permutation(steps_per_rank - grad_accum)
    steps = steps[np.concatenate([np.arange(grad_accum), rest])]
    within = np.argsort(rng.random(steps.shape), axis=1, kind="stable")
    steps = np.take_along_axis(steps, within, axis=1)
    return steps, order[used:]
