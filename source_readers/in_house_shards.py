"""The in-house shards: finding them under SHARDS_DIR and reading their metadata and audio index.

A shard is a directory ``<source>/<lang>/<shard>/`` holding ``metadata.parquet`` (a row per
segment: ``segment_id``, ``transcription_native``, ``duration_s``, ``tx_quality_score``, optionally
``segment_language`` and ``speaker_id``) and ``audio_index.parquet`` (``segment_id`` ->
``tar_member_name``). build_manifest.py joins the two and filters the rows; here they are found,
their columns checked, and read in multi-file scans, each unreadable shard reported with its reason
and the rest read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import polars as pl

import file_names
from manifest_schema import INDEX_FILE, METADATA_FILE, ManifestError
from source_readers.standard_rows import Shard

REQUIRED_METADATA = {
    "segment_id": "string",
    "transcription_native": "string",
    "duration_s": "numeric",
    "tx_quality_score": "numeric",
}
OPTIONAL_METADATA = {"segment_language": "string", "speaker_id": "any"}
REQUIRED_INDEX = {"segment_id": "string", "tar_member_name": "string"}


def _directories_holding(root: Path, name: str) -> Iterator[str]:
    """Every directory under ``root`` (itself included) with an entry called ``name``.

    Like ``Path.rglob`` it does not descend into symlinked directories; it tells directories from
    the directory listing itself, without a stat call per directory, several times quicker on a
    tree of thousands of shards.
    """
    pending = [os.fspath(root)]
    while pending:
        directory, found = pending.pop(), False
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name == name:
                        found = True
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
        except OSError:  # unreadable or vanished: skipped, as rglob skips it
            continue
        if found:
            yield directory


def discover_shards(shards_dir: Path) -> tuple[list[Shard], list[dict[str, str]]]:
    """Every directory holding metadata.parquet, sorted by shard_id; plus those at the wrong depth.

    Raises ManifestError when ``shards_dir`` does not exist or holds no metadata.parquet at all.
    """
    shards_dir = Path(shards_dir)
    if not shards_dir.is_dir():
        raise ManifestError(
            f"SHARDS_DIR {shards_dir} is not a directory: set SHARDS_DIR (or "
            f"--shards-dir) to the folder holding <source>/<lang>/<shard>/"
        )
    shards, misplaced = [], []
    for directory in _directories_holding(shards_dir, METADATA_FILE):
        path = Path(directory)
        rel = path.relative_to(shards_dir)
        if not file_names.is_utf8(path):
            # Its path, shard_id, source and language are text in the manifest and the summary,
            # which hold UTF-8 only.
            misplaced.append(
                file_names.not_utf8(path, "path", "rename the directory in UTF-8 to build its rows")
            )
            continue
        if len(rel.parts) != 3:
            misplaced.append(
                {
                    "path": str(path),
                    "reason": "not at <source>/<lang>/<shard> "
                    f"depth under SHARDS_DIR ({len(rel.parts)} levels deep)",
                }
            )
            continue
        shards.append(Shard(rel.as_posix(), rel.parts[0], rel.parts[1], path))
    misplaced.sort(key=lambda m: m["path"])
    if not shards and not misplaced:
        raise ManifestError(
            f"no shards found under {shards_dir}: expected "
            f"<source>/<lang>/<shard>/{METADATA_FILE} (is SHARDS_DIR right?)"
        )
    return sorted(shards, key=lambda s: s.shard_id), misplaced


def _check_columns(
    path: Path, schema: dict[str, pl.DataType], required: dict[str, str], optional: dict[str, str]
) -> list[str]:
    """The columns to read; raises ManifestError naming a missing column or a wrong type."""
    missing = [c for c in required if c not in schema]
    if missing:
        raise ManifestError(f"{path}: missing column(s) {missing} (has {list(schema)})")
    wanted = {**required, **{c: k for c, k in optional.items() if c in schema}}
    for column, kind in wanted.items():
        dtype = schema[column]
        ok = (
            kind == "any"
            or dtype == pl.Null
            or (kind == "string" and dtype == pl.String)
            or (kind == "numeric" and dtype.is_numeric())
        )
        if not ok:
            raise ManifestError(f"{path}: column {column!r} has type {dtype}, expected {kind}")
    return list(wanted)


def check_shard(shard: Shard) -> tuple[tuple, tuple]:
    """The (metadata, index) columns to read with their types, from the parquet footers.

    Raises ManifestError naming the file and the reason for an unreadable footer, a missing column
    or a wrong type (strings must be strings, duration_s and tx_quality_score numbers).
    """
    signature = []
    for name, required, optional in (
        (METADATA_FILE, REQUIRED_METADATA, OPTIONAL_METADATA),
        (INDEX_FILE, REQUIRED_INDEX, {}),
    ):
        path = shard.path / name
        try:
            schema = dict(pl.read_parquet_schema(path))
        except Exception as exc:  # polars raises several types for unreadable files
            raise ManifestError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
        columns = _check_columns(path, schema, required, optional)
        signature.append(tuple((c, schema[c]) for c in columns))
    return signature[0], signature[1]


MAX_SCAN_SHARDS = 256  # shards per ``read_shards`` call


def _read_files(paths: list[str], columns: list[str]) -> pl.DataFrame:
    """Read same-schema parquet files in one multi-file scan, with a ``path`` column."""
    return _scan(paths).select(*columns, "path").collect()


def _scan(paths: list[str]) -> pl.LazyFrame:
    # glob=False: a shard directory may be named "[x]" or "a*b"
    return pl.scan_parquet(paths, include_file_paths="path", glob=False)


def _read_all_at_once(shards: Sequence[Shard]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The shards' metadata and index, each in one multi-file scan, decoded together, when the
    first shard's columns pass ``_check_columns``. Raises if any file cannot be decoded or differs
    from the first in its columns or their types (polars checks that while scanning)."""
    scans = []
    for name, required, optional in (
        (METADATA_FILE, REQUIRED_METADATA, OPTIONAL_METADATA),
        (INDEX_FILE, REQUIRED_INDEX, {}),
    ):
        paths = [str(s.path / name) for s in shards]
        scan = _scan(paths)
        columns = _check_columns(Path(paths[0]), dict(scan.collect_schema()), required, optional)
        scans.append(scan.select(*columns, "path"))
    meta, index = pl.collect_all(scans)
    return meta, index


def _standard_metadata(frame: pl.DataFrame) -> pl.DataFrame:
    for column in OPTIONAL_METADATA:
        if column not in frame.columns:
            frame = frame.with_columns(pl.lit(None, dtype=pl.String).alias(column))
    return frame.select(
        pl.col("segment_id", "transcription_native", "segment_language", "speaker_id").cast(
            pl.String
        ),
        pl.col("duration_s", "tx_quality_score").cast(pl.Float64),
        pl.col("path"),
    )


def _read_shard_by_shard(
    shards: Sequence[Shard], workers: int
) -> tuple[list[tuple[pl.DataFrame, pl.DataFrame]], list[dict[str, str]]]:
    """(metadata, index) frames of the readable ``shards`` and the unreadable ones with the reason.

    Footers are checked per shard; shards with the same columns and types are scanned together,
    and a scan that fails is retried shard by shard, so a file corrupt past its footer is found.
    """

    def check(shard: Shard):
        try:
            return check_shard(shard)
        except ManifestError as exc:
            return str(exc)

    bad: list[dict[str, str]] = []
    groups: dict[tuple, list[Shard]] = {}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for shard, result in zip(shards, pool.map(check, shards)):
            if isinstance(result, str):
                bad.append({"path": str(shard.path), "reason": result})
            else:
                groups.setdefault(result, []).append(shard)

    def read(group):
        (meta_sig, index_sig), members = group
        meta_cols, index_cols = [c for c, _ in meta_sig], [c for c, _ in index_sig]
        try:
            return [
                (
                    _read_files([str(s.path / METADATA_FILE) for s in members], meta_cols),
                    _read_files([str(s.path / INDEX_FILE) for s in members], index_cols),
                )
            ], []
        except Exception:
            pass  # some file in the group is corrupt past its footer: find it
        parts, failed = [], []
        for shard in members:
            try:
                parts.append(
                    (
                        _read_files([str(shard.path / METADATA_FILE)], meta_cols),
                        _read_files([str(shard.path / INDEX_FILE)], index_cols),
                    )
                )
            except Exception as exc:
                failed.append({"path": str(shard.path), "reason": _unreadable_reason(shard, exc)})
        return parts, failed

    parts = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for group_parts, failed in pool.map(read, groups.items()):
            parts.extend(group_parts)
            bad.extend(failed)
    return parts, bad


def first_invalid_utf8(path: Path) -> tuple[str, int] | None:
    """(column, row counted from 0) of the first string value in the parquet file ``path`` that is
    not valid UTF-8, or None. pyarrow reads string columns without checking them, so the bad value
    can be found (polars refuses the whole file without saying where)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for name in table.column_names:
        column = table.column(name)
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            continue
        start = 0
        for chunk in column.chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid:
                as_bytes = chunk.cast(
                    pa.large_binary() if pa.types.is_large_string(chunk.type) else pa.binary()
                )
                for row, value in enumerate(as_bytes.to_pylist()):
                    try:
                        value is None or value.decode("utf-8")
                    except UnicodeDecodeError:
                        return name, start + row
            start += len(chunk)
    return None


def _unreadable_reason(shard: Shard, exc: Exception) -> str:
    """Why a shard's files could not be read, naming the file; for text that is not UTF-8, the
    column and the first bad row."""
    for name in (METADATA_FILE, INDEX_FILE):
        try:
            found = first_invalid_utf8(shard.path / name)
        except Exception:
            continue  # unreadable to pyarrow too: the polars error below says why
        if found is not None:
            column, row = found
            return (
                f"{shard.path / name}: column {column!r} is not valid UTF-8 at row {row} (counted "
                f"from 0; the first such row): re-encode the shard's text as UTF-8"
            )
    return f"{shard.path}: unreadable ({type(exc).__name__}: {exc})"


def read_shards(
    shards: Sequence[Shard], workers: int
) -> tuple[pl.DataFrame, pl.DataFrame, list[dict[str, str]]]:
    """Metadata and audio index of every readable shard, each row tagged with its shard's position
    in ``shards`` (column ``shard``), and the unreadable shards with path and reason.

    The shards are read in one multi-file scan per file kind (one polars call decodes many small
    files in parallel, where a call per file would cost more in overhead than in decoding) when
    their files all read and share the columns and types of the first; otherwise they go through
    ``_read_shard_by_shard``, which reports each unreadable shard and reads the rest. Callers keep
    to ``MAX_SCAN_SHARDS`` shards a call, so one corrupt file sends only that many down the slow path.
    """
    try:
        parts, bad = [_read_all_at_once(shards)], []
    except Exception:  # polars raises several types; the slow path names each culprit
        parts, bad = _read_shard_by_shard(shards, workers)
    bad.sort(key=lambda b: b["path"])
    if not parts:
        return pl.DataFrame(), pl.DataFrame(), bad

    def tag(frames: list[pl.DataFrame], name: str) -> pl.DataFrame:
        # "path" holds the file each row came from, and each file's rows are contiguous: the
        # rows from where the path changes to the next change take that file's shard position
        frame = pl.concat(frames, how="vertical")
        path = frame.get_column("path")
        starts = (path != path.shift(1)).fill_null(True).arg_true()
        position = {str(s.path / name): i for i, s in enumerate(shards)}
        run_shard = np.array([position[p] for p in path.gather(starts).to_list()], dtype=np.uint32)
        run_length = np.diff(np.append(starts.to_numpy(), frame.height))
        return frame.drop("path").with_columns(pl.Series("shard", np.repeat(run_shard, run_length)))

    return (
        tag([_standard_metadata(meta) for meta, _ in parts], METADATA_FILE),
        tag(
            [
                index.select(pl.col("segment_id", "tar_member_name").cast(pl.String), "path")
                for _, index in parts
            ],
            INDEX_FILE,
        ),
        bad,
    )
