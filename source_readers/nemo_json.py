"""NeMo JSON manifests (one object per line, audio files on disk): read in chunks of the file,
segments with an ``offset`` cut out once as FLAC."""

from __future__ import annotations

import io
import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import polars as pl

from manifest_schema import ManifestError, text_start
from source_readers.standard_rows import (
    FIELDS,
    ROW_SCHEMA,
    RowIds,
    Shard,
    SourceRows,
    SourceSpec,
    _as_float,
    _as_string,
    _bad,
    _check_audio,
    _cut_recording,
    _groups_by_directory,
    _in_processes,
    _lang_expr,
    _pick,
    _standard_rows,
    _valid_segment,
    origin_order,
)

_CHUNK_BYTES = 16 << 20
_INFER_ROWS = 10_000  # rows whose fields and types decide a manifest's columns on the fast path


def _json_chunks(path: Path) -> Iterator[tuple[int, bytes]]:
    """(number of the chunk's first line, whole lines) of the file, about ``_CHUNK_BYTES`` each,
    cut from a memory map of it; a byte-order mark is left out."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            start, line = text_start(path, view[:4]), 1
            while start < size:
                end = min(start + _CHUNK_BYTES, size)
                if end < size:
                    cut = view.rfind(b"\n", start, end)
                    if cut < 0:  # one line longer than a chunk
                        cut = view.find(b"\n", end)
                    end = size if cut < 0 else cut + 1
                chunk = view[start:end]
                yield line, chunk
                line += chunk.count(b"\n")
                # the chunk is copied out: its pages of the map leave this process's resident set
                done = end - end % mmap.PAGESIZE
                if done > 0 and hasattr(mmap, "MADV_DONTNEED"):
                    view.madvise(mmap.MADV_DONTNEED, 0, done)
                start = end


def _parse_json_chunk(first_line: int, chunk: bytes, path: Path) -> tuple[pl.DataFrame, list]:
    """The chunk's JSON objects as a frame with a ``line`` column, and its lines that are not."""
    try:
        frame = pl.read_ndjson(io.BytesIO(chunk), infer_schema_length=_INFER_ROWS)
        if frame.height == chunk.count(b"\n") + (not chunk.endswith(b"\n")):
            line = pl.int_range(first_line, first_line + frame.height, dtype=pl.UInt32)
            return frame.with_columns(line.alias("line")), []
    except Exception:  # a line that is not JSON, or types polars cannot unify: one by one
        pass
    lines = chunk.split(b"\n")
    rows, bad = [], []
    for i, text in enumerate(lines):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as exc:
            bad.append(_bad(f"{path}:{first_line + i}", "not_json", str(exc)))
            continue
        if not isinstance(row, dict):
            bad.append(_bad(f"{path}:{first_line + i}", "not_json", "not a JSON object"))
            continue
        row = {
            k: v if isinstance(v, (str, int, float)) or v is None else str(v)
            for k, v in row.items()
        }
        row["line"] = first_line + i
        rows.append(row)
    if not rows:
        return pl.DataFrame({"line": pl.Series([], dtype=pl.UInt32)}), bad
    keys = list(dict.fromkeys(k for row in rows for k in row))
    columns = {}
    for key in keys:
        values = [row.get(key) for row in rows]
        numeric = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) or v is None for v in values
        )
        columns[key] = pl.Series(
            key,
            [None if v is None else (float(v) if numeric else str(v)) for v in values],
            dtype=pl.Float64 if numeric else pl.String,
        )
    frame = pl.DataFrame(columns).with_columns(pl.col("line").cast(pl.UInt32))
    return frame, bad


def _line_count(path: Path) -> int:
    """Lines in the file (a last line without a newline counts)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def _read_json_rows(path: Path) -> tuple[pl.DataFrame, list[dict]]:
    """Every JSON object of the file as a frame with its ``line`` (1-based), and the lines that are
    not objects as bad rows. The whole file goes through polars' multi-threaded reader (types
    inferred from the first ``_INFER_ROWS`` rows) when each line is one object; otherwise, or when a
    later row's types disagree, it is read in chunks, a chunk that fails line by line."""
    with open(path, "rb") as f:
        marked = text_start(path, f.read(4)) > 0
    try:  # polars' reader takes no byte-order mark: a file with one goes by chunks, which skip it
        frame = None if marked else pl.read_ndjson(path, infer_schema_length=_INFER_ROWS)
        if frame is not None and frame.height and frame.height == _line_count(path):
            line = pl.int_range(1, frame.height + 1, dtype=pl.UInt32).alias("line")
            return frame.with_columns(line), []
    except Exception:  # not JSON somewhere, or types polars cannot unify: chunk by chunk
        pass
    frames, bad = [], []
    for first_line, chunk in _json_chunks(path):
        frame, chunk_bad = _parse_json_chunk(first_line, chunk, path)
        bad += chunk_bad
        if frame.height:
            frames.append(frame)
    if not frames:
        return pl.DataFrame({"line": pl.Series([], dtype=pl.UInt32)}), bad
    return pl.concat(frames, how="diagonal_relaxed"), bad


def read_nemo_json(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> Iterator[SourceRows]:
    """A NeMo JSON manifest: one object per line with ``audio_filepath``, ``text`` and usually
    ``duration`` (other fields per ``FIELDS``). A relative audio path is resolved against the
    manifest's folder, as NeMo does. The rows come in batches of about ``_CHUNK_BYTES`` of the
    file."""
    return _nemo_batches(spec, out_dir, workers, progress)


def _nemo_batches(
    spec: SourceSpec, out_dir: Path, workers: int, progress: bool
) -> Iterator[SourceRows]:
    from tqdm import tqdm

    path, first, ids = spec.path, True, RowIds(spec.name)
    with tqdm(
        total=path.stat().st_size,
        desc=f"reading {spec.name}",
        unit="B",
        unit_scale=True,
        disable=not progress,
    ) as bar:
        for first_line, chunk in _json_chunks(path):
            frame, bad = _parse_json_chunk(first_line, chunk, path)
            if frame.height:
                frame, fields = _nemo_fields(spec, frame, bad, first=first, ids=ids)
                first = False
                yield _nemo_plain(spec, frame, bad, workers, fields, out_dir)
            elif bad:
                yield SourceRows(pl.DataFrame(schema=ROW_SCHEMA), [], bad)
            bar.update(len(chunk))
    if first:
        raise ManifestError(f"{path}: no JSON object with an audio path")


def _nemo_fields(
    spec: SourceSpec, frame: pl.DataFrame, bad: list, first: bool, ids: RowIds
) -> tuple[pl.DataFrame, dict]:
    """``frame`` with ``_audio``, ``_duration``, ``_text`` and ``_id`` columns, its rows without an
    audio path or a transcript moved to ``bad``; and the fields found. The first batch must have
    an audio and a text field (ManifestError naming the fields it has); a later one without is all
    bad."""
    path = spec.path
    columns = [c for c in frame.columns if c != "line"]
    audio = _pick(spec, "audio", columns, required=first)
    fields = {
        "text": _pick(spec, "text", columns, required=first),
        "lang": _pick(spec, "lang", columns),
        "speaker": _pick(spec, "speaker", columns),
        "quality": _pick(spec, "quality", columns),
    }
    own = frame.with_columns(_as_string(frame, _pick(spec, "id", columns)).alias("_own"))["_own"]
    frame = frame.with_columns(
        _as_string(frame, audio).str.strip_chars().alias("_audio"),
        _as_float(frame, _pick(spec, "duration", columns)).alias("_duration"),
        _as_string(frame, fields["text"]).alias("_text"),
        ids.assign(own, frame.get_column("line")).alias("_id"),
        _lang_expr(spec, frame, fields["lang"]).alias("_lang"),
        pl.concat_str(pl.lit(f"{path}:"), pl.col("line").cast(pl.String)).alias("_origin"),
        _as_float(frame, "offset").alias("_offset"),
    )
    no_audio = pl.col("_audio").is_null() | (pl.col("_audio") == "")
    missing = frame.filter(no_audio | pl.col("_text").is_null())
    for number, no_path, row_lang in missing.select("line", no_audio, "_lang").iter_rows():
        if no_path:
            bad.append(_bad(f"{path}:{number}", "audio_path_missing", f"no {audio}", row_lang))
        else:
            detail = f"no {fields['text'] or ' / '.join(FIELDS['text'])}"
            bad.append(_bad(f"{path}:{number}", "transcript_missing", detail, row_lang))
    usable = ~no_audio & pl.col("_text").is_not_null()
    if "offset" in frame.columns:
        offset, duration = pl.col("_offset"), pl.col("_duration")
        invalid = (
            (pl.col("offset").is_not_null() & offset.is_null())
            | ~offset.is_finite()
            | (offset < 0)
            | (offset.is_not_null() & (~duration.is_finite() | (duration <= 0)))
        ).fill_null(False)
        wrong = frame.filter(usable & invalid)
        for number, given, start, seconds, row_lang in wrong.select(
            "line", pl.col("offset").cast(pl.String), "_offset", "_duration", "_lang"
        ).iter_rows():
            detail = (
                f"offset {given!r} is not a number"
                if start is None
                else _valid_segment(start, None if seconds is None else start + seconds)
                or f"duration {seconds:g} s: expected a number > 0"
            )
            bad.append(_bad(f"{path}:{number}", "segment_invalid", detail, row_lang))
        usable = usable & ~invalid
    return frame.filter(usable), fields


def _nemo_plain(
    spec: SourceSpec, frame: pl.DataFrame, bad: list, workers: int, fields: dict, out_dir: Path
) -> SourceRows:
    """A batch of a plain NeMo manifest: audio paths resolved and checked, grouped by folder. A
    row with an ``offset`` is a segment of its file, ``[offset, offset + duration)`` as NeMo reads
    it: cut out once as FLAC (``_cut_segments``)."""
    path = spec.path
    base = str(path.parent.absolute())
    frame = frame.with_columns(
        pl.when(pl.col("_audio").str.starts_with("/"))
        .then(pl.col("_audio"))
        .otherwise(pl.concat_str(pl.lit(base + "/"), pl.col("_audio").str.strip_prefix("./")))
        .alias("_audio")
    )
    segments = frame.filter(pl.col("_offset").is_not_null())
    if segments.height:  # a filter copies every column: only when some row is a segment
        frame = frame.filter(pl.col("_offset").is_null())
    lines = frame.get_column("line")
    seconds, keep, audio_bad = _check_audio(
        frame.get_column("_audio"),
        frame.get_column("_duration"),
        lambda i: f"{path}:{lines[i]}",
        frame.get_column("_lang"),
        spec.options.get("check", "header"),
        workers,
    )
    bad += audio_bad
    frame = frame.with_columns(seconds.alias("_duration")).filter(pl.Series(keep))
    quality = fields["quality"]
    shard, names, shards = _groups_by_directory(
        frame.get_column("_audio"), spec.name, "", quality is not None, path.parent
    )
    rows = _standard_rows(frame, fields["speaker"], quality).with_columns(
        shard.alias("shard"),
        frame.get_column("_duration").alias("duration_s"),
        names.alias("tar_member_name"),
    )
    parts = [rows.select(list(ROW_SCHEMA))]
    if segments.height:
        cut, cut_shards = _cut_segments(spec, segments, bad, workers, fields, out_dir)
        parts.append(cut.with_columns(pl.col("shard") + len(shards)).select(list(ROW_SCHEMA)))
        shards += cut_shards
    bad.sort(key=lambda b: origin_order(b["origin"]))
    return SourceRows(pl.concat(parts), shards, bad)


def _cut_segments(
    spec: SourceSpec,
    frame: pl.DataFrame,
    bad: list,
    workers: int,
    fields: dict,
    out_dir: Path,
) -> tuple[pl.DataFrame, list[Shard]]:
    """Rows with an ``offset``: each file's segments written as ``<line>.flac`` into a folder of
    its own under ``out_dir`` (``_cut_recording``: verified, done marker, skipped on a rerun)."""
    import hashlib

    recordings = sorted(set(frame.get_column("_audio").to_list()))

    def folder_of(recording: str) -> str:
        digest = hashlib.blake2b(recording.encode(), digest_size=6).hexdigest()
        return str(out_dir / f"{Path(recording).stem}-{digest}")

    wanted: dict[str, list] = {r: [] for r in recordings}
    for line, audio, offset, duration in frame.select(
        "line", "_audio", "_offset", "_duration"
    ).iter_rows():
        end = -1.0 if duration is None else offset + duration
        wanted[audio].append((str(line), float(offset), end))
    tasks = [(r, folder_of(r), wanted[r]) for r in recordings]
    records = dict(zip(recordings, _in_processes(_cut_recording, tasks, workers)))
    quality = fields["quality"]
    shards = [
        Shard(
            f"{spec.name}/{Path(folder_of(r)).name}",
            spec.name,
            "",
            Path(folder_of(r)),
            quality is not None,
        )
        for r in recordings
    ]
    position = {r: k for k, r in enumerate(recordings)}
    keep, shard, seconds = [], [], []
    for line, audio, row_lang in frame.select("line", "_audio", "_lang").iter_rows():
        record, origin = records[audio], f"{spec.path}:{line}"
        if "error" in record:
            bad.append(_bad(origin, record["error"], record["detail"], row_lang))
        elif str(line) in record["bad"]:
            bad.append(_bad(origin, "segment_past_end", record["bad"][str(line)], row_lang))
        else:
            keep.append(True)
            shard.append(position[audio])
            seconds.append(record["seconds"][str(line)])
            continue
        keep.append(False)
    frame = frame.filter(pl.Series(keep, dtype=pl.Boolean))
    rows = _standard_rows(frame, fields["speaker"], quality).with_columns(
        pl.Series("shard", shard, dtype=pl.UInt32),
        pl.Series("duration_s", seconds, dtype=pl.Float64),
        (frame.get_column("line").cast(pl.String) + ".flac").alias("tar_member_name"),
    )
    return rows, shards
