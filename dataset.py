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
because touching an object writes its reference count (PyTorch issue 13246, NeMo issue 2718). Here the
first process to load a manifest writes what ``__getitem__`` needs once into an Arrow IPC file, the
*sidecar* (``<manifest stem>.<key>.dataset.arrow`` beside the parquet): durations, language and shard
codes, audio directory codes, member names, and the transcripts' token ids (tokenized once, in one
multi-threaded SentencePiece pass, instead of in every worker for every epoch). Every rank and worker
memory-maps it: one copy sits in the page cache for the whole node and no per-row Python object
exists anywhere. A row is read through NumPy views of the Arrow buffers (offsets + values). The key
covers the manifest's size and mtime, the tokenizer model and the frame/truncation settings, so a
changed input gets a new sidecar, and a second load reuses the first one's without reading the
parquet.

Tokens. ``[id of <|lang|>] + text_to_ids(transcript)``, truncated to ``MAX_TOKEN_LEN``: the tag is one
token and comes first (tokenizing the whole text would put a lone '▁' before it).

Transducer feasibility. An utterance with more tokens than encoder frames
(``floor(duration / ENCODER_FRAME_SECONDS)``) is dropped while the sidecar is built, counted in
``load_summary``.

Bad audio (missing, unreadable, empty, non-finite, or a decoded length that disagrees with the
manifest by more than ``AUDIO_DURATION_TOLERANCE``) makes ``__getitem__`` return ``None``; it is
logged with its shard and file at a limited rate and counted per reason; ``collate_asr_batch`` drops
it and hands the counts on in ``AsrBatch.bad_audio``.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq
import soundfile as sf
import soxr
import torch

import config
from manifest_schema import lang_tag, split_lang_tags

log = logging.getLogger("dataset")

# Manifest columns the dataset reads; the others (segment_id, source, scores) are never loaded.
MANIFEST_COLUMNS = ("text", "duration", "lang", "tar_path", "tar_member_name", "shard_id")
BAD_AUDIO_REASONS = ("missing", "unreadable", "empty", "non_finite", "duration_mismatch")
# Bump when the sidecar's columns or their meaning change, so old sidecars are not reused.
SIDECAR_FORMAT = 2
SIDECAR_SUFFIX = ".dataset.arrow"
# Rows per SentencePiece call while tokenizing: bounds the Python lists alive at once.
_TOKENIZE_CHUNK = 100_000
# Rows of manifest text read at a time while the sidecar is built.
_TEXT_BATCH_ROWS = 250_000
# Guards floor(duration / frame) against 0.24 / 0.08 = 2.9999999999999996.
_FRAME_EPS = 1e-9
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
) -> np.ndarray:
    """Decode ``path`` to mono float32 at ``sample_rate`` (None = config.TARGET_SAMPLE_RATE).

    Raises BadAudio("missing" | "unreadable" | "empty" | "non_finite" | "duration_mismatch"). The
    duration check (skipped when ``expected_duration`` is None) compares the decoded length with the
    manifest's, before resampling.
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
    if sr != sample_rate:
        signal = soxr.resample(signal, sr, sample_rate)
    return np.ascontiguousarray(signal, dtype=np.float32)


# --------------------------------------------------------------------------------------------------
# Tokenizer helpers
# --------------------------------------------------------------------------------------------------


def tag_token_id(tokenizer, lang: str) -> int:
    """The single token id of ``lang_tag(lang)``; ValueError when the tokenizer has no such piece."""
    tag = lang_tag(lang)
    token_id = int(tokenizer.token_to_id(tag))
    # An unknown piece maps to <unk>; mapping the id back is the test that does not depend on which
    # id <unk> has.
    if tokenizer.ids_to_tokens([token_id]) != [tag]:
        raise ValueError(
            f"the tokenizer has no single token for the language tag {tag!r} (it maps to id {token_id}, "
            f"piece {tokenizer.ids_to_tokens([token_id])[0]!r}); the configured tokenizer is "
            f"TOKENIZER_DIR={config.TOKENIZER_DIR}. Train the tokenizer with every language tag as a "
            f"user_defined_symbol (scripts/train_tokenizer.py), or point TOKENIZER_DIR at the one "
            f"trained on this manifest"
        )
    return token_id


def tokenize_transcript(tokenizer, tag_id: int, transcript: str, max_token_len: int) -> list[int]:
    """``[tag_id] + text_to_ids(transcript)``, truncated to ``max_token_len``.

    Tokenizing ``"<|hi|> text"`` whole would give ``['▁', '<|hi|>', ...]``: SentencePiece prefixes a
    word boundary before the user-defined tag, so the tag would be the second token, not the first.
    """
    ids = tokenizer.text_to_ids(transcript)
    return [tag_id] + ids[: max_token_len - 1]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the SentencePiece model (or of the vocabulary for other tokenizers)."""
    processor = getattr(tokenizer, "tokenizer", None)
    if hasattr(processor, "serialized_model_proto"):
        blob = processor.serialized_model_proto()
    else:
        blob = "\n".join(tokenizer.ids_to_tokens(list(range(tokenizer.vocab_size)))).encode()
    return hashlib.sha256(blob).hexdigest()


def encode_transcripts(
    tokenizer, transcripts: pa.Array, max_ids: int | None = None, progress: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``tokenizer.text_to_ids(t)[:max_ids]`` of every string, as one flat array.

    Returns ``(offsets, ids, full_lengths)``: row r's ids are ``ids[offsets[r]:offsets[r + 1]]`` (int64
    offsets, int32 ids), ``full_lengths[r]`` the length before truncation. A plain NeMo
    SentencePieceTokenizer's ``text_to_ids`` is exactly its processor's ``encode``, which takes a list
    and spreads it over all cores; any other set-up falls back to one ``text_to_ids`` call per row.
    """
    from tqdm import tqdm

    processor = getattr(tokenizer, "tokenizer", None)
    bulk = (
        hasattr(processor, "encode")
        and hasattr(processor, "serialized_model_proto")
        and not getattr(tokenizer, "legacy", False)
        and not (
            getattr(tokenizer, "removed_extra_spaces", False)
            and not getattr(tokenizer, "ignore_extra_whitespaces", True)
        )
    )
    threads = len(os.sched_getaffinity(0))
    n = len(transcripts)
    full_lengths = np.empty(n, dtype=np.int64)
    chunks: list[np.ndarray] = []
    with tqdm(total=n, desc="tokenizing", unit="utt", disable=not progress, leave=False) as bar:
        for start in range(0, n, _TOKENIZE_CHUNK):
            texts = transcripts.slice(start, _TOKENIZE_CHUNK).to_pylist()
            if bulk:
                encoded = processor.encode(texts, num_threads=threads)
            else:
                encoded = [tokenizer.text_to_ids(t) for t in texts]
            del texts
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            full_lengths[start : start + len(encoded)] = lengths
            flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum()))
            del encoded
            if max_ids is not None and (lengths > max_ids).any():
                # Keep the first max_ids of each row: a position's rank inside its row is its flat
                # index minus its row's start.
                starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
                flat = flat[
                    np.arange(len(flat)) - starts < np.repeat(np.minimum(lengths, max_ids), lengths)
                ]
            chunks.append(flat)
            bar.update(len(lengths))
    kept_lengths = full_lengths if max_ids is None else np.minimum(full_lengths, max_ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(kept_lengths, out=offsets[1:])
    ids = np.concatenate(chunks) if chunks else np.empty(0, np.int32)
    return offsets, ids, full_lengths


# --------------------------------------------------------------------------------------------------
# The sidecar: the manifest's needed columns, feasibility-filtered, as one memory-mappable Arrow file
# --------------------------------------------------------------------------------------------------


def _sidecar_key(manifest_path: Path, tok_fp: str, frame_seconds: float, max_token_len: int) -> str:
    st = manifest_path.stat()
    ident = json.dumps(
        [
            SIDECAR_FORMAT,
            st.st_size,
            st.st_mtime_ns,
            tok_fp,
            repr(float(frame_seconds)),
            int(max_token_len),
        ]
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def sidecar_path_for(manifest_path: Path, key: str, cache_dir: Path | None = None) -> Path:
    directory = Path(cache_dir) if cache_dir is not None else manifest_path.parent
    return directory / f"{manifest_path.stem}.{key}{SIDECAR_SUFFIX}"


def _check_manifest(manifest_path: Path) -> int:
    """The manifest's row count; ValueError when it is unreadable or lacks a needed column."""
    try:
        meta = pq.ParquetFile(manifest_path).metadata
    except (OSError, pa.ArrowInvalid) as exc:
        raise ValueError(f"cannot read the manifest {manifest_path}: {exc}") from None
    names = meta.schema.to_arrow_schema().names
    missing = [c for c in MANIFEST_COLUMNS if c not in names]
    if missing:
        raise ValueError(
            f"manifest {manifest_path} lacks the columns {missing} (has {names}); "
            f"rebuild it with build_manifest.py and scripts/make_train_val.py"
        )
    return meta.num_rows


def _read_column(manifest_path: Path, name: str, string: bool = False) -> pa.Array:
    # One column at a time, so the build holds at most the text column twice, never the whole table.
    column = pq.read_table(manifest_path, columns=[name])[name]
    if column.null_count:
        first = pc.index(pc.is_null(column), True).as_py()
        raise ValueError(
            f"manifest {manifest_path}: column {name!r} has {column.null_count} nulls (first at "
            f"row {first}); every training row needs {list(MANIFEST_COLUMNS)}"
        )
    if string:
        # 32-bit offsets cap a string array at 2 GiB; the texts of 70M rows are far more.
        column = column.cast(pa.large_string())
    return column.combine_chunks()


def _split_language_tags(
    manifest_path: Path,
    text: pa.Array,
    lang_codes: np.ndarray,
    lang_names: list[str],
    first_row: int = 0,
) -> pa.Array:
    """The transcripts without their leading ``<|lang|> `` tag; ValueError if a row's tag is not its lang.

    ``text`` holds the manifest rows from ``first_row`` on, ``lang_codes`` their codes.
    """
    tag_langs, transcripts = split_lang_tags(text)  # a null language where the text has no tag
    # Compare tag and lang as integer codes: the distinct tags are few, the rows are many.
    tags = tag_langs.dictionary_encode()
    code_of_tag = np.array(
        [lang_names.index(t) if t in lang_names else -1 for t in tags.dictionary.to_pylist()]
        + [-1],
        dtype=np.int64,
    )
    tag_codes = code_of_tag[
        tags.indices.fill_null(len(code_of_tag) - 1).to_numpy(zero_copy_only=False)
    ]
    mismatch = np.flatnonzero(tag_codes != lang_codes)
    if len(mismatch):
        bad = int(mismatch[0])
        raise ValueError(
            f"manifest {manifest_path}: row {first_row + bad}: text {text[bad].as_py()[:60]!r} does not start "
            f"with its language tag (lang={lang_names[lang_codes[bad]]!r}; {len(mismatch)} such rows in "
            f"rows {first_row}-{first_row + len(text) - 1}); "
            f"the manifest contract is text = '<|lang|> ' + transcript: rebuild it with "
            f"build_manifest.py / make_train_val.py"
        )
    return transcripts


def _tokenize_manifest(
    manifest_path: Path,
    tokenizer,
    lang_codes: np.ndarray,
    lang_names: list[str],
    max_ids: int,
    id_dtype,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """encode_transcripts over the manifest's text column, read in batches so the whole column of
    text (the largest by far) is never in memory; ids as ``id_dtype``."""
    from tqdm import tqdm

    id_parts, length_parts, full_parts = [], [], []
    first_row = 0
    with tqdm(total=len(lang_codes), desc="tokenizing", unit="utt", disable=not progress) as bar:
        for batch in pq.ParquetFile(manifest_path).iter_batches(
            batch_size=_TEXT_BATCH_ROWS, columns=["text"]
        ):
            text = batch.column(0)
            if text.null_count:
                first = first_row + pc.index(pc.is_null(text), True).as_py()
                raise ValueError(
                    f"manifest {manifest_path}: column 'text' is null at row {first}; every "
                    f"training row needs {list(MANIFEST_COLUMNS)}"
                )
            rows = slice(first_row, first_row + len(text))
            rest = _split_language_tags(
                manifest_path, text.cast(pa.large_string()), lang_codes[rows], lang_names, first_row
            )
            del text, batch
            offsets, ids, full = encode_transcripts(tokenizer, rest, max_ids, progress=False)
            id_parts.append(ids.astype(id_dtype, copy=False))
            length_parts.append(np.diff(offsets))
            full_parts.append(full)
            first_row += len(full)
            bar.update(len(full))
    if first_row != len(lang_codes):
        raise ValueError(
            f"manifest {manifest_path} changed while it was read ({first_row} text rows, "
            f"{len(lang_codes)} lang rows); rerun once it is complete"
        )
    lengths = np.concatenate(length_parts) if length_parts else np.empty(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.concatenate(id_parts) if id_parts else np.empty(0, id_dtype)
    full = np.concatenate(full_parts) if full_parts else np.empty(0, np.int64)
    return offsets, ids, full


def build_sidecar(
    manifest_path: Path,
    tokenizer,
    out_path: Path,
    key: str,
    *,
    frame_seconds: float,
    max_token_len: int,
    progress: bool = True,
) -> None:
    """Write the sidecar for ``manifest_path`` atomically to ``out_path`` (temp file + os.replace)."""
    t0 = time.monotonic()
    n = _check_manifest(manifest_path)
    duration = (
        _read_column(manifest_path, "duration").cast(pa.float64()).to_numpy(zero_copy_only=False)
    )

    lang_dict = _read_column(manifest_path, "lang", string=True).dictionary_encode()
    lang_names = [str(s) for s in lang_dict.dictionary.to_pylist()]
    if len(lang_names) > np.iinfo(np.int16).max:
        raise ValueError(
            f"manifest {manifest_path} has {len(lang_names)} distinct lang values; expected "
            f"language codes"
        )
    lang_codes = lang_dict.indices.to_numpy(zero_copy_only=False).astype(np.int16)
    del lang_dict
    for lang in lang_names:  # fail before the expensive part if the tokenizer does not fit
        tag_token_id(tokenizer, lang)

    # __getitem__ needs token ids, not text, and the feasibility filter needs their count, so the
    # sidecar stores the ids: one tokenizer pass for the whole node, and ids take a fraction of the
    # text's bytes (uint16 below 65,536 pieces).
    id_dtype = np.uint16 if getattr(tokenizer, "vocab_size", 1 << 31) <= 1 << 16 else np.int32
    id_offsets, ids, rest_lengths = _tokenize_manifest(
        manifest_path, tokenizer, lang_codes, lang_names, max_token_len - 1, id_dtype, progress
    )
    n_tokens = 1 + rest_lengths
    token_len = np.minimum(n_tokens, max_token_len)
    with np.errstate(invalid="ignore"):
        bad_duration = ~(np.isfinite(duration) & (duration > 0))
        frames = np.floor(np.where(bad_duration, 0.0, duration) / frame_seconds + _FRAME_EPS)
    infeasible = ~bad_duration & (token_len > frames)
    keep = ~(bad_duration | infeasible)
    kept_rows = np.flatnonzero(keep)
    take = None if len(kept_rows) == n else pa.array(kept_rows)

    def kept(array: pa.Array) -> pa.Array:
        return array if take is None else array.take(take)

    def dictionary_column(codes: np.ndarray, names, index_type) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(
            pa.array(codes[kept_rows], index_type), pa.array(list(names), pa.string())
        )

    columns = {
        "token_ids": kept(pa.LargeListArray.from_arrays(pa.array(id_offsets), pa.array(ids)))
    }
    del ids, id_offsets
    # Audio lives at dirname(tar_path)/tar_member_name; tar_path has one value per shard, so dirname
    # runs on the few distinct values and each row keeps an int32 code.
    tar_dict = _read_column(manifest_path, "tar_path", string=True).dictionary_encode()
    dir_of_tar = [os.path.dirname(p) for p in tar_dict.dictionary.to_pylist()]
    dir_names, dir_of_tar_code = np.unique(np.array(dir_of_tar, dtype=object), return_inverse=True)
    columns["audio_dir"] = dictionary_column(
        dir_of_tar_code.astype(np.int32)[tar_dict.indices.to_numpy(zero_copy_only=False)],
        dir_names.tolist(),
        pa.int32(),
    )
    del tar_dict
    shard_dict = _read_column(manifest_path, "shard_id", string=True).dictionary_encode()
    columns["shard_id"] = dictionary_column(
        shard_dict.indices.to_numpy(zero_copy_only=False),
        shard_dict.dictionary.to_pylist(),
        pa.int32(),
    )
    del shard_dict
    columns["tar_member_name"] = kept(_read_column(manifest_path, "tar_member_name", string=True))
    columns.update(
        {
            "duration": pa.array(duration[kept_rows], pa.float64()),
            "lang": dictionary_column(lang_codes, lang_names, pa.int16()),
            "manifest_row": pa.array(kept_rows.astype(np.int64)),
        }
    )
    summary = _summarize(
        manifest_path,
        n,
        lang_codes,
        lang_names,
        bad_duration,
        infeasible,
        keep,
        n_tokens > max_token_len,
        frame_seconds,
        max_token_len,
        tokenizer,
    )
    summary["build_seconds"] = round(time.monotonic() - t0, 3)
    out = pa.table(columns).replace_schema_metadata(
        {"dataset.key": key, "dataset.summary": json.dumps(summary)}
    )

    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            with pa.ipc.new_file(sink, out.schema) as writer:
                writer.write_table(out, max_chunksize=max(out.num_rows, 1))
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _summarize(
    manifest_path,
    n,
    lang_codes,
    lang_names,
    bad_duration,
    infeasible,
    keep,
    truncated,
    frame_seconds,
    max_token_len,
    tokenizer,
) -> dict[str, Any]:
    k = len(lang_names)

    def by_lang(mask: np.ndarray) -> np.ndarray:
        return np.bincount(lang_codes[mask], minlength=k)

    dropped_by_lang: dict[str, dict[str, int]] = {}
    for reason, mask in (
        ("infeasible_tokens_gt_frames", infeasible),
        ("bad_duration", bad_duration),
    ):
        for lang, count in zip(lang_names, by_lang(mask)):
            if count:
                dropped_by_lang.setdefault(lang, {})[reason] = int(count)
    return {
        "manifest": str(manifest_path),
        "rows_read": int(n),
        "rows_kept": int(keep.sum()),
        "dropped": {
            "infeasible_tokens_gt_frames": int(infeasible.sum()),
            "bad_duration": int(bad_duration.sum()),
        },
        "dropped_by_lang": dropped_by_lang,
        "kept_by_lang": {lang: int(c) for lang, c in zip(lang_names, by_lang(keep))},
        "truncated_to_max_token_len": int((truncated & keep).sum()),
        "frame_seconds": float(frame_seconds),
        "max_token_len": int(max_token_len),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
    }


def _open_sidecar(path: Path, key: str) -> tuple[pa.Table, dict] | None:
    """The memory-mapped table and its summary, or None when the file is absent or not for ``key``."""
    try:
        source = pa.memory_map(str(path), "r")
    except (FileNotFoundError, pa.ArrowIOError):
        return None
    try:
        reader = pa.ipc.open_file(source)
        meta = reader.schema.metadata or {}
        if meta.get(b"dataset.key", b"").decode() != key:
            return None
        # read_all on a memory map is zero-copy: the arrays point into the page cache.
        return reader.read_all(), json.loads(meta[b"dataset.summary"])
    except (pa.ArrowInvalid, KeyError, ValueError):
        return None


def ensure_sidecar(
    manifest_path: Path,
    tokenizer,
    *,
    frame_seconds: float,
    max_token_len: int,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> tuple[Path, str, bool]:
    """Build the sidecar unless a valid one exists; (path, key, built_by_this_call).

    Safe when all ranks of a node call it at once: an exclusive flock on ``<sidecar>.lock`` lets one
    process build while the others wait and then reuse its file.
    """
    key = _sidecar_key(
        manifest_path, tokenizer_fingerprint(tokenizer), frame_seconds, max_token_len
    )
    path = sidecar_path_for(manifest_path, key, cache_dir)
    if _open_sidecar(path, key) is not None:
        return path, key, False
    lock_path = path.with_name(path.name + ".lock")
    try:
        lock = open(lock_path, "a+")
    except OSError as exc:
        raise OSError(
            exc.errno or errno.EACCES,
            f"cannot create the dataset sidecar lock {lock_path} ({exc.strerror}); the sidecar is "
            f"written beside the manifest: make {path.parent} writable or pass cache_dir=",
        ) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to build %s", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _open_sidecar(path, key) is not None:
            return path, key, False
        log.info("building the dataset sidecar %s from %s", path, manifest_path)
        build_sidecar(
            manifest_path,
            tokenizer,
            path,
            key,
            frame_seconds=frame_seconds,
            max_token_len=max_token_len,
            progress=progress,
        )
        stale = sorted(
            p.name for p in path.parent.glob(f"{manifest_path.stem}.*{SIDECAR_SUFFIX}") if p != path
        )
        if stale:
            log.info("older dataset sidecars of %s you may delete: %s", manifest_path.name, stale)
        return path, key, True


# --------------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------------


class _Columns:
    """NumPy views into one memory-mapped sidecar (no copies, no per-row Python objects)."""

    def __init__(self, table: pa.Table):
        def one(name: str) -> pa.Array:
            col = table[name]
            if col.num_chunks == 0:  # every row was dropped: the file holds no record batch
                return col.combine_chunks()
            if col.num_chunks != 1:
                raise ValueError(
                    f"dataset sidecar column {name!r} has {col.num_chunks} chunks; expected 1"
                )
            return col.chunk(0)

        def strings(name: str) -> tuple[np.ndarray, np.ndarray]:
            arr = one(name)
            _, offsets, data = arr.buffers()
            offsets = np.frombuffer(
                offsets, dtype=np.int64, count=len(arr) + 1, offset=arr.offset * 8
            )
            data = (
                np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
            )
            return offsets, data

        def dictionary(name: str) -> tuple[np.ndarray, list[str]]:
            arr = one(name)
            return arr.indices.to_numpy(zero_copy_only=True), arr.dictionary.to_pylist()

        self.table = table
        self.durations = one("duration").to_numpy(zero_copy_only=True)
        self.manifest_row = one("manifest_row").to_numpy(zero_copy_only=True)
        self.lang_codes, self.lang_names = dictionary("lang")
        self.shard_codes, self.shard_names = dictionary("shard_id")
        self.dir_codes, self.dir_names = dictionary("audio_dir")
        self.member_offsets, self.member_data = strings("tar_member_name")
        token_ids = one("token_ids")
        self.id_offsets = token_ids.offsets.to_numpy(zero_copy_only=True)
        self.ids = token_ids.values.to_numpy(zero_copy_only=True)

    @staticmethod
    def string_at(offsets: np.ndarray, data: np.ndarray, i: int) -> str:
        return data[offsets[i] : offsets[i + 1]].tobytes().decode("utf-8")


class LocalShardDataset(torch.utils.data.Dataset):
    """Utterances of one manifest: ``ds[i]`` -> dict(signal, tokens, duration, lang, index) or None.

    Attributes for the sampler: ``durations`` (float64), ``lang_codes`` (int16) + ``lang_names``, or
    ``languages`` (str array, materialized per call), ``token_lengths``; all per item.

    - ``len(ds)`` counts the feasible rows (tokens <= encoder frames); ``ds.manifest_rows[i]`` is the
      parquet row of item ``i``; ``ds.load_summary`` says how many rows were read and dropped.
    - ``signal``: float32 1-D at ``sample_rate``, mono; ``tokens``: int64, ``<|lang|>``'s id first, at
      most ``max_token_len``; ``duration``: the manifest's seconds; ``lang``: the manifest's code.
    - Returns None for bad audio (see ``load_audio``), counted for ``collate_asr_batch``.
    - Pickling (spawn/forkserver workers) carries the settings, not the table: the worker maps the
      sidecar again on first use. Forked workers share the parent's mapping.
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
        progress: bool = True,
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
        self.sidecar_path, self._key, built = ensure_sidecar(
            self.manifest_path,
            tokenizer,
            frame_seconds=self.frame_seconds,
            max_token_len=self.max_token_len,
            cache_dir=cache_dir,
            progress=progress,
        )
        self._cols: _Columns | None = None
        self._tag_ids: np.ndarray | None = None
        cols = self._columns()
        self.load_summary = dict(self._summary, sidecar=str(self.sidecar_path), sidecar_built=built)
        dropped = self.load_summary["dropped"]
        if not len(cols.durations):
            log.warning(
                "dataset %s: no utterance is left after the feasibility filter (%s)",
                self.manifest_path,
                dropped,
            )
        log.info(
            "dataset %s: %d rows read, %d kept, dropped %d infeasible (tokens > duration / %.3f s) "
            "and %d with a bad duration, %d truncated to %d tokens; sidecar %s (%s)",
            self.manifest_path,
            self.load_summary["rows_read"],
            len(cols.durations),
            dropped["infeasible_tokens_gt_frames"],
            self.frame_seconds,
            dropped["bad_duration"],
            self.load_summary["truncated_to_max_token_len"],
            self.max_token_len,
            self.sidecar_path,
            "built" if built else "reused",
        )

    # -- the memory map, opened lazily so a pickled copy re-opens it in its own process -------------
    def _columns(self) -> _Columns:
        if self._cols is None:
            opened = _open_sidecar(self.sidecar_path, self._key)
            if opened is None:
                raise FileNotFoundError(
                    f"dataset sidecar {self.sidecar_path} of {self.manifest_path} is missing or was "
                    f"replaced by one for another manifest/tokenizer; recreate the dataset"
                )
            table, self._summary = opened
            self._cols = _Columns(table)
            self._tag_ids = np.array(
                [tag_token_id(self.tokenizer, lang) for lang in self._cols.lang_names],
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

    def __len__(self) -> int:
        return len(self._columns().durations)

    def audio_path(self, i: int) -> str:
        cols = self._columns()
        return os.path.join(
            cols.dir_names[cols.dir_codes[i]],
            cols.string_at(cols.member_offsets, cols.member_data, i),
        )

    def __getitem__(self, i: int) -> dict | None:
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
            )
        except BadAudio as bad:
            _record_bad_audio(bad.reason, cols.shard_names[cols.shard_codes[i]], path, bad.detail)
            return None
        lang_code = cols.lang_codes[i]
        start, end = cols.id_offsets[i], cols.id_offsets[i + 1]
        tokens = np.empty(1 + end - start, dtype=np.int64)
        tokens[0] = self._tag_ids[lang_code]
        tokens[1:] = cols.ids[start:end]
        return {
            "signal": torch.from_numpy(signal),
            "tokens": torch.from_numpy(tokens),
            "duration": duration,
            "lang": cols.lang_names[lang_code],
            "index": i,
        }


# --------------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------------


class AsrBatch(NamedTuple):
    """A padded micro-batch in the layout NeMo's transducer models take, plus what metrics need.

    ``signal`` [B, T] float32 (zero-padded), ``signal_len`` [B] int64, ``tokens`` [B, U] int64
    (zero-padded), ``token_len`` [B] int64, ``langs`` and ``durations`` per utterance, ``bad_audio``:
    per-reason counts of bad items this worker saw since its previous batch. B == 0 when every item of
    the micro-batch was bad audio (``is_empty``); there is never a dummy utterance.
    """

    signal: torch.Tensor
    signal_len: torch.Tensor
    tokens: torch.Tensor
    token_len: torch.Tensor
    langs: list[str]
    durations: list[float]
    bad_audio: dict[str, int]

    @property
    def is_empty(self) -> bool:
        return self.signal.shape[0] == 0

    @property
    def batch_size(self) -> int:
        return self.signal.shape[0]


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
    )
