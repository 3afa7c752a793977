"""The sampler's inputs, checked and encoded before a plan is drawn.

``DurationBucketBatchSampler`` takes 10M+ rows as arrays: its settings are checked here (each
problem named), its speed factors and durations validated, and its language labels (strings,
integer codes, or 8-byte hashes of long names) turned into small integer codes in sorted-name
order, all in vectorized NumPy passes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import config
import knob_values


def check_settings(s) -> None:
    """ValueError naming every setting of the sampler ``s`` outside its range."""
    problems = []
    if not 0 <= float(s.settings.base_share) < 1:
        problems.append(f"base_share={s.settings.base_share}: expected a share in [0, 1)")
    if s.world_size < 1:
        problems.append(f"world_size={s.world_size}: expected >= 1")
    elif not 0 <= s.rank < s.world_size:
        problems.append(f"rank={s.rank}: expected 0 <= rank < world_size={s.world_size}")
    if s.grad_accum < 1:
        problems.append(f"grad_accum={s.grad_accum}: expected >= 1")
    if not (s.max_batch_duration > 0 and math.isfinite(s.max_batch_duration)):
        problems.append(f"max_batch_duration={s.max_batch_duration}: expected seconds > 0")
    if not (s.temperature >= 0 and math.isfinite(s.temperature)):
        problems.append(
            f"temperature={s.temperature}: expected >= 0 (1 = natural shares, 0 = uniform)"
        )
    if s.lang_weighting not in config.LANG_WEIGHTINGS:
        problems.append(
            f"lang_weighting={s.lang_weighting!r}: expected one of {config.LANG_WEIGHTINGS}"
        )
    if not (s.cost_quadratic >= 0 and math.isfinite(s.cost_quadratic)):
        problems.append(f"cost_quadratic={s.cost_quadratic}: expected >= 0")
    if not (s.sort_jitter >= 0 and math.isfinite(s.sort_jitter)):
        problems.append(f"sort_jitter={s.sort_jitter}: expected >= 0")
    if problems:
        raise ValueError("DurationBucketBatchSampler: " + "; ".join(problems))


def speed_factors(values: Any) -> tuple[float, ...]:
    """``values`` as a tuple of speed factors; () when there are none or every one is 1 (no
    perturbation). A factor outside knob_values.SPEED_FACTOR_RANGE raises a ValueError naming it."""
    try:
        factors = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(
            f"speed_factors={values!r}: expected numbers such as (0.9, 1.0, 1.1)"
        ) from None
    low, high = knob_values.SPEED_FACTOR_RANGE
    bad = [v for v in factors if not low <= v <= high]  # NaN fails too
    if bad or len(factors) > knob_values.SPEED_FACTORS_MOST:
        raise ValueError(
            f"speed_factors={values!r}: expected at most {knob_values.SPEED_FACTORS_MOST} factors "
            f"between {low:g} and {high:g} such as (0.9, 1.0, 1.1)"
            + (f" (bad: {bad})" if bad else "")
        )
    return factors if any(v != 1.0 for v in factors) else ()


def check_durations(durations: Any) -> np.ndarray:
    try:
        d = np.asarray(durations, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"durations: expected numbers in seconds ({exc})") from None
    if d.ndim != 1:
        raise ValueError(f"durations: expected a 1-D array, got shape {d.shape}")
    if len(d) == 0:
        raise ValueError(
            "durations is empty: the sampler needs at least one utterance (is the manifest empty?)"
        )
    if not (d.min() >= 0 and d.max() < np.inf):  # NaN fails both comparisons
        bad = ~(np.isfinite(d) & (d >= 0))
        row = int(np.argmax(bad))
        raise ValueError(
            f"durations[{row}] = {float(d[row])!r}: expected finite seconds >= 0 "
            f"({int(bad.sum())} bad rows; fix or drop them in the manifest)"
        )
    return d


def encode_languages(
    languages: Any, n: int, names: Sequence[str] | None
) -> tuple[np.ndarray, list[str]]:
    """Small-integer codes 0..L-1 in sorted-name order, and the sorted language names."""
    arr = np.asarray(languages)
    if arr.ndim != 1:
        raise ValueError(f"languages: expected a 1-D array, got shape {arr.shape}")
    if len(arr) != n:
        raise ValueError(
            f"languages has {len(arr)} rows but durations has {n}: expected one language per utterance"
        )
    if arr.dtype.kind in "iu":
        if arr.min() < 0:
            row = int(np.argmin(arr))
            raise ValueError(
                f"languages[{row}] = {int(arr[row])}: expected integer language codes >= 0"
            )
        present = np.flatnonzero(np.bincount(arr)) if arr.max() < 2**20 else np.unique(arr)
        if names is not None and present[-1] >= len(names):
            raise ValueError(
                f"language code {int(present[-1])} has no entry in language_names "
                f"({len(names)} names): expected codes < len(language_names)"
            )
        found = [str(names[c]) if names is not None else str(c) for c in present.tolist()]
        order = sorted(range(len(found)), key=lambda i: found[i])
        dtype = _code_dtype(len(found))
        lut = np.zeros(int(present[-1]) + 1, dtype=dtype)
        lut[present[order]] = np.arange(len(found), dtype=dtype)
        return lut[arr], [found[i] for i in order]
    if arr.dtype.kind not in "OUS":
        raise ValueError(f"languages: expected strings or integer codes, got dtype {arr.dtype}")
    if arr.dtype.kind == "O":
        # Python objects already cost a pass per row; this one catches None / NaN before astype(str)
        # would turn them into a language called "None".
        row = next((i for i, x in enumerate(arr.tolist()) if not isinstance(x, str)), None)
        if row is not None:
            raise ValueError(f"languages[{row}] = {arr[row]!r}: expected a language code string")
        arr = arr.astype(str)
    found, codes = _string_codes(arr)
    order = sorted(range(len(found)), key=lambda i: found[i])
    dtype = _code_dtype(len(found))
    remap = np.empty(len(found), dtype=dtype)
    remap[order] = np.arange(len(found), dtype=dtype)
    return remap[codes], [found[i] for i in order]


def _code_dtype(num_languages: int) -> type:
    return np.int8 if num_languages <= 127 else np.int16 if num_languages <= 32767 else np.int32


def _string_codes(arr: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Codes 0..L-1, and the distinct strings they stand for, of a fixed-width string array."""
    # Compare the strings as machine words (a 'U2' code is one uint64), far faster than comparing
    # or sorting 10M strings: first by a hash of the words (two passes), then, should two
    # languages share a hash slot, by one vectorized pass per language.
    arr = np.ascontiguousarray(arr)
    width = 8 if arr.dtype.itemsize % 8 == 0 else 4 if arr.dtype.itemsize % 4 == 0 else 1
    words = arr.view(f"u{width}").reshape(len(arr), -1)
    hashed = _hashed_codes(words)
    if hashed is not None:
        rows, codes = hashed
        return [_text(arr[r]) for r in rows.tolist()], codes
    codes = np.full(len(arr), -1, dtype=np.int8)
    found: list[str] = []
    at = 0
    while len(found) < 100:
        row = first_negative(codes, at)
        if row < 0:
            return found, codes
        match = words[:, 0] == words[row, 0]
        for col in range(1, words.shape[1]):
            match &= words[:, col] == words[row, col]
        codes[match] = len(found)
        found.append(_text(arr[row]))
        at = row
    uniq, inverse = np.unique(arr, return_inverse=True)
    return [_text(u) for u in uniq], inverse.ravel()


def _hash_slots(words: np.ndarray) -> np.ndarray:
    """A 16-bit multiplicative hash of each row of machine words."""
    h = np.zeros(len(words), dtype=np.uint64)
    for col in range(words.shape[1]):
        h += words[:, col].astype(np.uint64)
        h *= np.uint64(0x9E3779B97F4A7C15)  # wraps: arithmetic mod 2**64
    h >>= np.uint64(48)
    return h.astype(np.intp)


def _hashed_codes(words: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(one row per distinct string, int8 codes) when no two distinct strings share a hash slot, else None."""
    n = len(words)
    holder = np.full(1 << 16, -1, dtype=np.int64)
    for lo, hi in slices(n):
        holder[_hash_slots(words[lo:hi])] = np.arange(lo, hi)
    present = np.flatnonzero(holder >= 0)
    if len(present) > 127:
        return None
    code_of_slot = np.zeros(1 << 16, dtype=np.int8)
    code_of_slot[present] = np.arange(len(present), dtype=np.int8)
    codes = np.empty(n, dtype=np.int8)
    for lo, hi in slices(n):
        chunk = words[lo:hi]
        slots = _hash_slots(chunk)
        if not np.array_equal(chunk, words[holder[slots]]):
            return None  # a hash collision between two languages
        codes[lo:hi] = code_of_slot[slots]
    return holder[present], codes


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Slice length for in-place passes over epoch-sized arrays (bounds temporaries to a few MB).
CHUNK = 1 << 16


def first_negative(values: np.ndarray, start: int) -> int:
    """Index of the first negative value at or after ``start``, or -1; scans a slice at a time."""
    for lo, hi in slices(len(values) - start):
        hit = np.flatnonzero(values[start + lo : start + hi] < 0)
        if len(hit):
            return start + lo + int(hit[0])
    return -1


def slices(size: int) -> Iterator[tuple[int, int]]:
    return ((lo, min(size, lo + CHUNK)) for lo in range(0, size, CHUNK))
