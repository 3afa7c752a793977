"""Build the master manifest: join each shard's metadata with its audio index, filter, clean, tag.

Usage:
    python build_manifest.py --help
    python build_manifest.py                  # SHARDS_DIR -> MASTER_MANIFEST_PATH (see config.py)
    SHARDS_DIR=/nvme/shards MIN_QUALITY=0.5 python build_manifest.py --output /nvme/master.parquet
    python build_manifest.py --strict         # exit non-zero if any shard cannot be read

Input: ``<SHARDS_DIR>/<source>/<lang>/<shard>/{metadata,audio_index}.parquet``. Output: one parquet
with ``segment_id, shard_id, text, duration, lang, audio_filepath, source`` (then
``tx_quality_score, speaker_id``, and ``split`` when a source has splits of its own, such as
Common Voice's train, dev and test; null for the other rows): the shards' rows sorted by
``(shard_id, segment_id)``, then each imported source's (``--source``, see source_readers/) in its
own order, so that a rerun writes the same rows in the same order, plus
``<output minus .parquet>.summary.json`` with rows read, kept and dropped per reason and per
language, and every shard that could not be read; per imported source, every row it lost (bad in
the reader, or dropped by a check below) per reason, the first of each
with its file and line, and the rows its own options left out (``left_out``, per option).

A row is kept when, checked in this order (the first failing check names the drop reason):
    no_audio_index          its segment_id has an audio_index entry (the join is on segment_id)
    invalid_language        its language code is a plain code such as ``hi`` or ``en-in``
    language_not_selected   LANGUAGES is empty or holds its language
    duration_missing / duration_too_short / duration_too_long
                            MIN_DURATION <= duration_s <= MAX_DURATION
    quality_missing / quality_not_finite / quality_below_min
                            tx_quality_score is a finite number >= MIN_QUALITY (null, NaN and
                            +-inf are not a pass)
    transcript_missing / empty_after_cleaning
                            the transcript is non-empty after ``clean_text``
    shared_audio_other_text no kept row of another segment_id in its shard names the same audio
                            file with a different cleaned transcript (one of them is wrong, and
                            nothing says which: every row of that file is dropped)
``lang`` is ``segment_language`` (stripped, lower-cased) when set, else the ``<lang>`` directory.

Reported, not dropped (the summary's ``duplicate_segment_ids`` and ``shared_audio``, with their
shards): a segment_id kept in several rows (in one shard or several; make_train_val.py keeps one),
and an audio file several segment_ids name with the same transcript.

A build that keeps no row, or an imported source none of whose rows can be used, is a
ManifestError with the reasons (and, for audio not found, the folder relative paths resolve
against): no master is written.

Before any shard is read, the output directory must take a file, and a warning says when its file
system has less free space than the shards' metadata and index files take (the master holds about
as much). The master and its summary are written as one set (``atomic_files.write_together``): a
failed or killed write leaves the previous pair, or the new master without a summary, never a
master beside another run's summary. A write error names the file and says "disk full" when it is.

Engine: polars, for every step. Shards go through in batches of about 128k rows: while one batch
is filtered and cleaned, the next is read and joined on a background thread (see
``joined_batches``). A batch is decoded in multi-file scans (a call per small file costs more in
overhead than in decoding); one whose files do not all read alike is checked shard by shard, so a
corrupt file is reported with its reason and skipped. The join (on a verified hash of shard and
segment_id), the filters and the sort are multi-threaded; the cleaning runs as Rust-regex passes
over chunks of the column on a thread pool (polars releases the GIL), and a row takes only the
passes that can change it: one check sends most rows through the single tags/punctuation/space
pass. pyarrow.compute has regex and normalization kernels but runs them single-threaded and has no
multi-threaded join; DuckDB would add a second regex dialect and dataframe library to the project.
Rust regex has no look-around, which is why in-word apostrophes travel through the multi-pass
path's punctuation pass as a placeholder character, and why the single-pass path finds the
apostrophes outside words only after that pass (see ``_APOSTROPHES_OUTSIDE_WORDS``).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from tqdm import tqdm

import config
from atomic_files import (
    SET_SUFFIX,
    check_writable,
    disk_full,
    remove_stale_temporaries,
    write_together,
)
from manifest_schema import (
    INDEX_FILE,
    LANG_CODE_PATTERN,
    METADATA_FILE,
    ManifestError,
    check_language_selection,
    counts_by,
    json_text,
    summary_path,
    tagged_text_expr,
    write_manifest_file,
)
from source_readers import (
    BAD_ROW_REASONS,
    Shard,
    SourceSpec,
    origin_order,
    parse_source,
    read_source,
)
from source_readers import MAX_EXAMPLES as MAX_BAD_ROWS
from source_readers.in_house_shards import MAX_SCAN_SHARDS, discover_shards, read_shards
from transcript_cleaning import WARM_UP_TEXTS, clean_text_column
from transcript_style import STYLE_KEY, base_mismatch, resolve_style


# --- build -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Filters:
    languages: tuple[str, ...]
    min_duration: float
    max_duration: float
    min_quality: float
    style: str = "plain"  # transcript_cleaning.STYLES: how the kept transcripts are cleaned


# The drop reasons in the order of the module doc. An Enum column of them costs a byte a row where
# a string column would cost sixteen and a copy of the name per row.
DROP_REASON = pl.Enum(
    [
        "no_audio_index",
        "language_unknown",
        "invalid_language",
        "language_not_selected",
        "duration_missing",
        "duration_too_short",
        "duration_too_long",
        "quality_missing",
        "quality_not_finite",
        "quality_below_min",
        "transcript_missing",
        "empty_after_cleaning",
        "shared_audio_other_text",
        *(r for r in BAD_ROW_REASONS if r != "transcript_missing"),
    ]
)


def _drop_reason(filters: Filters) -> pl.Expr:
    """The first failing check of a row (null when it passes) as a ``DROP_REASON``, in the order of
    the module doc; ``empty_after_cleaning`` is decided after cleaning, which only the passing rows
    get. Reads the columns ``lang`` and ``lang_ok`` (see ``row_languages``)."""

    def reason(name: str) -> pl.Expr:
        return pl.lit(name, dtype=DROP_REASON)

    duration, quality = pl.col("duration_s"), pl.col("tx_quality_score")
    drop = pl.when(pl.col("tar_member_name").is_null()).then(reason("no_audio_index"))
    drop = drop.when(pl.col("lang") == "").then(reason("language_unknown"))
    drop = drop.when(~pl.col("lang_ok")).then(reason("invalid_language"))
    if filters.languages:
        drop = drop.when(~pl.col("lang").is_in(list(filters.languages))).then(
            reason("language_not_selected")
        )
    return (
        drop.when(duration.is_null() | duration.is_nan())
        .then(reason("duration_missing"))
        .when(duration < filters.min_duration)
        .then(reason("duration_too_short"))
        .when(duration > filters.max_duration)
        .then(reason("duration_too_long"))
        .when((quality.is_null() & pl.col("scored")) | quality.is_nan())
        .then(reason("quality_missing"))
        .when(quality.is_infinite())
        .then(reason("quality_not_finite"))
        .when(quality < filters.min_quality)
        .then(reason("quality_below_min"))
        .when(pl.col("transcription_native").is_null())
        .then(reason("transcript_missing"))
        .otherwise(pl.lit(None, dtype=DROP_REASON))
    )


def join_shards(
    shards: Sequence[Shard], meta: pl.DataFrame, index: pl.DataFrame
) -> tuple[pl.DataFrame, int]:
    """Metadata left-joined with the audio index on (shard, segment_id).

    Returns the frame (``tar_member_name`` null where the index has no entry; ``shard`` is the
    position in ``shards``; metadata order kept) and the count of index entries without metadata.
    """
    keys = ["shard", "segment_id"]
    index = index.filter(pl.col("tar_member_name").is_not_null()).with_row_index("index_row")
    # Joining on one 64-bit hash of the two keys costs half as much as joining on the keys. Every
    # pair it makes is checked against the keys; if a hash collision paired different keys, or a
    # segment_id is listed twice in an index, the exact join runs instead. A null segment_id
    # matches nothing, as in the exact join. Only the keys go through the join, so the metadata's
    # other columns are not copied.
    key = pl.when(pl.col("segment_id").is_not_null()).then(pl.struct(keys).hash()).alias("key")
    matched = meta.select(key, *keys).join(
        index.select(key, *keys, "tar_member_name", "index_row"),
        on="key",
        how="left",
        maintain_order="left",
    )
    other_key = (pl.col("segment_id") != pl.col("segment_id_right")) | (
        pl.col("shard") != pl.col("shard_right")
    )
    if matched.height != meta.height or matched.select(other_key.any()).item():
        matched = meta.select(keys).join(index, on=keys, how="left", maintain_order="left")
    # an index entry is an orphan when no metadata row matched it
    orphans = index.height - matched.get_column("index_row").drop_nulls().n_unique()
    if matched.height == meta.height:  # each metadata row matched at most once: rows line up
        return meta.with_columns(matched.get_column("tar_member_name")), orphans
    # left order kept, so rows equal in every sort key come out in the same order on a rerun
    return meta.join(index.drop("index_row"), on=keys, how="left", maintain_order="left"), orphans


def joined_batches(
    shards: Sequence[Shard],
    workers: int,
    first: int = 32,
    rows: int = 131_072,
    meanwhile: Callable[[], Any] | None = None,
) -> Iterator[tuple[Sequence[Shard], pl.DataFrame | None, int, list[dict[str, str]]]]:
    """Consecutive batches of ``shards``, each read and joined: ``(batch, joined or None when
    nothing in it could be read, orphan index entries, unreadable shards)``, shard positions in
    ``joined`` counted within the batch.

    A batch is read and joined on a background thread while the caller works on the one before,
    so the single-threaded stretches of either side overlap with the other's parallel work, and
    each batch reuses memory the one before it freed (fresh memory costs a page fault per page).
    The first batch holds ``first`` shards; later ones as many as make about ``rows`` rows at the
    rows per shard seen so far (at least 8, and at most ``MAX_SCAN_SHARDS``, like the first).
    ``meanwhile`` is called on the caller's thread while the first batch loads.
    """
    seen = {"rows": 0, "shards": 0}

    def load(start: int):
        if seen["shards"]:
            size = max(8, round(rows * seen["shards"] / max(seen["rows"], 1)))
        else:
            size = first
        batch = shards[start : start + min(MAX_SCAN_SHARDS, size)]
        meta, index, unreadable = read_shards(batch, workers)
        seen["rows"] += meta.height
        seen["shards"] += len(batch)
        if not meta.width:  # no shard in the batch could be read
            return batch, None, 0, unreadable
        joined, orphans = join_shards(batch, meta, index)
        return batch, joined, orphans, unreadable

    with ThreadPoolExecutor(max_workers=1) as reader:
        start, pending = 0, (reader.submit(load, 0) if shards else None)
        if meanwhile is not None:
            meanwhile()
        while pending is not None:
            result = pending.result()
            start += len(result[0])
            pending = reader.submit(load, start) if start < len(shards) else None
            yield result


def clean_in_parallel(texts: pl.Series, workers: int, style: str = "plain") -> pl.Series:
    """``clean_text_column`` in ``style`` over chunks of ``texts`` on a thread pool, in order.

    Up to two chunks per worker of at least 30k rows (each chunk costs a few milliseconds of
    fixed work); they shrink towards the end (sizes in proportion to 2, 2, 1, 1 for two workers),
    so that the last one to finish leaves the other workers idle only briefly.
    """
    n_chunks = max(1, min(2 * workers, texts.len() // 30_000))
    weights = -(-np.arange(n_chunks, 0, -1) // workers)  # ceil((n_chunks - i) / workers)
    bounds = np.concatenate([[0], np.cumsum(weights)]) * texts.len() // weights.sum()
    chunks = [texts.slice(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        cleaned = list(pool.map(functools.partial(clean_text_column, style=style), chunks))
    return pl.concat(cleaned) if cleaned else texts.clear()


def row_languages(joined: pl.DataFrame, shards: Sequence[Shard]) -> tuple[pl.Series, pl.Series]:
    """(``lang``, ``lang_ok``) per row: ``segment_language`` stripped and lower-cased where it is set
    and not blank, else the shard's ``<lang>`` directory; and whether that is a plain language code.

    Most rows carry no ``segment_language``: they take their shard's value by position (a gather of
    a few shard-level values), and only the rows that carry one go through the string work.
    """
    dir_lang = pl.Series([s.lang for s in shards], dtype=pl.String)
    shard = joined.get_column("shard")
    lang = dir_lang.gather(shard)
    lang_ok = dir_lang.str.contains(LANG_CODE_PATTERN).gather(shard)
    segment_language = joined.get_column("segment_language")
    own_rows = segment_language.is_not_null().arg_true()
    if own_rows.len():
        own = segment_language.gather(own_rows).str.strip_chars().str.to_lowercase()
        set_rows = own != ""
        own_rows, own = own_rows.filter(set_rows), own.filter(set_rows)
        lang = lang.scatter(own_rows, own)
        lang_ok = lang_ok.scatter(own_rows, own.str.contains(LANG_CODE_PATTERN))
    return lang.alias("lang"), lang_ok.alias("lang_ok")


def _is_sorted(frame: pl.DataFrame, columns: list[str]) -> bool:
    """Whether the rows are in ascending order of ``columns`` (compared in turn; no nulls in them)."""
    in_order = pl.lit(True)
    for column in reversed(columns):  # each column decides where the ones before it are equal
        value, previous = pl.col(column), pl.col(column).shift(1)
        in_order = (value > previous) | ((value == previous) & in_order)
    return frame.select(in_order.fill_null(True).all()).item()


_DETAIL_COLUMNS = ["duration_s", "tx_quality_score", "transcription_native", "tar_member_name"]


def _drop_detail(filters: Filters) -> pl.Expr:
    """What made a dropped row fail its check (``reason``), in words, for the summary's examples;
    reads ``reason``, ``lang`` and ``_DETAIL_COLUMNS``."""
    reason, duration = pl.col("reason"), pl.col("duration_s").round(3)
    text = pl.col("transcription_native").str.slice(0, 60)
    detail = pl.when(reason == "language_unknown").then(
        pl.lit("no language given, and the transcript's script names none")
    )
    for name, words in (
        ("invalid_language", pl.format("language '{}' is not a code like hi or en-in", "lang")),
        ("language_not_selected", pl.format("language {} is not in LANGUAGES", "lang")),
        ("duration_missing", pl.lit("no duration")),
        (
            "duration_too_short",
            pl.format("{} s, below MIN_DURATION={} s", duration, pl.lit(filters.min_duration)),
        ),
        (
            "duration_too_long",
            pl.format("{} s, above MAX_DURATION={} s", duration, pl.lit(filters.max_duration)),
        ),
        ("quality_missing", pl.lit("no tx_quality_score")),
        ("quality_not_finite", pl.format("tx_quality_score {}", "tx_quality_score")),
        (
            "quality_below_min",
            pl.format(
                "tx_quality_score {}, below MIN_QUALITY={}",
                pl.col("tx_quality_score").round(3),
                pl.lit(filters.min_quality),
            ),
        ),
        ("transcript_missing", pl.lit("no transcript")),
        ("empty_after_cleaning", pl.format("transcript '{}' has no words left", text)),
        (
            "shared_audio_other_text",
            pl.format(
                "its audio {} is another row's too, with another transcript", "tar_member_name"
            ),
        ),
    ):
        detail = detail.when(reason == name).then(words)
    return detail.otherwise(pl.lit(""))


def assemble_manifest(
    joined: pl.DataFrame, shards: Sequence[Shard], filters: Filters, workers: int = 1
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(manifest rows sorted by shard_id and segment_id, one (lang, reason) row per dropped row,
    the audio files several kept segment_ids name: ``shard_id, tar_member_name, segment_ids,
    texts_differ``; those whose transcripts differ were dropped as ``shared_audio_other_text``).
    Rows with an ``origin`` (an imported source's) keep it in their drop row, with a ``detail``.
    """

    def per_shard(values: list[str]) -> pl.Expr:  # a shard's constant, looked up by position
        return pl.lit(pl.Series(values, dtype=pl.String)).gather(pl.col("shard"))

    lang, lang_ok = row_languages(joined, shards)
    scored = pl.Series([s.scored for s in shards], dtype=pl.Boolean).gather(joined["shard"])
    frame = joined.with_columns(lang, lang_ok, scored.alias("scored"))
    frame = frame.with_columns(_drop_reason(filters).alias("reason"))
    traced = "origin" in joined.columns
    # columns are chosen before rows: a filter copies every column it is given
    candidates = (
        frame.select(
            *(["origin"] if traced else []),
            "shard",
            "segment_id",
            "transcription_native",
            "duration_s",
            "lang",
            "tar_member_name",
            "tx_quality_score",
            "speaker_id",
            *(["split"] if "split" in joined.columns else []),
            "reason",
        )
        .filter(pl.col("reason").is_null())
        .drop("reason")
    )
    order = ["shard", "segment_id", "tar_member_name"]
    if not _is_sorted(candidates, order):  # shards often list their segments in order already
        candidates = candidates.sort(order, maintain_order=True)
    candidates = candidates.with_columns(
        clean_in_parallel(
            candidates.get_column("transcription_native"), workers, filters.style
        ).alias("cleaned")
    )
    candidates = candidates.with_columns(
        pl.when(pl.col("cleaned") == "")
        .then(pl.lit("empty_after_cleaning", DROP_REASON))
        .otherwise(pl.lit(None, DROP_REASON))
        .alias("reason")
    )
    candidates, shared = _shared_audio(candidates, shards)
    needed, drop_columns = ["lang", "reason"], ["lang", "reason"]
    if traced:  # columns are chosen before rows here too
        needed += ["origin", *_DETAIL_COLUMNS]
        drop_columns += ["origin", _drop_detail(filters).alias("detail")]
    drops = pl.concat(
        [
            part.select(needed).filter(pl.col("reason").is_not_null()).select(drop_columns)
            for part in (frame, candidates)
        ]
    )
    kept = candidates.filter(pl.col("reason").is_null()).select(
        pl.col("segment_id"),
        per_shard([s.shard_id for s in shards]).alias("shard_id"),
        tagged_text_expr("cleaned").alias("text"),
        pl.col("duration_s").alias("duration"),
        pl.col("lang"),
        pl.concat_str(
            per_shard([s.audio_dir + "/" for s in shards]), pl.col("tar_member_name")
        ).alias("audio_filepath"),
        per_shard([s.source for s in shards]).alias("source"),
        pl.col("tx_quality_score"),
        pl.col("speaker_id"),
        *([pl.col("split")] if "split" in candidates.columns else []),
    )
    return kept, drops, shared


def _shared_audio(
    candidates: pl.DataFrame, shards: Sequence[Shard]
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``candidates`` with ``reason`` set to ``shared_audio_other_text`` on every row of an audio
    file that kept rows name with different cleaned transcripts; and the files named by several
    rows (see ``assemble_manifest``). Rows are found through a 64-bit hash of (shard, member), then
    grouped on the exact keys, so a hash collision only costs a look."""
    keys = ["shard", "tar_member_name"]
    alive = pl.col("reason").is_null()
    maybe = candidates.select(alive & pl.struct(keys).hash().is_duplicated()).to_series()
    if not maybe.any():
        return candidates, SHARED_AUDIO_EMPTY
    groups = (
        candidates.filter(maybe)
        .group_by(keys, maintain_order=True)
        .agg(
            pl.col("segment_id").unique(maintain_order=True),
            pl.len().alias("rows"),
            (pl.col("cleaned").n_unique() > 1).alias("texts_differ"),
        )
        .filter(pl.col("segment_id").list.len() > 1)  # one id listed twice is make_train_val's
    )
    conflicting = groups.filter("texts_differ").select(keys).with_columns(conflict=pl.lit(True))
    if conflicting.height:
        flag = candidates.select(keys).join(conflicting, on=keys, how="left", maintain_order="left")
        candidates = candidates.with_columns(
            pl.when(alive & flag.get_column("conflict").fill_null(False))
            .then(pl.lit("shared_audio_other_text", DROP_REASON))
            .otherwise(pl.col("reason"))
            .alias("reason")
        )
    shard_ids = pl.Series([s.shard_id for s in shards], dtype=pl.String)
    shared = groups.select(
        pl.lit(shard_ids).gather(pl.col("shard")).alias("shard_id"),
        "tar_member_name",
        pl.col("segment_id").alias("segment_ids"),
        "rows",
        "texts_differ",
    )
    return candidates, shared


SHARED_AUDIO_EMPTY = pl.DataFrame(
    schema={
        "shard_id": pl.String,
        "tar_member_name": pl.String,
        "segment_ids": pl.List(pl.String),
        "rows": pl.UInt32,
        "texts_differ": pl.Boolean,
    }
)
MAX_EXAMPLES = 20  # listed per kind of duplicate in the summary; the rest is counted
UNKNOWN_LANG = "?"  # the summary's language of a bad row that names none
_EMPTY_KEPT = pl.DataFrame(
    schema={
        "segment_id": pl.String,
        "shard_id": pl.String,
        "text": pl.String,
        "duration": pl.Float64,
        "lang": pl.String,
        "audio_filepath": pl.String,
        "source": pl.String,
        "tx_quality_score": pl.Float64,
        "speaker_id": pl.String,
    }
)


def duplicate_segment_ids(kept: pl.DataFrame) -> dict[str, Any]:
    """The segment_ids the manifest holds more than once, with their shards: ``{"ids", "rows",
    "in_several_shards", "examples": [{"segment_id", "shard_ids"}]}`` (first ``MAX_EXAMPLES`` ids
    in manifest order). Found through a 64-bit hash of the id, then checked on the ids."""
    maybe = kept.select(pl.col("segment_id").hash().is_duplicated()).to_series()
    rows = kept.select("segment_id", "shard_id").filter(maybe)
    groups = (
        rows.group_by("segment_id", maintain_order=True)
        .agg(pl.col("shard_id").unique(maintain_order=True), pl.len().alias("rows"))
        .filter(pl.col("rows") > 1)
    )
    return {
        "ids": groups.height,
        "rows": int(groups.get_column("rows").sum()) if groups.height else 0,
        "in_several_shards": groups.filter(pl.col("shard_id").list.len() > 1).height,
        "examples": [
            {"segment_id": sid, "shard_ids": shard_ids}
            for sid, shard_ids in groups.head(MAX_EXAMPLES).select("segment_id", "shard_id").rows()
        ],
    }


def shared_audio_report(shared: pl.DataFrame) -> dict[str, Any]:
    """``{"files", "rows", "files_with_other_text", "examples": [...]}`` of the audio files that
    several segment_ids name (see ``assemble_manifest``); conflicting examples listed first."""
    listed = shared.sort("texts_differ", descending=True, maintain_order=True)
    return {
        "files": shared.height,
        "rows": int(shared.get_column("rows").sum()),
        "files_with_other_text": int(shared.get_column("texts_differ").sum()),
        "examples": listed.head(MAX_EXAMPLES).to_dicts(),
    }


def _prepare_output(output: Path) -> None:
    """Before any shard is read: the output directory must take a file (ManifestError naming it),
    and the hidden temporary files a killed run left beside the outputs are removed."""
    directory = output.parent
    try:
        check_writable(directory)
    except OSError as exc:
        raise ManifestError(
            f"cannot write the master manifest into {directory}: {exc.strerror or exc}; fix the "
            f"permissions or choose --output / MASTER_MANIFEST_PATH elsewhere (checked before reading "
            f"any shard)"
        ) from None
    for path in (output, summary_path(output)):
        remove_stale_temporaries(path)  # left by atomic_write
        remove_stale_temporaries(path, SET_SUFFIX)  # left by write_together


def _warn_if_short_of_space(output: Path, shards: Sequence[Shard]) -> None:
    """A warning on stderr when the output's file system has less free space than the shards'
    metadata and index files take (about what the master needs), before the work."""
    need = 0
    for shard in shards:
        for name in (METADATA_FILE, INDEX_FILE):
            try:
                need += (shard.path / name).stat().st_size
            except OSError:
                pass  # reported as unreadable when read
    free = shutil.disk_usage(output.parent).free
    if need > free:
        print(
            f"build_manifest: warning: {output.parent} has {free / 2**30:.2f} GiB free and the "
            f"master manifest may need about {need / 2**30:.2f} GiB (the size of the shards' "
            f"metadata and index files): free space or choose --output elsewhere",
            file=sys.stderr,
        )


@dataclass
class _Parts:
    """What the sources give, batch by batch: kept rows, dropped (lang, reason) rows, shared audio,
    unreadable shards or files, rows read, orphan index entries, and per-source reports."""

    kept: list = field(default_factory=list)
    drops: list = field(default_factory=list)
    shared: list = field(default_factory=list)
    unreadable: list = field(default_factory=list)
    misplaced: list = field(default_factory=list)
    shards: int = 0
    shards_unreadable: int = 0
    rows_in: int = 0
    orphans: int = 0
    sources: list = field(default_factory=list)


def _add_shards(
    parts: _Parts,
    shards_dir: Path,
    found: tuple[list[Shard], list[dict[str, str]]],
    filters: Filters,
    workers: int,
    progress: bool,
) -> None:
    """The in-house shards under ``shards_dir`` (``found``: what ``discover_shards`` found there),
    read and assembled batch by batch."""
    shards, misplaced = found
    parts.misplaced += misplaced
    parts.shards += len(shards)
    unreadable = []
    # Building and compiling the cleaning regexes costs ~30 ms, most of it Python holding the GIL:
    # done while the first batch is read, on this thread, which has nothing else to do then.
    warm_up = functools.partial(clean_text_column, pl.Series(WARM_UP_TEXTS, dtype=pl.String))
    with tqdm(
        total=len(shards), desc="building manifest", unit="shard", disable=not progress
    ) as bar:
        for batch, joined, batch_orphans, batch_unreadable in joined_batches(
            shards, workers, meanwhile=warm_up
        ):
            unreadable += batch_unreadable
            if joined is not None:
                kept, drops, shared = assemble_manifest(joined, batch, filters, workers)
                parts.kept.append(kept)
                parts.drops.append(drops)
                parts.shared.append(shared)
                parts.rows_in += joined.height
                parts.orphans += batch_orphans
                del joined, kept, drops  # the batch's columns go as soon as they are assembled
            bar.update(len(batch))
    parts.unreadable += unreadable
    parts.shards_unreadable += len(unreadable)
    if shards and len(unreadable) == len(shards):  # nothing readable
        bad = misplaced + sorted(unreadable, key=lambda b: b["path"])
        raise ManifestError(
            f"none of the {len(shards) + len(misplaced)} shard(s) under {shards_dir} "
            f"could be read:\n  " + "\n  ".join(b["reason"] for b in bad[:10])
        )


def _add_source(
    parts: _Parts,
    spec: SourceSpec,
    audio_dir: Path,
    filters: Filters,
    workers: int,
    strict: bool,
    progress: bool,
) -> None:
    """An imported source (``source_readers``): its rows go through the same filters, cleaning,
    tags and accounting as a shard's. Its report counts every row it loses, in the reader (a bad
    row) or in the filters, under the reason, and lists the first ``MAX_BAD_ROWS`` of each reason
    with the file and line (or parquet row) it came from: ``rows_read - rows_kept ==
    rows_dropped == sum(dropped.values())``."""
    report = {
        "source": str(spec),
        "name": spec.name,
        "rows_read": 0,
        "rows_kept": 0,
        "rows_dropped": 0,
        "dropped": {},
        "language_unknown": 0,
        "left_out": {},
        "with_lang": str(SourceSpec(spec.kind, spec.path, {**spec.options, "lang": "xx"})),
    }
    examples: dict[str, list[dict]] = {}  # reason -> its first rows in file order
    skipped, reader_bad, reader_reasons, reader_examples = [], 0, {}, []
    batches = read_source(spec, audio_dir, workers=workers, strict=strict, progress=progress)
    for batch in _read_ahead(batches):
        skipped += batch.bad_files
        for option, n in batch.left_out.items():
            report["left_out"][option] = report["left_out"].get(option, 0) + n
        bad = pl.DataFrame(
            {
                "lang": [b["lang"] for b in batch.bad],
                "reason": [b["reason"] for b in batch.bad],
            },
            schema={"lang": pl.String, "reason": DROP_REASON},
        )
        found = [batch.bad]
        if batch.rows.height:
            kept, drops, shared = assemble_manifest(batch.rows, batch.shards, filters, workers)
            parts.kept.append(kept)
            parts.drops.append(drops.select("lang", "reason"))
            parts.shared.append(shared)
            report["rows_kept"] += kept.height
            report["language_unknown"] += drops.filter(
                pl.col("reason") == "language_unknown"
            ).height
            found.append(_first_drops(drops, MAX_BAD_ROWS))
            for reason, n in counts_by(drops, "reason").items():
                report["dropped"][reason] = report["dropped"].get(reason, 0) + n
        parts.drops.append(bad.with_columns(pl.col("lang").str.to_lowercase()))
        parts.rows_in += batch.rows.height + bad.height
        report["rows_read"] += batch.rows.height + bad.height
        reader_bad += bad.height
        for b in batch.bad:
            reader_reasons[b["reason"]] = reader_reasons.get(b["reason"], 0) + 1
            report["dropped"][b["reason"]] = report["dropped"].get(b["reason"], 0) + 1
        reader_examples += batch.bad[: MAX_BAD_ROWS - len(reader_examples)]
        for b in (b for rows in found for b in rows):
            examples.setdefault(b["reason"], []).append(b)
        for reason, rows in examples.items():
            examples[reason] = sorted(rows, key=lambda b: origin_order(b["origin"]))[:MAX_BAD_ROWS]
    parts.unreadable += skipped
    if reader_bad == report["rows_read"]:  # the reader could use none of its rows
        raise ManifestError(
            _nothing_imported(spec, report["rows_read"], reader_reasons, reader_examples, skipped)
        )
    report["rows_dropped"] = report["rows_read"] - report["rows_kept"]
    assert report["rows_dropped"] == sum(report["dropped"].values()), "source accounting broke"
    report["dropped"] = dict(sorted(report["dropped"].items()))
    listed = sorted(
        (b for rows in examples.values() for b in rows), key=lambda b: origin_order(b["origin"])
    )
    parts.sources.append(report | {"dropped_examples": listed, "files_skipped": skipped})


def _first_drops(drops: pl.DataFrame, n: int) -> list[dict]:
    """The first ``n`` dropped rows of each reason in file order (file, then line or row), as
    ``{"origin", "reason", "detail", "lang"}``; sorted in polars, however many rows were dropped."""
    if not drops.height:
        return []
    place = pl.col("origin").str.extract(r"^(.*)(?::| row )(\d+)$", 1)
    number = pl.col("origin").str.extract(r"(\d+)$", 1).cast(pl.UInt64)
    first = (
        drops.sort(place, number, maintain_order=True)
        .group_by("reason", maintain_order=True)
        .head(n)
        .select("origin", pl.col("reason").cast(pl.String), "detail", "lang")
    )
    return first.to_dicts()


def _nothing_imported(
    spec: SourceSpec, rows: int, reasons: dict[str, int], examples: list, skipped: list
) -> str:
    """One line on why no row of ``spec`` could be imported, with the first bad row and, when
    its audio was not found, where relative paths were looked for."""
    if not rows:
        files = "; ".join(f"{b['path']}: {b['reason']}" for b in skipped[:3])
        return f"source {spec}: no rows" + (f" ({files})" if files else "")
    counts = ", ".join(f"{r} {n:,}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    first = examples[0]
    line = (
        f"source {spec}: none of its {rows:,} rows could be imported ({counts}); the first: "
        f"{first['origin']}: {first['reason']} ({first['detail']})"
    )
    if first["reason"] == "audio_not_found" and "tars" not in spec.options:
        folder = spec.path.absolute() if spec.kind == "kaldi" else spec.path.absolute().parent
        what = "wav.scp paths" if spec.kind == "kaldi" else "audio paths"
        line += (
            f". Relative {what} resolve against {folder} (the {spec.kind} source's folder), not "
            f"the working directory: write them relative to it, or absolute"
        )
    return line


def _nothing_left(drops: pl.DataFrame, filters: Filters, specs: Sequence) -> str:
    """One line on why every row read was dropped (no master is written then)."""
    dropped = counts_by(drops, "reason")
    counts = ", ".join(f"{r} {n:,}" for r, n in sorted(dropped.items(), key=lambda kv: -kv[1]))
    top = max(dropped, key=dropped.get)
    hint = {
        "language_unknown": "give each source its language with :lang=xx (e.g. hf:DIR:lang=hi)",
        "language_not_selected": f"LANGUAGES={','.join(filters.languages)} selects none of them",
        "duration_too_short": f"MIN_DURATION={filters.min_duration:g} s is above all of them",
        "duration_too_long": f"MAX_DURATION={filters.max_duration:g} s is below all of them",
        "quality_below_min": f"MIN_QUALITY={filters.min_quality:g} is above all of them",
    }.get(top, f"see the reasons in {Path(__file__).name} --help")
    return (
        f"no row is left of the {len(drops):,} read from {', '.join(map(str, specs))} "
        f"(dropped: {counts}): {hint}; no master manifest was written"
    )


def _read_ahead(items: Iterator) -> Iterator:
    """``items``, the next one produced on a background thread while the caller works on this one
    (polars and the file look-ups release the GIL, so reading and assembling overlap)."""
    done = object()
    with ThreadPoolExecutor(max_workers=1) as reader:
        pending = reader.submit(next, items, done)
        while (item := pending.result()) is not done:
            pending = reader.submit(next, items, done)
            yield item


def sources_of(texts: Sequence[str] | None, shards_dir: Path | None) -> list[SourceSpec | Path]:
    """The sources to build from: each ``KIND:PATH[:options]`` parsed (``shards:DIR`` as the
    directory), or the in-house shards under ``shards_dir`` (SHARDS_DIR) when none is given."""
    texts = list(config.DATA_SOURCES if texts is None else texts)
    if not texts:
        return [Path(config.SHARDS_DIR if shards_dir is None else shards_dir)]
    specs: list[SourceSpec | Path] = []
    for text in texts:
        spec = parse_source(text)
        specs.append(spec.path if spec.kind == "shards" else spec)
    names = [s.name for s in specs if isinstance(s, SourceSpec)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ManifestError(
            f"several sources are named {', '.join(twice)}: give each its own name=... option "
            f"(the name is the source column and keeps their audio apart)"
        )
    return specs


def resolve_transcript_style(style: str | None) -> str:
    """``style`` (default TRANSCRIPT_STYLE) resolved (``transcript_style.resolve_style``); prints
    which style and why, and one warning line when the base (INIT_MODEL) writes the other."""
    try:
        style, why = resolve_style(style)
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    print(f"build_manifest: transcripts cleaned {style} ({why})")  # stderr is for warnings, errors
    if not why.startswith("TRANSCRIPT_STYLE=auto"):
        mismatch = base_mismatch(style)
        if mismatch:
            print(f"build_manifest: warning: {mismatch}", file=sys.stderr)
    return style


def build_manifest(
    shards_dir: Path | None = None,
    output: Path | None = None,
    *,
    sources: Sequence[str] | None = None,
    audio_dir: Path | None = None,
    strict: bool = False,
    languages: Sequence[str] | None = None,
    min_duration: float | None = None,
    max_duration: float | None = None,
    min_quality: float | None = None,
    style: str | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Build the master manifest at ``output`` and its summary beside it; return the summary.

    ``sources`` are ``source_readers`` specs (``nemo:...``, ``hf:...``, ``kaldi:...``,
    ``shards:DIR``); none means the in-house shards under ``shards_dir``. Imported audio that has
    to be written out goes under ``audio_dir``. None means the config value (SHARDS_DIR,
    MASTER_MANIFEST_PATH, DATA_SOURCES, IMPORTED_AUDIO_DIR, LANGUAGES, MIN_DURATION, MAX_DURATION,
    MIN_QUALITY, TRANSCRIPT_STYLE). Unreadable shards and files and bad rows are reported in the
    summary and skipped; with ``strict`` the first raises ManifestError before anything is written.
    The transcript style (``transcript_style.resolve_style``: plain, or punctuated with sentence
    punctuation kept) is written into the master's parquet metadata and the summary's settings.
    """
    started = time.perf_counter()
    output = Path(config.MASTER_MANIFEST_PATH if output is None else output)
    audio_dir = Path(config.IMPORTED_AUDIO_DIR if audio_dir is None else audio_dir)
    filters = Filters(
        tuple(config.LANGUAGES if languages is None else languages),
        config.MIN_DURATION if min_duration is None else min_duration,
        config.MAX_DURATION if max_duration is None else max_duration,
        config.MIN_QUALITY if min_quality is None else min_quality,
        resolve_transcript_style(style),
    )
    workers = workers or min(8, os.cpu_count() or 1)
    specs = sources_of(sources, shards_dir)

    _prepare_output(output)
    shard_dirs = [s for s in specs if isinstance(s, Path)]
    # each tree is walked once: the space check and the build share what was found
    found = {directory: discover_shards(directory) for directory in shard_dirs}
    for shards, _ in found.values():
        _warn_if_short_of_space(output, shards)
    parts = _Parts()
    for spec in specs:
        if isinstance(spec, Path):
            _add_shards(parts, spec, found[spec], filters, workers, progress)
        else:
            _add_source(parts, spec, audio_dir, filters, workers, strict, progress)
    bad = parts.misplaced + sorted(parts.unreadable, key=lambda b: b["path"])
    if bad and strict:
        raise ManifestError(
            f"{len(bad)} shard(s) or file(s) could not be read (--strict):\n  "
            + "\n  ".join(f"{b['path']}: {b['reason']}" for b in bad)
        )
    if not parts.kept and not parts.drops:
        raise ManifestError(
            "nothing could be read:\n  "
            + "\n  ".join(f"{b['path']}: {b['reason']}" for b in bad[:10])
        )
    # Batches hold consecutive shards in shard order, so their rows concatenate in manifest order;
    # imported sources follow in the order given, each in its own order (a sort would copy the
    # whole master once more at the peak).
    # a source with its own splits (Common Voice) adds a split column, null for the other rows
    kept = pl.concat(parts.kept, how="diagonal") if parts.kept else _EMPTY_KEPT
    drops = pl.concat(parts.drops)
    languages_seen = sorted(
        set(kept.get_column("lang").drop_nulls()) | set(drops.get_column("lang").drop_nulls())
    )
    languages_without_rows = check_language_selection(
        filters.languages, languages_seen, "build_manifest.py"
    )
    if not kept.height:
        raise ManifestError(_nothing_left(drops, filters, specs))
    dropped = counts_by(drops, "reason")
    assert parts.rows_in == kept.height + sum(dropped.values()), "row accounting broke"
    # The master is written on a thread while the summary is counted; both become visible together.
    summary_ready: Future = Future()
    writers = {
        output: functools.partial(write_manifest_file, kept, metadata={STYLE_KEY: filters.style}),
        summary_path(output): lambda tmp: Path(tmp).write_text(
            json_text(summary_ready.result()), encoding="utf-8"
        ),
    }
    with ThreadPoolExecutor(max_workers=1) as writer:
        written = writer.submit(write_together, writers, uuid.uuid4().hex[:8])
        try:
            summary = {
                "rows_in": parts.rows_in,
                "rows_out": kept.height,
                "dropped": dropped,
                "dropped_by_lang": counts_by(
                    drops.with_columns(
                        pl.when(pl.col("lang") != "")
                        .then(pl.col("lang"))
                        .fill_null(UNKNOWN_LANG)
                        .alias("lang")
                    ),
                    "lang",
                    "reason",
                ),
                "kept_by_lang": counts_by(kept, "lang"),
                "shards_found": parts.shards + len(parts.misplaced),
                "shards_read": parts.shards - parts.shards_unreadable,
                "bad_shards": bad,
                "audio_index_without_metadata": parts.orphans,
                "duplicate_segment_ids": duplicate_segment_ids(kept),
                "shared_audio": shared_audio_report(
                    pl.concat(parts.shared) if parts.shared else SHARED_AUDIO_EMPTY
                ),
                "languages_without_rows": languages_without_rows,
                "languages_seen": languages_seen,
                "sources": parts.sources,
                "settings": {
                    "shards_dir": [str(d) for d in shard_dirs],
                    "sources": [str(s) for s in specs],
                    "audio_dir": str(audio_dir),
                    "languages": list(filters.languages),
                    "min_duration": filters.min_duration,
                    "max_duration": filters.max_duration,
                    "min_quality": filters.min_quality,
                    STYLE_KEY: filters.style,
                },
            }
        except BaseException as exc:
            summary_ready.set_exception(exc)
            raise
        summary_ready.set_result(summary)
        try:
            written.result()
        except OSError as exc:
            remedy = "Free space (or choose --output elsewhere)" if disk_full(exc) else "Mend that"
            raise ManifestError(
                f"cannot write {exc.filename}: {exc.strerror}; the previous master manifest and "
                f"summary are unchanged. {remedy} and rerun"
            ) from None
    summary["seconds"] = round(time.perf_counter() - started, 3)
    return summary


def format_summary(summary: dict[str, Any], output: Path) -> str:
    lines = [
        f"shards: {summary['shards_read']} read, {len(summary['bad_shards'])} unreadable"
        if summary["shards_found"] or not summary.get("sources")
        else f"files unreadable: {len(summary['bad_shards'])}",
        f"rows: {summary['rows_in']:,} read, {summary['rows_out']:,} kept, "
        f"{summary['rows_in'] - summary['rows_out']:,} dropped",
    ]
    for reason, n in sorted(summary["dropped"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  dropped {reason:<24} {n:>12,}")
    langs = sorted(set(summary["kept_by_lang"]) | set(summary["dropped_by_lang"]))
    if langs:
        lines.append(f"  {'lang':<8} {'kept':>12} {'dropped':>12}  reasons")
        for lang in langs:
            drops = summary["dropped_by_lang"].get(lang, {})
            detail = ", ".join(f"{r}={n:,}" for r, n in sorted(drops.items()))
            lines.append(
                f"  {lang:<8} {summary['kept_by_lang'].get(lang, 0):>12,} "
                f"{sum(drops.values()):>12,}  {detail}"
            )
    if summary["audio_index_without_metadata"]:
        lines.append(
            f"audio_index entries without metadata (ignored): "
            f"{summary['audio_index_without_metadata']:,}"
        )
    duplicates = summary["duplicate_segment_ids"]
    if duplicates["ids"]:
        lines.append(
            f"segment_ids kept more than once: {duplicates['ids']:,} ({duplicates['rows']:,} rows, "
            f"{duplicates['in_several_shards']:,} in several shards; make_train_val.py keeps one)"
        )
        for d in duplicates["examples"][:5]:
            lines.append(f"  {d['segment_id']!r} in {', '.join(d['shard_ids'])}")
    shared = summary["shared_audio"]
    if shared["files"]:
        lines.append(
            f"audio files named by several segment_ids: {shared['files']:,} ({shared['rows']:,} "
            f"rows; {shared['files_with_other_text']:,} with different transcripts, dropped)"
        )
        for f in shared["examples"][:5]:
            what = "different transcripts" if f["texts_differ"] else "same transcript"
            lines.append(
                f"  {f['shard_id']}/{f['tar_member_name']}: {', '.join(f['segment_ids'])} ({what})"
            )
    for b in summary["bad_shards"]:
        lines.append(f"UNREADABLE {b['path']}: {b['reason']}")
    for source in summary.get("sources", []):
        lines.append(
            f"source {source['name']}: {source['rows_read']:,} rows read, "
            f"{source['rows_kept']:,} kept, {source['rows_dropped']:,} dropped"
        )
        if source.get("left_out"):
            counts = ", ".join(f"{k} {n:,}" for k, n in source["left_out"].items())
            lines.append(f"  left out by its options, not read: {counts}")
        lines += _dropped_rows_lines(source)
        if source.get("language_unknown"):
            lines.append(
                f"  {source['language_unknown']:,} rows name no language and their script "
                f"names none (language_unknown): add :lang=xx to the source, e.g. "
                f"--source '{source['with_lang']}'"
            )
    if summary.get("languages_without_rows"):
        lines.append(
            f"WARNING: LANGUAGES lists {', '.join(summary['languages_without_rows'])}, which no "
            f"row has (the data's languages: {', '.join(summary['languages_seen'])})"
        )
    lines.append(f"wrote {output} and {summary_path(output).name}")
    return "\n".join(lines)


PRINTED_PER_REASON = 3  # dropped rows printed per reason and source; the summary lists more


def _dropped_rows_lines(source: dict[str, Any]) -> list[str]:
    """The first dropped rows of each reason of an imported source, in file order, with where
    they are; then how many more of each reason the summary counts."""
    shown: dict[str, int] = {}
    lines = []
    for b in source["dropped_examples"]:
        if shown.get(b["reason"], 0) < PRINTED_PER_REASON:
            shown[b["reason"]] = shown.get(b["reason"], 0) + 1
            detail = f" ({b['detail']})" if b["detail"] else ""
            lines.append(f"  DROPPED {b['origin']}: {b['reason']}{detail}")
    for reason, n in sorted(source["dropped"].items(), key=lambda kv: -kv[1]):
        if n > shown.get(reason, 0):
            lines.append(
                f"  ... and {n - shown.get(reason, 0):,} more {reason} (the summary lists the "
                f"first {MAX_BAD_ROWS} of each reason)"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_epilog(
            "build_manifest",
            "example:\n  SHARDS_DIR=/nvme/shards python build_manifest.py --output /nvme/master.parquet",
        ),
    )
    parser.add_argument(
        "--shards-dir",
        type=Path,
        default=None,
        help=f"shard tree (default SHARDS_DIR = {config.SHARDS_DIR})",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"manifest to write (default MASTER_MANIFEST_PATH = {config.MASTER_MANIFEST_PATH})",
    )
    parser.add_argument(
        "--source",
        action="append",
        default=None,
        metavar="KIND:PATH[:OPTIONS]",
        help="a data source to import, repeatable: nemo:train.json, nemo:manifest.json:tars=audio_"
        "{0..N}.tar, hf:parquet_dir, kaldi:data_dir, cv:common_voice_language_dir, shards:DIR; "
        "options after a second colon, "
        "e.g. :lang=hi,name=cv_hi (see docs/bring_your_own_data.md; default DATA_SOURCES, else the shards "
        "under SHARDS_DIR)",
    )
    parser.add_argument(
        "--audio-dir",
        type=Path,
        default=None,
        help="where imported audio that has to be written out (tar members, parquet bytes, Kaldi "
        "segments) goes as FLAC (default IMPORTED_AUDIO_DIR)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit non-zero without writing if any shard or file cannot be read, or at the first "
        "bad row of an imported source",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="threads reading shards (default: min(8, CPUs))"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    output = Path(config.MASTER_MANIFEST_PATH if args.output is None else args.output)
    try:
        summary = build_manifest(
            args.shards_dir,
            output,
            sources=args.source,
            audio_dir=args.audio_dir,
            strict=args.strict,
            workers=args.workers,
            progress=not args.no_progress,
        )
    except ManifestError as exc:
        print(f"build_manifest: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary, output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
