"""Write small shard trees in the layout the offline pipeline reads, for tests and the demo corpus.

    <shards_dir>/<source>/<lang>/<shard_name>/
        metadata.parquet     segment_id, transcription_native, duration_s, tx_quality_score,
                             segment_language, [speaker_id], [any extra column given]
        audio_index.parquet  segment_id, tar_member_name
        audio.tar            one FLAC per indexed row (only with audio=True)

Example:
    from tests.shard_factory import write_shard
    write_shard(tmp_path, "src1", "hi", "shard_0000",
                [{"segment_id": "a", "transcription_native": "नमस्ते", "duration_s": 1.2}],
                audio=True)
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from manifest_schema import INDEX_FILE, METADATA_FILE, TAR_FILE

# Columns of metadata.parquet with their types; a row may leave any of them out (default below).
METADATA_TYPES = {
    "segment_id": pa.string(),
    "transcription_native": pa.string(),
    "duration_s": pa.float64(),
    "tx_quality_score": pa.float64(),
    "segment_language": pa.string(),
}
# Keys of a row dict that steer the factory instead of becoming metadata columns.
_CONTROL_KEYS = {"tar_member_name", "indexed"}


def flac_bytes(
    duration_s: float, sample_rate: int = 16000, channels: int = 1, seed: int = 0
) -> bytes:
    """A FLAC file of quiet noise lasting ``duration_s`` seconds, as bytes."""
    rng = np.random.default_rng(seed)
    frames = max(1, int(round(duration_s * sample_rate)))
    signal = (0.05 * rng.standard_normal((frames, channels))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, signal, sample_rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def add_tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Append one regular file member named ``name`` holding ``data``."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shard(
    shards_dir: str | Path,
    source: str,
    lang: str,
    shard_name: str,
    rows: Iterable[Mapping[str, Any]],
    *,
    audio: bool = False,
    sample_rate: int = 16000,
    extra_index_rows: Iterable[Mapping[str, str]] = (),
    speaker_column: bool | None = None,
) -> Path:
    """Write one shard and return its directory.

    Each row needs ``segment_id``; the others default to a short transcript, 2.0 s, quality 1.0 and
    a null ``segment_language``. ``tar_member_name`` defaults to ``<segment_id>.flac``; a row with
    ``indexed=False`` is left out of audio_index.parquet (and of the tar). Any other key becomes a
    metadata column (``speaker_id`` included). ``extra_index_rows`` adds index entries with no
    metadata. ``audio=True`` writes audio.tar with a FLAC of the row's duration per indexed row.
    """
    shard_dir = Path(shards_dir) / source / lang / shard_name
    shard_dir.mkdir(parents=True, exist_ok=True)
    rows = [dict(r) for r in rows]
    columns: dict[str, list] = {name: [] for name in METADATA_TYPES}
    extra_names = sorted({k for r in rows for k in r} - set(METADATA_TYPES) - _CONTROL_KEYS)
    if speaker_column and "speaker_id" not in extra_names:
        extra_names.append("speaker_id")
    for name in extra_names:
        columns[name] = []
    index: list[tuple[str, str]] = []
    for i, row in enumerate(rows):
        defaults = {
            "transcription_native": f"utterance {i}",
            "duration_s": 2.0,
            "tx_quality_score": 1.0,
            "segment_language": None,
        }
        for name in columns:
            columns[name].append(row.get(name, defaults.get(name)))
        if row.get("indexed", True):
            index.append(
                (row["segment_id"], row.get("tar_member_name", f"{row['segment_id']}.flac"))
            )
    fields = [pa.field(n, METADATA_TYPES.get(n, pa.string())) for n in columns]
    pq.write_table(pa.table(columns, schema=pa.schema(fields)), shard_dir / METADATA_FILE)
    index += [(r["segment_id"], r["tar_member_name"]) for r in extra_index_rows]
    pq.write_table(
        pa.table(
            {
                "segment_id": pa.array([s for s, _ in index], pa.string()),
                "tar_member_name": pa.array([m for _, m in index], pa.string()),
            }
        ),
        shard_dir / INDEX_FILE,
    )
    if audio:
        durations = {r["segment_id"]: r.get("duration_s", 2.0) for r in rows}
        with tarfile.open(shard_dir / TAR_FILE, "w") as tar:
            for seed, (segment_id, member) in enumerate(index):
                duration = durations.get(segment_id) or 1.0
                add_tar_member(tar, member, flac_bytes(min(duration, 30.0), sample_rate, seed=seed))
    return shard_dir
