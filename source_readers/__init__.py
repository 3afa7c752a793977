"""Readers of the data build_manifest.py imports besides the in-house shards: NeMo JSON manifests
(plain, and tarred), Hugging Face audio parquet, Kaldi data directories and Common Voice releases.

A source is named as ``KIND:PATH`` with options after a second colon, comma-separated:

    nemo:/data/cv_hi/train.json                      audio files on disk, paths as NeMo reads them
    nemo:/data/tarred/tarred_audio_manifest.json:tars=/data/tarred/audio_{0..127}.tar
    hf:/data/fleurs_hi:lang=hi                       a folder (or one file) of parquet files
    kaldi:/data/kaldi/train:name=mucs_te,lang=te     wav.scp, text, [segments, utt2spk, utt2lang]
    cv:/data/cv-corpus-17.0/hi:min_up_votes=3        a Common Voice language folder, or one TSV

Options: ``name`` (the ``source`` column and the group ids; default the file or folder name),
``lang`` (the language of every row), ``lang_field``, ``text_field``, ``speaker_field``,
``duration_field``, ``quality_field``, ``id_field``, ``audio_field`` (the field to read instead of
the first of ``FIELDS``), ``tars`` (NeMo's ``{a..b}`` or ``_OP_a..b_CL_`` pattern of a tarred
manifest's tar files), ``check`` (``header``, the default, ``exists`` or ``none``: see below),
``split`` (``train``, ``dev`` or ``test``: the source's own split of every row, kept in the master's
``split`` column for make_train_val.py; one source per split. A Common Voice folder takes none:
each of its rows keeps its TSV's).

Per row: the segment_id is ``<name>/<own id>``, or ``<name>:<place>`` without one (``RowIds``);
the language comes from the ``lang`` option, else the row's field, else the transcript's
writing system (``script_languages``); the duration from the field, else the audio header; the
speaker from the field (for the leak-free split); the quality score from ``quality_field`` or a
``tx_quality_score`` field (MIN_QUALITY applies only to sources with a score).

Audio: a plain NeMo manifest's and an unsegmented Kaldi directory's files are used where they are.
With ``check=header`` (default) every file's header is read, in parallel: a file that does not
exist, does not decode, or whose duration differs from the row's by more than
``DURATION_TOLERANCE`` is a bad row. ``check=exists`` only looks for the file when the row gives its
duration (for millions of rows whose durations are trusted); ``check=none`` trusts such rows
entirely, as the shard build trusts audio_index.parquet (a missing file is then found only when
training loads it, and counted as bad audio there). Tar shards, HF parquet files and
Kaldi recordings with ``segments`` (and NeMo rows with an ``offset``, segments of their file) are
written out once as FLAC under ``<audio dir>/<name>/``,
each unit (tar, parquet file, recording) verified and then marked done, so a rerun skips it.

Text files are UTF-8, a byte-order mark read through (``manifest_schema.text_start``); one in
UTF-16 or UTF-32 is a ManifestError naming it.

A bad row is dropped and counted under its reason (``BAD_ROW_REASONS``) with its file and line
(1-based) or row (0-based, parquet); build_manifest.py's ``--strict`` makes the first one an error.
A file that cannot be used at all (an unreadable parquet file, one without an audio column, a
missing tar) is reported with its path and skipped.

Layout: one module per kind of source (``nemo_json``, ``nemo_tarred``, ``hf_parquet``,
``kaldi``, ``common_voice``), each with a ``read_*`` function, and ``standard_rows`` for what
they share (the spec, the rows a reader gives, the audio checks, the FLAC writing). A new kind
is a module of its own plus its entry in ``READERS`` below. The in-house shards, which
build_manifest.py reads in batches of many shards rather than row by row, have
``in_house_shards`` (``discover_shards``, ``read_shards``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import polars as pl

from manifest_schema import SOURCE_SPLITS, SPLIT_COLUMN, ManifestError
from source_readers.common_voice import OPTIONS as CV_OPTIONS
from source_readers.common_voice import read_common_voice
from source_readers.hf_parquet import read_hf_parquet
from source_readers.kaldi import read_kaldi
from source_readers.nemo_json import read_nemo_json
from source_readers.nemo_tarred import expand_tar_pattern, read_nemo_tarred
from source_readers.standard_rows import (
    BAD_ROW_REASONS,
    DONE_MARKER,
    DURATION_TOLERANCE,
    FIELDS,
    MAX_EXAMPLES,
    OPTIONS,
    ROW_SCHEMA,
    RowIds,
    Shard,
    SourceRows,
    SourceSpec,
    _fill_languages,
    origin_order,
)

__all__ = [
    "BAD_ROW_REASONS",
    "DONE_MARKER",
    "DURATION_TOLERANCE",
    "FIELDS",
    "KINDS",
    "MAX_EXAMPLES",
    "OPTIONS",
    "KIND_OPTIONS",
    "READERS",
    "ROW_SCHEMA",
    "RowIds",
    "Shard",
    "SourceRows",
    "SourceSpec",
    "expand_tar_pattern",
    "origin_order",
    "parse_source",
    "read_hf_parquet",
    "read_common_voice",
    "read_kaldi",
    "read_nemo",
    "read_source",
]


def parse_source(text: str) -> SourceSpec:
    """``KIND:PATH[:OPTION=VALUE,...]`` as a SourceSpec; ManifestError naming what is wrong."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in KINDS:
        raise ManifestError(
            f"source {text!r}: expected KIND:PATH[:option=value,...] with KIND one of "
            f"{', '.join(KINDS)} (e.g. nemo:/data/train.json:lang=hi)"
        )
    path, options = rest, {}
    head, sep, tail = rest.rpartition(":")
    if sep and "=" in tail and head:
        path = head
        for item in tail.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            allowed = OPTIONS | KIND_OPTIONS.get(kind, frozenset())
            if not eq or key not in allowed:
                raise ManifestError(
                    f"source {text!r}: unknown option {item!r}; options are "
                    f"{', '.join(sorted(allowed))}"
                )
            options[key] = value.strip()
    if options.get("check", "header") not in ("header", "exists", "none"):
        raise ManifestError(f"source {text!r}: check must be header, exists or none")
    if kind == "shards" and options:
        raise ManifestError(f"source {text!r}: shards take no options")
    if options.get("split", "train") not in SOURCE_SPLITS:
        raise ManifestError(
            f"source {text!r}: split={options['split']} is not one of {', '.join(SOURCE_SPLITS)}"
        )
    spec = SourceSpec(kind, Path(path), options)
    if not spec.path.exists():
        raise ManifestError(f"source {text!r}: {spec.path} does not exist")
    if kind == "cv" and "split" in options and spec.path.is_dir():
        raise ManifestError(
            f"source {text!r}: a Common Voice folder keeps each TSV's own split; drop split= or "
            f"point cv: at one TSV"
        )
    if kind != "shards" and (not spec.name or "/" in spec.name or ":" in spec.name):
        raise ManifestError(
            f"source {text!r}: its name {spec.name!r} must be non-empty without '/' or ':' (it "
            f"begins every segment_id of the source): give it one with name=..."
        )
    return spec


def read_source(
    spec: SourceSpec,
    audio_dir: Path,
    *,
    workers: int,
    strict: bool = False,
    progress: bool = True,
) -> Iterator[SourceRows]:
    """The rows of an imported source (any kind but ``shards``) in batches, languages filled in;
    FLAC written under ``audio_dir/<name>/`` where the source's audio has to be written out. A
    plain NeMo manifest comes in batches of about ``_CHUNK_BYTES`` of its file, so memory stays
    flat in its length; the other kinds in one. With ``strict``, the first bad row raises
    ManifestError naming it."""
    reader = READERS[spec.kind]
    batches = reader(spec, Path(audio_dir) / spec.name, workers=max(1, workers), progress=progress)
    for result in [batches] if isinstance(batches, SourceRows) else batches:
        if strict and result.bad:
            first = result.bad[0]
            raise ManifestError(
                f"{first['origin']}: {first['reason']} ({first['detail']}); --strict stops at the "
                f"first bad row of {spec}"
            )
        if strict and result.bad_files:
            first = result.bad_files[0]
            raise ManifestError(f"{first['path']}: {first['reason']} (--strict)")
        result.rows = _fill_languages(result.rows, result.shards)
        if "split" in spec.options:
            result.rows = result.rows.with_columns(
                pl.lit(spec.options["split"], dtype=pl.String).alias(SPLIT_COLUMN)
            )
        yield result


def read_nemo(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> SourceRows | Iterator[SourceRows]:
    """A NeMo JSON manifest, tarred when the spec names its ``tars`` (``nemo_tarred``), else with
    its audio files on disk (``nemo_json``)."""
    read = read_nemo_tarred if "tars" in spec.options else read_nemo_json
    return read(spec, out_dir, workers=workers, progress=progress)


# The reader of each kind: (spec, out_dir, *, workers, progress) -> SourceRows or batches of them.
READERS: dict[str, Callable[..., SourceRows | Iterator[SourceRows]]] = {
    "nemo": read_nemo,
    "hf": read_hf_parquet,
    "kaldi": read_kaldi,
    "cv": read_common_voice,
}
KINDS = ("shards", *READERS)
# Options only a kind takes, besides ``OPTIONS``.
KIND_OPTIONS = {"cv": CV_OPTIONS}
