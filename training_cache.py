"""The training cache: what the dataset reads per utterance, built once per manifest and tokenizer,
memory-mapped by every rank and DataLoader worker of a node.

Usage (scripts/build_training_cache.py builds it offline; dataset.LocalShardDataset maps it, and
builds it the same way when it is missing)::

    import training_cache
    info = training_cache.ensure(manifest_path, tokenizer, frame_seconds=0.08, max_token_len=512)
    cols = training_cache.CacheColumns(info.path)   # read-only NumPy views of the mapped files
    info.summary["rows_kept"], cols.durations, cols.token_ids_of(0)

What it holds. One directory ``<cache dir>/<manifest stem>.<key>.training-cache/``: one raw little-endian
file per column (durations, language / shard / audio-directory codes, member names, the transcripts'
token ids without the language tag, the manifest row of each item) and ``meta.json`` (format, key,
dtypes and lengths, the code tables, the build summary). Rows whose tokens do not fit their encoder
frames (``floor(duration / frame_seconds)``) or whose duration is not a positive number are dropped
while it is built, counted in the summary and listed one per row in ``dropped_rows.parquet``
(``read_dropped_rows``: manifest row, segment_id, language, reason, tokens, frames, duration), which
is renamed into place with the cache, so a cache and its record of drops always belong together.

Keyed by content. The key covers the sha256 of the manifest's bytes, the tokenizer model's sha256
(its pieces and settings, not the paths it was trained with),
``frame_seconds``, ``max_token_len`` and the format. A manifest with other content gets a new cache
whatever its size and mtime; a ``touch`` or a copy of the same bytes reuses the cache (any cache
in the directory with that key, whatever the copy is called). Hashing runs at about 1 GB/s; its
result is remembered in the cache directory per (path, inode, size, mtime, ctime), so a start with an
unchanged manifest hashes nothing. Any write to a file changes its ctime, which nobody can set back.

Built in parallel, in bounded memory. Each parquet row group is one task for a pool of worker
processes (``workers``; CACHE_BUILD_WORKERS, default every usable core): a worker reads its row group
in batches of ``_BATCH_ROWS``, checks and tokenizes them and appends the kept rows to its own part
files; the parent appends finished parts in order to the cache's column files, remapping codes to the
cache-wide tables. Peak memory is ``parent + workers x (one batch)``, independent of the row count;
wall time is ``rows / (workers x rows per second of one worker)`` plus the parent's sequential copy.

Visible whole or not at all. The build writes into a hidden temporary directory and renames it; a
killed build leaves only that directory, which the next build of the same key removes. Concurrent
callers (the ranks of a node, several nodes on a shared file system) serialize on a file lock: one
builds, the others wait and map its result; no collective is involved, so no process-group timeout
can fire while a cache is built.

Superseded caches. After a build, caches of the same manifest path whose content hash differs are
deleted unless a process has one mapped (each reader holds a shared lock on its ``meta.json``);
those in use, and caches of the same content built for another tokenizer or frame setting, are
listed with their size in ``CacheInfo.kept_others``.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import content_hash
import process_control
import vocabulary
from atomic_files import check_writable, disk_full
from manifest_schema import (
    AUDIO_COLUMN,
    LEGACY_AUDIO_COLUMNS,
    ManifestError,
    audio_columns,
    audio_dirs_and_names,
    lang_tag,
    split_lang_tags,
)

log = logging.getLogger("training_cache")

# Manifest columns the cache reads besides the audio's (``manifest_schema.audio_columns``); the
# others (segment_id, source, scores) are never loaded.
MANIFEST_COLUMNS = ("text", "duration", "lang", "shard_id")
# Manifest rows listed per language and reason among those the cache drops (the summary's
# ``dropped_rows_by_lang``), so the infeasible rows of a validation set can be named.
DROPPED_ROWS_LISTED = 5
# A language whose validation rows the cache drops more than this share of is warned about: its
# WER is then scored on a biased remainder (the shorter transcripts of the faster speakers survive).
VALIDATION_DROP_WARN_SHARE = 0.10
# Why the cache drops a row, in the order the summary and the record list them.
DROP_REASONS = ("infeasible_tokens_gt_frames", "bad_duration")
# Bump when the cache's files or their meaning change, so old caches are not reused.
CACHE_FORMAT = 2
CACHE_SUFFIX = ".training-cache"
META_FILE = "meta.json"
# Every dropped row of the cache, one per line (``DROPPED_SCHEMA``), inside the cache directory.
DROPPED_FILE = "dropped_rows.parquet"
DROPPED_SCHEMA = pa.schema(
    [
        ("manifest_row", pa.int64()),
        ("segment_id", pa.string()),
        ("lang", pa.string()),
        ("reason", pa.string()),
        ("tokens", pa.int64()),  # with the language tag, as compared with the frames
        ("frames", pa.int64()),  # floor(duration / frame_seconds); 0 for a bad duration
        ("duration", pa.float64()),
    ]
)
# Rows a worker holds at once: bounds the Python lists of token ids SentencePiece returns.
_BATCH_ROWS = 32_768
# Guards floor(duration / frame) against 0.24 / 0.08 = 2.9999999999999996.
_FRAME_EPS = 1e-9
# column -> dtype of its file; "token_ids" takes the tokenizer's id dtype.
_FIXED_DTYPES = {
    "duration": "<f8",
    "lang": "<i2",
    "shard": "<i4",
    "audio_dir": "<i4",
    "member_offsets": "<i8",
    "member_data": "|u1",
    "token_offsets": "<i8",
    "manifest_row": "<i8",
}
# Per-row columns a part stores with local codes or local offsets, which the parent rewrites.
_CODE_COLUMNS = ("lang", "shard", "audio_dir")


class CacheError(process_control.UserError, ValueError):
    """A manifest the cache cannot be built from, or a cache directory it cannot use; the message
    names the file, row or variable and what to do."""


# --------------------------------------------------------------------------------------------------
# Tokenizer helpers
# --------------------------------------------------------------------------------------------------


def tag_token_id(tokenizer, lang: str) -> int:
    """The single token id of ``lang_tag(lang)``; CacheError when the tokenizer has no such piece."""
    token_id = vocabulary.tag_piece_id(tokenizer, lang)
    if token_id is None:
        tag = lang_tag(lang)
        unknown = int(tokenizer.token_to_id(tag))
        raise CacheError(_no_tag_message(tag, unknown, tokenizer.ids_to_tokens([unknown])[0]))
    return token_id


def _no_tag_message(tag: str, token_id: int, piece: str) -> str:
    import config

    return (
        f"the tokenizer has no single token for the language tag {tag!r} (it maps to id {token_id}, "
        f"piece {piece!r}); the configured tokenizer is TOKENIZER_DIR={config.TOKENIZER_DIR}. Train "
        f"the tokenizer with every language tag as a user_defined_symbol (scripts/train_tokenizer.py), "
        f"or point TOKENIZER_DIR at the one trained on this manifest"
    )


def _sentencepiece_proto(tokenizer) -> bytes | None:
    """The model proto when ``tokenizer.text_to_ids`` is exactly SentencePiece's ``encode`` (a plain
    NeMo SentencePieceTokenizer), so worker processes can rebuild it from bytes; else None."""
    processor = getattr(tokenizer, "tokenizer", None)
    plain = (
        hasattr(processor, "encode")
        and hasattr(processor, "serialized_model_proto")
        and not getattr(tokenizer, "legacy", False)
        and not (
            getattr(tokenizer, "removed_extra_spaces", False)
            and not getattr(tokenizer, "ignore_extra_whitespaces", True)
        )
    )
    return processor.serialized_model_proto() if plain else None


class _Encoder:
    """``text_to_ids`` of a list of transcripts plus the tag check, in whichever process runs it."""

    def __init__(self, proto: bytes | None, tokenizer=None):
        self.processor = None
        self.tokenizer = tokenizer
        if proto is not None:
            import sentencepiece

            self.processor = sentencepiece.SentencePieceProcessor(model_proto=proto)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.processor is not None:
            return self.processor.encode(texts, num_threads=1)
        return [self.tokenizer.text_to_ids(t) for t in texts]

    def check_tag(self, lang: str) -> None:
        if self.processor is None:
            tag_token_id(self.tokenizer, lang)
            return
        tag = lang_tag(lang)
        token_id = self.processor.piece_to_id(tag)
        if self.processor.id_to_piece(token_id) != tag:
            raise CacheError(_no_tag_message(tag, token_id, self.processor.id_to_piece(token_id)))


def encoder_for(tokenizer) -> _Encoder:
    """What the build tokenizes with: SentencePiece itself for a plain SentencePiece tokenizer (the
    same ids as its ``text_to_ids``), else the tokenizer's own ``text_to_ids``, row by row."""
    proto = _sentencepiece_proto(tokenizer)
    return _Encoder(proto) if proto is not None else _Encoder(None, tokenizer)


def encode_transcripts(
    encoder: _Encoder, transcripts: pa.Array, max_ids: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``text_to_ids(t)[:max_ids]`` of every string (``encoder_for(tokenizer)``), as one flat array.

    Returns ``(offsets, ids, full_lengths)``: row r's ids are ``ids[offsets[r]:offsets[r + 1]]`` (int64
    offsets, int32 ids), ``full_lengths[r]`` the length before truncation.
    """
    encoded = encoder.encode(transcripts.to_pylist())
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum()))
    del encoded
    if max_ids is not None and (lengths > max_ids).any():
        # Keep the first max_ids of each row: a position's rank inside its row is its flat index
        # minus its row's start.
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        flat = flat[
            np.arange(len(flat)) - starts < np.repeat(np.minimum(lengths, max_ids), lengths)
        ]
    kept = lengths if max_ids is None else np.minimum(lengths, max_ids)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(kept, out=offsets[1:])
    return offsets, flat, lengths


# --------------------------------------------------------------------------------------------------
# Content key
# --------------------------------------------------------------------------------------------------


def cache_key(content: str, tokenizer_sha256: str, frame_seconds: float, max_token_len: int) -> str:
    ident = json.dumps(
        [CACHE_FORMAT, content, tokenizer_sha256, repr(float(frame_seconds)), int(max_token_len)]
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _read_meta(path: Path) -> dict | None:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(path: Path, key: str) -> bool:
    meta = _read_meta(path)
    if meta is None or meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
        return False
    for name, spec in meta["columns"].items():
        size = np.dtype(spec["dtype"]).itemsize * spec["length"]
        try:
            if (path / f"{name}.bin").stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def find_cache(directory: Path, key: str) -> Path | None:
    """A complete cache with ``key`` in ``directory`` (whatever manifest name it was built under)."""
    for path in sorted(Path(directory).glob(f"*.{key}{CACHE_SUFFIX}")):
        if _is_complete(path, key):
            return path
    return None


# --------------------------------------------------------------------------------------------------
# Building: workers turn row groups into part files, the parent appends them in order
# --------------------------------------------------------------------------------------------------


@dataclass
class _Task:
    manifest: str
    row_group: int
    first_row: int
    part_dir: str
    frame_seconds: float
    max_token_len: int
    id_dtype: str


_worker_encoder: _Encoder | None = None


def _init_worker(proto: bytes | None, tokenizer, parent: int | None = None) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(proto, tokenizer) if proto is not None or tokenizer else None
    if parent is not None:
        # A stop signal is the builder's to act on (it reaches every process of the job at once),
        # except SIGTERM: a worker that dies of it loses nothing the builder, signalled too, still
        # wants. A killed builder leaves no worker behind.
        process_control.leave_stop_signals_to_parent(parent, but=(signal.SIGTERM,))


def _work(conn, tasks: list[_Task], proto: bytes, parent: int) -> None:
    """A forked worker: build ``tasks`` in order, answering each on ``conn``; stop at a failure."""
    _init_worker(proto, None, parent)
    for task in tasks:
        try:
            answer = ("built", _build_part(task))
        except BaseException as error:  # the builder raises it, as if it had been its own
            answer = ("failed", error)
        try:
            conn.send(answer)
        except Exception:  # an exception that does not pickle: its text still reaches the builder
            conn.send(("failed", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))
        if answer[0] == "failed":
            break
    conn.close()


class _Workers:
    """Forked workers, task ``i`` given to worker ``i % n`` and answered on that worker's own pipe in
    order, so the builder reads the parts in manifest order. Nothing is shared between the workers:
    no lock a killed worker could leave held, no queue a half-written answer could jam, so stopping
    them is a kill and a wait, never a wait on another process. A worker that dies (the OOM killer)
    is an error naming its exit, never a build that waits for its part forever."""

    def __init__(self, n: int, tasks: list[_Task], proto: bytes):
        context = multiprocessing.get_context("fork")
        self.processes, self.pipes = [], []
        with process_control.stop_signals_blocked():
            for w in range(n):
                receive, send = context.Pipe(duplex=False)
                process = context.Process(
                    target=_work, args=(send, tasks[w::n], proto, os.getpid()), daemon=True
                )
                process.start()
                send.close()
                self.processes.append(process)
                self.pipes.append(receive)

    def results(self, count: int):
        n = len(self.processes)
        for i in range(count):
            try:
                kind, value = self.pipes[i % n].recv()
            except EOFError:
                process = self.processes[i % n]
                process.join(timeout=10)
                code = process.exitcode
                how = f"was killed by signal {-code}" if code and code < 0 else f"exited ({code})"
                raise RuntimeError(
                    f"a training cache build worker (pid {process.pid}) {how} before it finished "
                    "its part; if the kernel log names the OOM killer, build with fewer workers "
                    "(CACHE_BUILD_WORKERS=N)"
                ) from None
            if kind == "failed":
                raise value
            yield value

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join()
            process.close()
        for pipe in self.pipes:
            pipe.close()


def _return_memory() -> None:
    """Give freed memory back to the OS: Arrow's pool and glibc's heap keep it otherwise, and a
    training process would carry it (and hand it to every forked DataLoader worker) for the run."""
    import ctypes

    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _not_null(manifest: str, name: str, column: pa.Array, first_row: int) -> pa.Array:
    if column.null_count:
        first = first_row + pc.index(pc.is_null(column), True).as_py()
        raise CacheError(
            f"manifest {manifest}: column {name!r} is null at row {first} ({column.null_count} nulls "
            f"in rows {first_row}-{first_row + len(column) - 1}); every training row needs "
            f"{list(MANIFEST_COLUMNS)} and its audio: rebuild it with build_manifest.py / scripts/make_train_val.py"
        )
    return column


def _codes(values: pa.Array, table: dict[str, int]) -> np.ndarray:
    """int32 codes of ``values`` (strings, or a dictionary array of them) in ``table``, which is
    extended with the values it lacks."""
    encoded = values if pa.types.is_dictionary(values.type) else values.dictionary_encode()
    names = encoded.dictionary.cast(pa.string()).to_pylist()
    mapping = np.array([table.setdefault(v, len(table)) for v in names], dtype=np.int32)
    return mapping[encoded.indices.to_numpy(zero_copy_only=False)]


# Columns with few distinct values: read as dictionaries, so no per-row string is decoded or hashed.
_DICTIONARY_COLUMNS = ("lang", "shard_id", LEGACY_AUDIO_COLUMNS[0])


def _build_part(task: _Task) -> dict[str, Any]:
    """Check, tokenize and filter one row group; append its kept rows to files in ``part_dir``.

    Returns the part's code tables (local codes index them), its counts per language and reason,
    its kept row count and this process's peak RSS.
    """
    encoder = _worker_encoder
    manifest, part = task.manifest, Path(task.part_dir)
    part.mkdir(parents=True, exist_ok=True)
    tables: dict[str, dict[str, int]] = {"lang": {}, "shard": {}, "audio_dir": {}}
    counts: dict[str, dict[str, int]] = {}
    dropped_rows: dict[str, dict[str, list[int]]] = {}
    drops: list[dict[str, np.ndarray]] = []
    files = {
        name: open(part / f"{name}.bin", "wb")
        for name in (*_FIXED_DTYPES, "token_ids", "member_lengths", "token_lengths")
        if name not in ("member_offsets", "token_offsets")
    }
    checked_langs: set[str] = set()
    first_row, kept_rows = task.first_row, 0
    max_ids = task.max_token_len - 1
    # The token lists are the only objects created here and hold no cycles: the collector would
    # only walk them (and, in a forked worker, every object inherited from the parent) for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        columns = [*MANIFEST_COLUMNS, *audio_columns(pq.read_schema(manifest).names)]
        dictionary = [c for c in _DICTIONARY_COLUMNS if c in columns]
        parquet = pq.ParquetFile(manifest, read_dictionary=dictionary)
        batches = parquet.iter_batches(
            batch_size=_BATCH_ROWS, row_groups=[task.row_group], columns=columns
        )
        for batch in batches:
            n = batch.num_rows
            col = {
                name: _not_null(manifest, name, batch.column(name), first_row) for name in columns
            }
            lang_code = _codes(col["lang"], tables["lang"])
            lang_names = list(tables["lang"])
            for lang in lang_names:
                if lang not in checked_langs:  # fail on the first batch, before the long part
                    encoder.check_tag(lang)
                    checked_langs.add(lang)
            transcripts = _transcripts(manifest, col["text"], lang_code, lang_names, first_row)
            offsets, ids, full = encode_transcripts(encoder, transcripts, max_ids)
            del transcripts
            duration = col["duration"].cast(pa.float64()).to_numpy(zero_copy_only=False)
            token_len = np.minimum(1 + full, task.max_token_len)
            with np.errstate(invalid="ignore"):
                bad_duration = ~(np.isfinite(duration) & (duration > 0))
                frames = np.floor(
                    np.where(bad_duration, 0.0, duration) / task.frame_seconds + _FRAME_EPS
                )
            infeasible = ~bad_duration & (token_len > frames)
            keep = ~(bad_duration | infeasible)
            truncated = keep & (1 + full > task.max_token_len)
            for reason, mask in (
                ("rows_read", np.ones(n, bool)),
                ("rows_kept", keep),
                ("infeasible_tokens_gt_frames", infeasible),
                ("bad_duration", bad_duration),
                ("truncated_to_max_token_len", truncated),
            ):
                per_lang = np.bincount(lang_code[mask], minlength=len(lang_names))
                for code in np.flatnonzero(per_lang):
                    by_reason = counts.setdefault(lang_names[code], {})
                    by_reason[reason] = by_reason.get(reason, 0) + int(per_lang[code])
            for reason, mask in (
                ("infeasible_tokens_gt_frames", infeasible),
                ("bad_duration", bad_duration),
            ):
                for row in np.flatnonzero(mask):  # few: only the first of each are kept
                    listed = dropped_rows.setdefault(lang_names[lang_code[row]], {})
                    listed = listed.setdefault(reason, [])
                    if len(listed) < DROPPED_ROWS_LISTED:
                        listed.append(int(first_row + row))
            dropped = np.flatnonzero(bad_duration | infeasible)
            if len(dropped):
                drops.append(
                    {
                        "manifest_row": first_row + dropped,
                        "lang": lang_code[dropped],
                        "reason": bad_duration[dropped].astype(np.int64),  # DROP_REASONS index
                        "tokens": token_len[dropped],
                        "frames": frames[dropped].astype(np.int64),
                        "duration": duration[dropped],
                    }
                )
            rows = np.flatnonzero(keep)
            take = pa.array(rows)
            dirs, members = audio_dirs_and_names(
                {name: col[name].take(take) for name in columns if name not in MANIFEST_COLUMNS}
            )
            dir_code = _codes(dirs, tables["audio_dir"])
            members = members.cast(pa.large_string())
            if len(members):
                member_offsets = np.frombuffer(
                    members.buffers()[1], np.int64, len(members) + 1, members.offset * 8
                )
            else:  # an empty array may come without an offsets buffer
                member_offsets = np.zeros(1, np.int64)
            member_data = members.buffers()[2]
            lo, hi = int(member_offsets[0]), int(member_offsets[-1])
            token_lengths = np.diff(offsets)[rows]
            kept_ids = ids[np.repeat(keep, np.diff(offsets))]
            out = {
                "duration": duration[rows].astype("<f8"),
                "lang": lang_code[rows].astype("<i2"),
                "shard": _codes(col["shard_id"].take(take), tables["shard"]),
                "audio_dir": dir_code.astype("<i4"),
                "manifest_row": (first_row + rows).astype("<i8"),
                "member_lengths": np.diff(member_offsets).astype("<i8"),
                "token_lengths": token_lengths.astype("<i8"),
                "token_ids": kept_ids.astype(task.id_dtype),
            }
            for name, values in out.items():
                files[name].write(np.ascontiguousarray(values).data)
            if member_data is not None and hi > lo:
                files["member_data"].write(memoryview(member_data)[lo:hi])
            kept_rows += len(rows)
            first_row += n
    finally:
        for fh in files.values():
            fh.close()
        if gc_was_enabled:
            gc.enable()
    return {
        "tables": {name: list(table) for name, table in tables.items()},
        "counts": counts,
        "dropped_rows": dropped_rows,
        "dropped": _dropped_table(task, drops, list(tables["lang"])),
        "kept": kept_rows,
        "rows": first_row - task.first_row,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _dropped_table(
    task: _Task, drops: list[dict[str, np.ndarray]], lang_names: list[str]
) -> pa.Table | None:
    """The part's dropped rows as a ``DROPPED_SCHEMA`` table (None when it dropped none), their
    segment_ids read from the row group only then: the build itself never decodes that column."""
    if not drops:
        return None
    col = {name: np.concatenate([d[name] for d in drops]) for name in drops[0]}
    local = pa.array(col["manifest_row"] - task.first_row)
    if "segment_id" in pq.read_schema(task.manifest).names:
        ids = (
            pq.ParquetFile(task.manifest)
            .read_row_group(task.row_group, columns=["segment_id"], use_threads=False)
            .column(0)
            .take(local)
            .cast(pa.string())
        )
    else:
        ids = pa.nulls(len(local), pa.string())
    names = pa.array(lang_names, pa.string())
    return pa.table(
        {
            "manifest_row": pa.array(col["manifest_row"], pa.int64()),
            "segment_id": ids,
            "lang": names.take(pa.array(col["lang"])),
            "reason": pa.array(DROP_REASONS, pa.string()).take(pa.array(col["reason"])),
            "tokens": pa.array(col["tokens"], pa.int64()),
            "frames": pa.array(col["frames"], pa.int64()),
            "duration": pa.array(col["duration"], pa.float64()),
        },
        schema=DROPPED_SCHEMA,
    )


def _transcripts(
    manifest: str, text: pa.Array, lang_code: np.ndarray, lang_names: list[str], first_row: int
) -> pa.Array:
    """The texts without their leading ``<|lang|> `` tag; CacheError if a row's tag is not its lang."""
    tag_langs, transcripts = split_lang_tags(text)  # a null language where the text has no tag
    tags = tag_langs.dictionary_encode()
    code_of_tag = np.array(
        [lang_names.index(t) if t in lang_names else -1 for t in tags.dictionary.to_pylist()]
        + [-1],
        dtype=np.int64,
    )
    tag_codes = code_of_tag[
        tags.indices.fill_null(len(code_of_tag) - 1).to_numpy(zero_copy_only=False)
    ]
    mismatch = np.flatnonzero(tag_codes != lang_code)
    if len(mismatch):
        bad = int(mismatch[0])
        raise CacheError(
            f"manifest {manifest}: row {first_row + bad}: text {text[bad].as_py()[:60]!r} does not "
            f"start with its language tag (lang={lang_names[lang_code[bad]]!r}; {len(mismatch)} such "
            f"rows in rows {first_row}-{first_row + len(text) - 1}); the manifest contract is text = "
            f"'<|lang|> ' + transcript: rebuild it with build_manifest.py / scripts/make_train_val.py"
        )
    return transcripts


class _Assembler:
    """Appends finished parts, in manifest order, to the cache's column files."""

    def __init__(self, out_dir: Path, id_dtype: str):
        self.out_dir = out_dir
        self.dtypes = dict(_FIXED_DTYPES, token_ids=id_dtype)
        self.files = {name: open(out_dir / f"{name}.bin", "wb") for name in self.dtypes}
        self.tables: dict[str, dict[str, int]] = {name: {} for name in _CODE_COLUMNS}
        self.counts: dict[str, dict[str, int]] = {}
        self.dropped_rows: dict[str, dict[str, list[int]]] = {}
        self.dropped: list[pa.Table] = []
        self.lengths = dict.fromkeys(self.dtypes, 0)
        self.member_end = 0
        self.token_end = 0
        for name in ("member_offsets", "token_offsets"):
            self._write(name, np.zeros(1, "<i8"))

    def _write(self, name: str, values: np.ndarray) -> None:
        self.files[name].write(np.ascontiguousarray(values, self.dtypes[name]).data)
        self.lengths[name] += len(values)

    def add(self, part_dir: Path, result: dict) -> None:
        def load(name: str, dtype: str) -> np.ndarray:
            return np.fromfile(part_dir / f"{name}.bin", dtype=dtype)

        for name in _CODE_COLUMNS:
            table = self.tables[name]
            remap = np.array(
                [table.setdefault(v, len(table)) for v in result["tables"][name]], dtype=np.int64
            )
            local = load(name, self.dtypes[name])
            self._write(name, remap[local] if len(local) else local)
        for name in ("duration", "manifest_row"):
            self._write(name, load(name, self.dtypes[name]))
        for lengths_name, offsets_name, end in (
            ("member_lengths", "member_offsets", "member_end"),
            ("token_lengths", "token_offsets", "token_end"),
        ):
            lengths = load(lengths_name, "<i8")
            self._write(offsets_name, getattr(self, end) + np.cumsum(lengths))
            setattr(self, end, getattr(self, end) + int(lengths.sum()))
        for name in ("member_data", "token_ids"):
            with open(part_dir / f"{name}.bin", "rb") as src:
                shutil.copyfileobj(src, self.files[name], 16 << 20)
            self.lengths[name] += (part_dir / f"{name}.bin").stat().st_size // np.dtype(
                self.dtypes[name]
            ).itemsize
        for lang, by_reason in result["counts"].items():
            mine = self.counts.setdefault(lang, {})
            for reason, n in by_reason.items():
                mine[reason] = mine.get(reason, 0) + n
        for lang, by_reason in result.get("dropped_rows", {}).items():
            for reason, rows in by_reason.items():  # parts come in manifest order
                listed = self.dropped_rows.setdefault(lang, {}).setdefault(reason, [])
                listed.extend(rows[: DROPPED_ROWS_LISTED - len(listed)])
        if result.get("dropped") is not None:
            self.dropped.append(result["dropped"])
        shutil.rmtree(part_dir)

    def close(self) -> dict[str, dict]:
        for fh in self.files.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        dropped = pa.concat_tables(self.dropped) if self.dropped else DROPPED_SCHEMA.empty_table()
        pq.write_table(dropped, self.out_dir / DROPPED_FILE)
        with open(self.out_dir / DROPPED_FILE, "rb+") as fh:
            os.fsync(fh.fileno())
        return {
            name: {"dtype": dtype, "length": self.lengths[name]}
            for name, dtype in self.dtypes.items()
        }


def _manifest_row_groups(manifest_path: Path) -> tuple[list[tuple[int, int]], int]:
    """((row group, first row) of every row group, rows); CacheError when unreadable or a column
    is missing."""
    try:
        meta = pq.ParquetFile(manifest_path).metadata
    except (OSError, pa.ArrowInvalid) as exc:
        raise CacheError(f"cannot read the manifest {manifest_path}: {exc}") from None
    names = meta.schema.to_arrow_schema().names
    missing = [c for c in MANIFEST_COLUMNS if c not in names]
    try:
        audio_columns(names)
    except ManifestError:
        missing.append(AUDIO_COLUMN)
    if missing:
        raise CacheError(
            f"manifest {manifest_path} lacks the columns {missing} (has {names}); "
            f"rebuild it with build_manifest.py and scripts/make_train_val.py"
        )
    starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    return [(g, int(starts[g])) for g in range(meta.num_row_groups)], meta.num_rows


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def build(
    manifest_path: Path,
    tokenizer,
    out_path: Path,
    key: str,
    *,
    frame_seconds: float,
    max_token_len: int,
    workers: int = 0,
    progress: bool = True,
    identity: dict | None = None,
) -> dict[str, Any]:
    """Build the cache of ``manifest_path`` into the directory ``out_path`` (temp dir + rename).

    ``workers`` processes (0: every usable core) tokenize row groups in parallel; one worker, or a
    tokenizer that is not a plain SentencePiece model, runs in this process. Returns the summary.
    """
    from tqdm import tqdm

    t0 = time.monotonic()
    manifest_path = Path(manifest_path)
    groups, rows = _manifest_row_groups(manifest_path)
    vocab = getattr(tokenizer, "vocab_size", 1 << 31)
    id_dtype = "<u2" if vocab <= 1 << 16 else "<i4"
    proto = _sentencepiece_proto(tokenizer)
    workers = usable_cores() if workers <= 0 else workers
    workers = max(1, min(workers, len(groups))) if proto is not None else 1
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tasks = [
        _Task(
            str(manifest_path),
            g,
            first,
            str(tmp / f"part-{g:06d}"),
            float(frame_seconds),
            int(max_token_len),
            id_dtype,
        )
        for g, first in groups
    ]
    pool = None
    try:
        assembler = _Assembler(tmp, id_dtype)
        peak_worker_rss = 0
        if workers == 1:
            _init_worker(proto, None if proto is not None else tokenizer)
            results = map(_build_part, tasks)
        else:
            # fork: the workers need nothing but this module, and a fresh interpreter per worker
            # would re-import the caller's __main__ (train.py and all of NeMo) first. gc.freeze keeps
            # the workers' garbage collector off the parent's objects, whose pages it would
            # otherwise copy into every worker.
            gc.freeze()
            pool = _Workers(workers, tasks, proto)
            gc.unfreeze()
            results = pool.results(len(tasks))
        with tqdm(
            total=rows,
            desc="building training cache",
            unit="utt",
            disable=None if progress else True,  # None: no bar where stderr is a log file
        ) as bar:
            for task, result in zip(tasks, results):
                assembler.add(Path(task.part_dir), result)
                peak_worker_rss = max(peak_worker_rss, result["peak_rss"])
                bar.update(result["rows"])
        if pool is not None:
            pool.stop()
            pool = None
        columns = assembler.close()
        tables = assembler.tables
        summary = _summary(
            manifest_path, rows, assembler.counts, frame_seconds, max_token_len, tokenizer
        )
        summary["dropped_rows_by_lang"] = assembler.dropped_rows
        summary.update(
            build_seconds=round(time.monotonic() - t0, 3),
            build_workers=workers,
            build_peak_rss_worker=int(peak_worker_rss),
        )
        meta = {
            "format": CACHE_FORMAT,
            "key": key,
            "manifest": str(manifest_path.resolve()),
            **(identity or {}),
            "columns": columns,
            "lang_names": list(tables["lang"]),
            "shard_names": list(tables["shard"]),
            "dir_names": list(tables["audio_dir"]),
            "summary": summary,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, ensure_ascii=False))
        with open(tmp / META_FILE, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        if pool is not None:
            pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _init_worker(None, None)
        _return_memory()
    with contextlib.suppress(OSError):
        fd = os.open(out_path.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return summary


def _summary(manifest_path, rows, counts, frame_seconds, max_token_len, tokenizer) -> dict:
    def total(reason: str) -> int:
        return sum(c.get(reason, 0) for c in counts.values())

    reasons = DROP_REASONS
    return {
        "manifest": str(manifest_path),
        "rows_read": int(rows),
        "rows_kept": total("rows_kept"),
        "dropped": {reason: total(reason) for reason in reasons},
        "dropped_by_lang": {
            lang: {r: c[r] for r in reasons if c.get(r)}
            for lang, c in sorted(counts.items())
            if any(c.get(r) for r in reasons)
        },
        "kept_by_lang": {lang: c.get("rows_kept", 0) for lang, c in sorted(counts.items())},
        "read_by_lang": {lang: c.get("rows_read", 0) for lang, c in sorted(counts.items())},
        "dropped_rows_file": DROPPED_FILE,
        "truncated_to_max_token_len": total("truncated_to_max_token_len"),
        "frame_seconds": float(frame_seconds),
        "max_token_len": int(max_token_len),
        "tokenizer_sha256": vocabulary.tokenizer_fingerprint(tokenizer),
    }


def read_dropped_rows(cache_path: Path) -> pa.Table:
    """Every row the cache at ``cache_path`` dropped (``DROPPED_SCHEMA``), in manifest order."""
    return pq.read_table(Path(cache_path) / DROPPED_FILE, schema=DROPPED_SCHEMA)


def heavy_drops(summary: dict, share: float = VALIDATION_DROP_WARN_SHARE) -> list[dict]:
    """The languages of a build ``summary`` that lost more than ``share`` of their rows, largest
    share first: ``{"lang", "dropped", "read", "by_reason": {reason: rows}}`` each."""
    read = summary.get("read_by_lang") or {
        lang: kept + sum((summary.get("dropped_by_lang") or {}).get(lang, {}).values())
        for lang, kept in (summary.get("kept_by_lang") or {}).items()
    }
    out = []
    for lang, by_reason in (summary.get("dropped_by_lang") or {}).items():
        dropped, total = sum(by_reason.values()), read.get(lang, 0)
        if total and dropped > share * total:
            out.append({"lang": lang, "dropped": dropped, "read": total, "by_reason": by_reason})
    return sorted(out, key=lambda d: (-d["dropped"] / d["read"], d["lang"]))


def validation_drop_warning(manifest: Path, heavy: dict, summary: dict, record: Path) -> str:
    """One line for a language of a validation manifest in ``heavy_drops``: how many rows it
    loses, why, and what fixes it (``record``: the cache's list of its dropped rows)."""
    lang, dropped, read = heavy["lang"], heavy["dropped"], heavy["read"]
    why = ", ".join(f"{n} {reason}" for reason, n in heavy["by_reason"].items())
    fixes = []
    if heavy["by_reason"].get("infeasible_tokens_gt_frames"):
        fixes.append(
            f"their transcripts need more tokens than the audio has {summary['frame_seconds']:g} s "
            f"encoder frames: raise VOCAB_SIZE and retrain the tokenizer (scripts/train_tokenizer.py) "
            f"so {lang} gets longer pieces, or fix the rows whose transcript is longer than their "
            f"audio (ENCODER_FRAME_SECONDS is the encoder's own stride, and a lower MAX_TOKEN_LEN "
            f"would only cut transcripts short)"
        )
    if heavy["by_reason"].get("bad_duration"):
        fixes.append(
            "rows without a positive duration: rebuild the manifest with build_manifest.py"
        )
    return (
        f"WARNING: validation manifest {manifest}: {lang} loses {dropped} of its {read} rows "
        f"({100 * dropped / read:.0f}%) in the training cache ({why}), so its WER is scored on the "
        f"{read - dropped} left; {'; '.join(fixes)}; each dropped row (segment_id, tokens, frames) "
        f"is listed in {record}"
    )


# --------------------------------------------------------------------------------------------------
# Finding or building, and superseded caches
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheInfo:
    """A cache ready to map: ``path``, ``key``, whether this call ``built`` it, its build ``summary``,
    ``removed`` superseded caches (path, bytes) and ``kept_others``: caches of the same manifest
    left in place (in use, or built for other settings), as (path, bytes, why)."""

    path: Path
    key: str
    built: bool
    summary: dict
    removed: list = field(default_factory=list)
    kept_others: list = field(default_factory=list)


def cache_directory(manifest_path: Path, cache_dir: Path | str | None) -> Path:
    """``cache_dir`` when set, else the manifest's directory."""
    return Path(cache_dir) if cache_dir not in (None, "") else Path(manifest_path).parent


def _check_writable(directory: Path, manifest_path: Path, explicit: bool) -> None:
    try:
        check_writable(directory)
    except OSError as exc:
        where = (
            f"CACHE_DIR={directory}"
            if explicit
            else f"the manifest's directory {directory} (CACHE_DIR is unset)"
        )
        raise CacheError(
            f"cannot write the training cache of {manifest_path} into {where}: "
            f"{exc.strerror or exc}; set CACHE_DIR to a writable directory (a read-only data "
            f"directory works with CACHE_DIR elsewhere)"
        ) from None


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def _handle_superseded(directory: Path, manifest_path: Path, content: str, key: str):
    removed, kept = [], []
    target = str(manifest_path.resolve())
    for path in sorted(directory.glob(f"*{CACHE_SUFFIX}")):
        meta = _read_meta(path)
        if meta is None or meta.get("key") == key or meta.get("manifest") != target:
            continue
        try:
            size = directory_size(path)
            if meta.get("content_sha256") == content:
                kept.append(
                    (path, size, "same manifest content, other tokenizer or frame settings")
                )
                continue
            with open(path / META_FILE) as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    kept.append((path, size, "superseded, still mapped by a running process"))
                    continue
                shutil.rmtree(path)
        except FileNotFoundError:  # another process removed it first
            continue
        removed.append((path, size))
    return removed, kept


def lookup(
    manifest_path,
    tokenizer,
    *,
    frame_seconds: float,
    max_token_len: int,
    cache_dir=None,
) -> Path | None:
    """The complete cache ``ensure`` would map for these inputs, or None where it would build one
    (nothing is built; the manifest is hashed once, as ``ensure`` remembers it)."""
    return lookup_by_fingerprint(
        manifest_path,
        vocabulary.tokenizer_fingerprint(tokenizer),
        frame_seconds=frame_seconds,
        max_token_len=max_token_len,
        cache_dir=cache_dir,
    )


def lookup_by_fingerprint(
    manifest_path,
    tokenizer_sha256: str,
    *,
    frame_seconds: float,
    max_token_len: int,
    cache_dir=None,
) -> Path | None:
    """``lookup`` for the tokenizer whose ``tokenizer_fingerprint`` is ``tokenizer_sha256``
    (``model_file_fingerprint`` gives it from a tokenizer.model without loading NeMo)."""
    manifest_path = Path(manifest_path)
    directory = cache_directory(manifest_path, cache_dir)
    if not manifest_path.is_file() or not directory.is_dir():
        return None
    content = content_hash.content_sha256(manifest_path, directory)
    key = cache_key(content, tokenizer_sha256, frame_seconds, max_token_len)
    return find_cache(directory, key)


def model_file_fingerprint(model_path: Path) -> str:
    """``tokenizer_fingerprint`` of the SentencePiece tokenizer of the file ``model_path``."""
    model = Path(model_path).read_bytes()
    return hashlib.sha256(vocabulary.sentencepiece_model_without_paths(model)).hexdigest()


def ensure(
    manifest_path,
    tokenizer,
    *,
    frame_seconds: float,
    max_token_len: int,
    cache_dir=None,
    workers: int = 0,
    progress: bool = True,
) -> CacheInfo:
    """The cache of ``manifest_path`` for this tokenizer and these settings, built unless it exists.

    Safe when every rank of a node (or of several nodes sharing the directory) calls it at once: an
    exclusive lock on ``.<key>.training-cache.lock`` lets one process build while the others wait,
    then they map its result.
    """
    manifest_path = Path(manifest_path)
    if not manifest_path.is_file():
        raise CacheError(
            f"manifest {manifest_path} does not exist; build it with build_manifest.py and "
            f"scripts/make_train_val.py"
        )
    directory = cache_directory(manifest_path, cache_dir)
    tok_sha = vocabulary.tokenizer_fingerprint(tokenizer)
    explicit = cache_dir not in (None, "")
    if not directory.is_dir():
        _check_writable(directory, manifest_path, explicit)
    content = content_hash.content_sha256(manifest_path, directory, progress=progress)
    key = cache_key(content, tok_sha, frame_seconds, max_token_len)
    found = find_cache(directory, key)
    if found is not None:
        return CacheInfo(found, key, False, _read_meta(found)["summary"])
    _check_writable(directory, manifest_path, explicit)
    lock_path = directory / f".{key}{CACHE_SUFFIX}.lock"
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to build the training cache %s", lock_path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_cache(directory, key)
        if found is not None:
            return CacheInfo(found, key, False, _read_meta(found)["summary"])
        # Holding the lock, any temporary directory of this key is a killed build's.
        for stale in directory.glob(f".*.{key}{CACHE_SUFFIX}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        path = directory / f"{manifest_path.stem}.{key}{CACHE_SUFFIX}"
        log.info("building the training cache %s from %s", path, manifest_path)
        try:
            summary = build(
                manifest_path,
                tokenizer,
                path,
                key,
                frame_seconds=frame_seconds,
                max_token_len=max_token_len,
                workers=workers,
                progress=progress,
                identity={"content_sha256": content},
            )
        except OSError as exc:
            if disk_full(exc):
                raise CacheError(
                    f"no space left in {directory} while building the training cache of "
                    f"{manifest_path} ({shutil.disk_usage(directory).free / 2**30:.1f} GiB free now); "
                    f"free space or set CACHE_DIR to a larger file system"
                ) from None
            raise
    removed, kept = _handle_superseded(directory, manifest_path, content, key)
    for old, size in removed:
        log.info("removed the superseded training cache %s (%.1f MiB)", old, size / 2**20)
    for old, size, why in kept:
        log.info("kept the training cache %s (%.1f MiB): %s", old, size / 2**20, why)
    return CacheInfo(path, key, True, summary, removed, kept)


# --------------------------------------------------------------------------------------------------
# Mapping
# --------------------------------------------------------------------------------------------------


def _map(path: Path, dtype: str, length: int) -> np.ndarray:
    """A read-only array over the file's pages (shared by every process that maps it)."""
    import mmap

    if length == 0:
        empty = np.empty(0, dtype)
        empty.flags.writeable = False
        return empty
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, dtype=dtype, count=length)


class CacheColumns:
    """Read-only NumPy views of one mapped cache (no copies, no per-row Python objects).

    While it exists this process holds a shared lock on the cache's ``meta.json``, so a later build
    never deletes a cache that is in use.
    """

    def __init__(self, path: Path, key: str | None = None):
        self.path = Path(path)
        self._lock = open(self.path / META_FILE, "rb")
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        meta = json.loads(self._lock.read())
        if meta.get("format") != CACHE_FORMAT or (key is not None and meta.get("key") != key):
            raise CacheError(
                f"training cache {self.path} is not the one expected (format {meta.get('format')}, "
                f"key {meta.get('key')}, expected {key}); rebuild it with scripts/build_training_cache.py"
            )
        self.meta = meta
        cols = {
            name: _map(self.path / f"{name}.bin", spec["dtype"], spec["length"])
            for name, spec in meta["columns"].items()
        }
        self.durations = cols["duration"]
        self.lang_codes = cols["lang"]
        self.shard_codes = cols["shard"]
        self.dir_codes = cols["audio_dir"]
        self.member_offsets = cols["member_offsets"]
        self.member_data = cols["member_data"]
        self.id_offsets = cols["token_offsets"]
        self.ids = cols["token_ids"]
        self.manifest_row = cols["manifest_row"]
        self.lang_names: list[str] = meta["lang_names"]
        self.shard_names: list[str] = meta["shard_names"]
        self.dir_names: list[str] = meta["dir_names"]
        self.summary: dict = meta["summary"]

    def member_name(self, i: int) -> str:
        start, end = self.member_offsets[i], self.member_offsets[i + 1]
        return self.member_data[start:end].tobytes().decode("utf-8")

    def token_ids_of(self, i: int) -> np.ndarray:
        """Item ``i``'s token ids without the language tag."""
        return self.ids[self.id_offsets[i] : self.id_offsets[i + 1]]
