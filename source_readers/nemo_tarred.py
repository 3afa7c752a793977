"""Tarred NeMo manifests: the rows of the JSON manifest matched to the members of its tars, each
tar written out once as FLAC."""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import numpy as np
import polars as pl

from manifest_schema import ManifestError
from source_readers.nemo_json import _nemo_fields, _read_json_rows
from source_readers.standard_rows import (
    ROW_SCHEMA,
    RowIds,
    Shard,
    SourceRows,
    SourceSpec,
    _audio_bytes_to_flac,
    _bad,
    _file_name,
    _in_processes,
    _mark_done,
    _mismatch,
    _standard_rows,
    _unit_done,
    origin_order,
)

_BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}|_OP_(\d+)\.\.(\d+)_CL_")


def expand_tar_pattern(pattern: str) -> list[str]:
    """NeMo's tar list: ``audio_{0..3}.tar`` or ``audio__OP_0..3_CL_.tar`` -> ``audio_0.tar`` ...
    (the list's position is NeMo's ``shard_id``); a pattern without a range is one file."""
    match = _BRACES.search(pattern)
    if not match:
        return [pattern]
    lo, hi = (int(g) for g in match.groups() if g is not None)
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [p for k in range(lo, hi + 1) for p in expand_tar_pattern(f"{head}{k}{tail}")]


def read_nemo_tarred(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> SourceRows:
    """A tarred NeMo manifest (``tars`` names its tar files): the audio paths are member names of
    the tars (the row's ``shard_id`` field, when present, names its tar), written out once as
    FLAC; the rows come as one batch."""
    frame, bad = _read_json_rows(spec.path)
    if not frame.height and not bad:
        raise ManifestError(f"{spec.path}: no rows")
    frame, fields = _nemo_fields(spec, frame, bad, first=True, ids=RowIds(spec.name))
    return _nemo_tarred(spec, frame, out_dir, bad, workers, progress, fields)


def _unpack_tar(task: tuple[str, str]) -> dict:
    """Write a tar's audio members as FLAC into ``folder`` (each verified by decoding) as
    ``<_file_name(member)>.flac``, then the done marker: ``{"members": {member: [file, seconds]},
    "bad": {member: reason}}``."""
    tar_path, folder = task
    folder_path = Path(folder)
    done = _unit_done(folder_path)
    if done is not None and len({f for f, _ in done["members"].values()}) == len(done["members"]):
        return done  # (a marker whose members share a file was written flattening their names)
    folder_path.mkdir(parents=True, exist_ok=True)
    members, bad = {}, {}
    try:
        with tarfile.open(tar_path, "r:*") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                data = tar.extractfile(info).read()
                # the whole member name, extension and folders included: one file per member
                out = f"{_file_name(info.name)}.flac"
                try:
                    members[info.name] = [out, _audio_bytes_to_flac(data, folder_path / out)]
                except ValueError as exc:
                    bad[info.name] = str(exc)
    except (OSError, tarfile.TarError) as exc:
        return {"error": f"{tar_path}: unreadable tar ({exc})"}
    record = {"tar": tar_path, "members": members, "bad": bad}
    _mark_done(folder_path, record)
    return record


def _nemo_tarred(
    spec: SourceSpec,
    frame: pl.DataFrame,
    out_dir: Path,
    bad: list,
    workers: int,
    progress: bool,
    fields: dict,
) -> SourceRows:
    """``read_nemo_tarred``'s work: the tars written out as FLAC, rows matched to them."""
    quality = fields["quality"]
    path = spec.path
    tars = expand_tar_pattern(spec.options["tars"])
    missing = [t for t in tars if not os.path.isfile(t)]
    bad_files = [{"path": t, "reason": "tar file not found"} for t in missing]
    folders = [str(out_dir / f"{k:05d}_{Path(t).name.split('.')[0]}") for k, t in enumerate(tars)]
    tasks = [(t, f) for t, f in zip(tars, folders) if t not in missing]
    records: dict[int, dict] = {}
    position = {t: k for k, t in enumerate(tars)}
    from tqdm import tqdm

    with tqdm(
        total=len(tasks), desc=f"writing {spec.name} as FLAC", unit="tar", disable=not progress
    ) as bar:
        for (tar, _), record in zip(tasks, _in_processes(_unpack_tar, tasks, workers)):
            if "error" in record:
                bad_files.append({"path": tar, "reason": record["error"]})
            else:
                records[position[tar]] = record
            bar.update(1)
    # member -> (tar position, file, seconds) of every tar; a row with NeMo's shard_id looks only there
    found = pl.DataFrame(
        [
            (k, member, file, seconds)
            for k, record in records.items()
            for member, (file, seconds) in record["members"].items()
        ],
        schema={"tar": pl.UInt32, "member": pl.String, "file": pl.String, "seconds": pl.Float64},
        orient="row",
    ).unique("member", keep="first", maintain_order=True)
    undecodable = {m for record in records.values() for m in record["bad"]}
    frame = frame.with_columns(pl.col("_audio").str.strip_prefix("./").alias("_member"))
    frame = frame.join(
        found, left_on="_member", right_on="member", how="left", maintain_order="left"
    )
    if "shard_id" in frame.columns:
        wanted = pl.col("shard_id").cast(pl.UInt32, strict=False)
        wrong = wanted.is_not_null() & pl.col("tar").is_not_null() & (wanted != pl.col("tar"))
        frame = frame.with_columns(pl.when(wrong).then(None).otherwise(pl.col("tar")).alias("tar"))
    keep = np.ones(frame.height, bool)
    langs = frame.get_column("_lang")
    for i, (number, member, tar, seconds, given) in enumerate(
        frame.select("line", "_member", "tar", "seconds", "_duration").iter_rows()
    ):
        origin = f"{path}:{number}"
        if tar is None:
            reason = "audio_unreadable" if member in undecodable else "audio_not_found"
            bad.append(_bad(origin, reason, f"{member} in {spec.options['tars']}", langs[i]))
            keep[i] = False
        elif given is not None and _mismatch(given, seconds):
            detail = f"{member}: duration {given:g} s, the audio holds {seconds:.3f} s"
            bad.append(_bad(origin, "duration_mismatch", detail, langs[i]))
            keep[i] = False
    frame = frame.filter(pl.Series(keep))
    shards = [
        Shard(
            f"{spec.name}/{Path(folders[k]).name}",
            spec.name,
            "",
            Path(folders[k]),
            quality is not None,
        )
        for k in range(len(tars))
    ]
    rows = _standard_rows(frame, fields["speaker"], quality).with_columns(
        frame["tar"].alias("shard"),
        pl.coalesce(frame["_duration"], frame["seconds"]).alias("duration_s"),
        frame["file"].alias("tar_member_name"),
    )
    bad.sort(key=lambda b: origin_order(b["origin"]))
    return SourceRows(rows.select(list(ROW_SCHEMA)), shards, bad, bad_files)
