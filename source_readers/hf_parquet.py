"""Hugging Face audio parquet: each file's encoded audio written out once as FLAC, its other
columns read as the rows' fields."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

import file_names
from manifest_schema import ManifestError
from source_readers.standard_rows import (
    ROW_SCHEMA,
    RowIds,
    Shard,
    SourceRows,
    SourceSpec,
    _as_float,
    _as_string,
    _audio_bytes_to_flac,
    _bad,
    _in_processes,
    _lang_expr,
    _mark_done,
    _mismatch,
    _pick,
    _standard_rows,
    _unit_done,
)


def _audio_column(schema: dict) -> str | None:
    """The column holding encoded audio: ``audio`` or the first struct with a ``bytes`` field."""
    for name, dtype in schema.items():
        if isinstance(dtype, pl.Struct) and "bytes" in [f.name for f in dtype.fields]:
            if name == "audio":
                return name
    for name, dtype in schema.items():
        if isinstance(dtype, pl.Struct) and "bytes" in [f.name for f in dtype.fields]:
            return name
    return None


def _write_parquet_audio(task: tuple[str, str, str]) -> dict:
    """Write each row's audio of one parquet file as ``<row>.flac`` in ``folder`` (bytes decoded
    to check them), then the done marker: ``{"seconds": [...], "bad": {row: reason}}``."""
    import pyarrow.parquet as pq

    parquet_path, column, folder = task
    folder_path = Path(folder)
    done = _unit_done(folder_path)
    if done is not None:
        return done
    folder_path.mkdir(parents=True, exist_ok=True)
    seconds: list[float | None] = []
    bad: dict[str, str] = {}
    base = Path(parquet_path).parent
    try:
        source = pq.ParquetFile(parquet_path)
        for batch in source.iter_batches(batch_size=256, columns=[column]):
            for value in batch.column(0).to_pylist():
                row = len(seconds)
                data = (value or {}).get("bytes")
                if data is None and (value or {}).get("path"):
                    audio_path = base / value["path"]
                    data = audio_path.read_bytes() if audio_path.is_file() else None
                try:
                    if data is None:
                        raise ValueError("no audio bytes")
                    seconds.append(_audio_bytes_to_flac(data, folder_path / f"{row:08d}.flac"))
                except ValueError as exc:
                    seconds.append(None)
                    bad[str(row)] = str(exc)
    except OSError as exc:
        return {"error": f"{parquet_path}: unreadable ({exc})"}
    record = {"parquet": parquet_path, "seconds": seconds, "bad": bad}
    _mark_done(folder_path, record)
    return record


def read_hf_parquet(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> SourceRows:
    """Parquet files as the Hugging Face ``datasets`` library writes them (a folder of them, or
    one): an audio column of ``{bytes, path}`` structs, the transcript and other fields beside it.
    Each file's audio is written out once as FLAC; a file without an audio column is skipped."""
    files = [spec.path] if spec.path.is_file() else sorted(spec.path.rglob("*.parquet"))
    if not files:
        raise ManifestError(f"{spec.path}: no *.parquet files")
    base = spec.path if spec.path.is_dir() else spec.path.parent
    bad_files, tasks, metas = [], [], []
    for k, file in enumerate(files):
        if not file_names.is_utf8(file):
            # Its rows' audio paths would hold the name, and a manifest holds UTF-8 text only.
            bad_files.append(
                file_names.not_utf8(file, "name", "rename it in UTF-8 to import its rows")
            )
            continue
        try:
            schema = dict(pl.read_parquet_schema(file))
        except Exception as exc:
            bad_files.append(
                {"path": str(file), "reason": f"unreadable ({type(exc).__name__}: {exc})"}
            )
            continue
        column = spec.options.get("audio_field") or _audio_column(schema)
        if column is None or column not in schema:
            bad_files.append(
                {"path": str(file), "reason": "no audio column (a struct with the encoded bytes)"}
            )
            continue
        rel = file.relative_to(base).with_suffix("").as_posix().replace("/", "__")
        folder = out_dir / f"{k:05d}_{rel}"
        tasks.append((str(file), column, str(folder)))
        metas.append((file, schema, column, folder))
    from tqdm import tqdm

    results = []
    with tqdm(
        total=len(tasks), desc=f"writing {spec.name} as FLAC", unit="file", disable=not progress
    ) as bar:
        for record in _in_processes(_write_parquet_audio, tasks, workers):
            results.append(record)
            bar.update(1)
    parts, shards, bad, ids = [], [], [], RowIds(spec.name)
    for (file, schema, column, folder), record in zip(metas, results):
        if "error" in record:
            bad_files.append({"path": str(file), "reason": record["error"]})
            continue
        columns = [c for c in schema if c != column]
        frame = pl.read_parquet(file, columns=columns) if columns else pl.DataFrame()
        n = len(record["seconds"])
        if frame.height != n:
            frame = pl.DataFrame({"_": pl.Series([None] * n)})
            columns = []
        text = _pick(spec, "text", columns)
        lang = _pick(spec, "lang", columns)
        speaker = _pick(spec, "speaker", columns)
        quality = _pick(spec, "quality", columns)
        id_field = _pick(spec, "id", columns)
        duration = _pick(spec, "duration", columns)
        row = pl.int_range(0, n, dtype=pl.UInt32)
        own = frame.with_columns(_as_string(frame, id_field).alias("_own"))["_own"]
        rel = file.relative_to(base).with_suffix("").as_posix()
        where = pl.select(pl.concat_str(pl.lit(f"{rel}:"), row.cast(pl.String)))
        frame = frame.with_columns(
            row.alias("_row"),
            pl.Series("_seconds", record["seconds"], dtype=pl.Float64),
            _as_float(frame, duration).alias("_duration"),
            _as_string(frame, text).alias("_text"),
            _lang_expr(spec, frame, lang).alias("_lang"),
            ids.assign(own, where.to_series()).alias("_id"),
            pl.concat_str(pl.lit(f"{file} row "), row.cast(pl.String)).alias("_origin"),
        )
        langs = frame.get_column("_lang")
        keep = np.ones(n, bool)
        for row, seconds, given, transcript in frame.select(
            "_row", "_seconds", "_duration", "_text"
        ).iter_rows():
            origin = f"{file} row {row}"
            if seconds is None:
                bad.append(
                    _bad(origin, "audio_unreadable", record["bad"].get(str(row), ""), langs[row])
                )
            elif transcript is None:
                bad.append(
                    _bad(origin, "transcript_missing", f"no {text or 'text field'}", langs[row])
                )
            elif given is not None and _mismatch(given, seconds):
                detail = f"duration {given:g} s, the audio holds {seconds:.3f} s"
                bad.append(_bad(origin, "duration_mismatch", detail, langs[row]))
            else:
                continue
            keep[row] = False
        frame = frame.filter(pl.Series(keep))
        position = len(shards)
        shards.append(
            Shard(f"{spec.name}/{folder.name}", spec.name, "", folder, quality is not None)
        )
        parts.append(
            _standard_rows(frame, speaker, quality)
            .with_columns(
                pl.lit(position, dtype=pl.UInt32).alias("shard"),
                pl.coalesce(frame["_duration"], frame["_seconds"]).alias("duration_s"),
                (frame["_row"].cast(pl.String).str.zfill(8) + ".flac").alias("tar_member_name"),
            )
            .select(list(ROW_SCHEMA))
        )
    rows = pl.concat(parts) if parts else pl.DataFrame(schema=ROW_SCHEMA)
    return SourceRows(rows, shards, bad, bad_files)
