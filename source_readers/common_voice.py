"""Mozilla Common Voice releases: a language folder (``train.tsv``, ``dev.tsv``, ``test.tsv``,
``validated.tsv``, ``other.tsv``, ``invalidated.tsv`` as present, ``clips/`` with the MP3s and, in
newer releases, ``clip_durations.tsv``), or one of its TSVs.

    cv:/data/cv-corpus-17.0-2024-03-15/hi                     train and dev
    cv:/data/cv-corpus-17.0-2024-03-15/hi:splits=validated    every validated clip
    cv:/data/cv-corpus-17.0-2024-03-15/hi/test.tsv:name=cv_hi_test   the test split alone
    cv:/data/cv/hi:min_up_votes=3,max_down_votes=0,segment=Benchmark

Each row keeps its release split (``split``: the TSV's name), its speaker (``client_id``) and its
language (the ``locale`` column, else the folder's name, as the project's code: ``LOCALES``).
Clips are used where they are (MP3 at 48 kHz decodes through soundfile and is resampled when
loaded); durations come from ``clip_durations.tsv`` when the folder has one, else from the
headers. ``check`` works as for NeMo manifests: ``header`` reads every clip's header, ``exists``
only looks up the clips ``clip_durations.tsv`` times, ``none`` trusts them.

Options besides the common ones: ``splits`` (the TSVs of a folder to read, joined by ``+``:
default ``train+dev``: the test split is imported on its own, for
evaluation), and filters on what Common Voice marks: ``min_up_votes``,
``max_down_votes``, ``segment``, ``variant``, ``gender``, ``age`` (the last four keep the rows
whose field is one of the values, joined by ``+``). Rows a filter leaves out are not bad: they are
counted in the summary's ``left_out``.

The TSVs are read as Common Voice writes them: fields separated by tabs, quotes as they are (a
sentence may hold ``"``). A line with more fields than the header is read once more as quoted CSV
(a field in quotes holding a tab); a line whose fields still do not match the header is a bad row
(``not_tsv``). A clip is imported once: one listed by two TSVs of ``train``, ``dev`` and ``test``
stays in the held-out one (test, then dev) and its other rows are bad (``clip_listed_twice``);
``validated``, ``other`` and ``invalidated`` add only the clips the release splits leave out.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import polars as pl

from manifest_schema import ManifestError
from source_readers.common import (
    ROW_SCHEMA,
    RowIds,
    SourceRows,
    SourceSpec,
    _bad,
    _check_audio,
    _groups_by_directory,
    _strip_tags,
    origin_order,
)

# Common Voice's TSVs, held-out first: a clip listed by several is imported from the first.
SPLITS = ("test", "dev", "train", "validated", "other", "invalidated")
# test stays out unless asked for: make_train_val.py would otherwise train on part of it
DEFAULT_SPLITS = ("train", "dev")
# The three the release itself splits into; the others overlap them by design.
RELEASE_SPLITS = frozenset({"train", "dev", "test"})
FILTERS = ("min_up_votes", "max_down_votes", "segment", "variant", "gender", "age")
OPTIONS = frozenset({"splits", *FILTERS})
# Common Voice locales whose code in this project drops the region (the rest: lower-cased).
LOCALES = {"pa-IN": "pa", "gu-IN": "gu", "ne-NP": "ne", "ga-IE": "ga", "hy-AM": "hy", "sv-SE": "sv"}
DURATIONS_FILE = "clip_durations.tsv"


def project_language(locale: pl.Expr) -> pl.Expr:
    """A Common Voice locale as the project's language code: ``pa-IN`` -> ``pa``, ``hi`` -> ``hi``."""
    return locale.str.strip_chars().replace(LOCALES).str.to_lowercase()


def _tsv_files(spec: SourceSpec) -> list[tuple[str, Path]]:
    """(split, TSV) to read, held-out first; ManifestError naming what is missing."""
    if spec.path.is_file():
        return [(spec.path.stem, spec.path)]
    wanted = spec.options.get("splits", "+".join(DEFAULT_SPLITS)).split("+")
    unknown = [s for s in wanted if s not in SPLITS]
    if unknown:
        raise ManifestError(
            f"source {spec}: splits={'+'.join(wanted)}: {', '.join(unknown)} is not a Common "
            f"Voice TSV; choose among {'+'.join(SPLITS)}"
        )
    found = [(s, spec.path / f"{s}.tsv") for s in SPLITS if s in wanted]
    found = [(s, p) for s, p in found if p.is_file()]
    if not found:
        raise ManifestError(
            f"{spec.path}: none of {', '.join(f'{s}.tsv' for s in wanted)} found: point cv: at a "
            f"Common Voice language folder (its TSVs and clips/) or at one of its TSVs"
        )
    return found


def _read_tsv(path: Path, split: str, rank: int) -> tuple[pl.DataFrame, list[dict]]:
    """The TSV's rows as strings with ``line`` (1-based), ``split`` and ``rank`` columns, and its
    lines that do not parse as bad rows. Lines are split on tabs in polars; only the lines whose
    field count differs from the header's go through Python's csv reader."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ManifestError(
            f"{path}:{line}: not UTF-8 ({exc.reason}); re-encode {path.name} as UTF-8"
        ) from None
    lines = pl.Series("text", text.split("\n"), dtype=pl.String).str.strip_suffix("\r")
    header = lines[0].split("\t") if len(lines) else []
    if "path" not in header or "sentence" not in header:
        raise ManifestError(
            f"{path}:1: expected a Common Voice header with path and sentence, got "
            f"{' '.join(header)[:200]!r}"
        )
    width = len(header)
    frame = pl.DataFrame(
        {"text": lines.slice(1), "line": pl.int_range(2, len(lines) + 1, eager=True)}
    ).filter(pl.col("text") != "")
    fields = pl.col("text").str.count_matches("\t", literal=True) + 1
    frame = frame.with_columns(fields.alias("_fields"))
    ragged = frame.filter(pl.col("_fields") != width)
    frame = frame.filter(pl.col("_fields") == width)
    split_up = pl.col("text").str.splitn("\t", width)
    frame = frame.select(
        split_up.struct.rename_fields(header).struct.unnest(), pl.col("line").cast(pl.UInt32)
    )
    bad, recovered = [], []
    for number, line_text, count in ragged.select("line", "text", "_fields").iter_rows():
        quoted = next(csv.reader(io.StringIO(line_text), delimiter="\t", quotechar='"'), [])
        if len(quoted) == width:
            recovered.append([*quoted, number])
        else:
            detail = f"{count} tab-separated fields, the header has {width}"
            bad.append(_bad(f"{path}:{number}", "not_tsv", detail))
    if recovered:
        extra = pl.DataFrame(recovered, schema=[*header, "line"], orient="row")
        extra = extra.with_columns(pl.col("line").cast(pl.UInt32))
        frame = pl.concat([frame, extra]).sort("line")
    lit_split = pl.lit(split, dtype=pl.String)
    return frame.with_columns(split=lit_split, rank=pl.lit(rank, dtype=pl.UInt8)), bad


def _durations(folder: Path) -> pl.DataFrame:
    """``clip -> seconds`` from the folder's ``clip_durations.tsv`` (milliseconds), when it has one."""
    file = folder / DURATIONS_FILE
    schema = {"path": pl.String, "_given": pl.Float64}
    if not file.is_file():
        return pl.DataFrame(schema=schema)
    table = pl.read_csv(file, separator="\t", quote_char=None, infer_schema=False)
    if table.width < 2:
        return pl.DataFrame(schema=schema)
    seconds = table[:, 1].cast(pl.Float64, strict=False) / 1000
    return pl.DataFrame({"path": table[:, 0], "_given": seconds}).unique("path", keep="first")


def _filters(spec: SourceSpec, columns: list[str]) -> dict[str, pl.Expr]:
    """The filter options as ``{option: rows it keeps}``; ManifestError on a bad value or a field
    the TSVs lack."""
    kept = {}
    for option in FILTERS:
        value = spec.options.get(option)
        if value is None:
            continue
        field = {"min_up_votes": "up_votes", "max_down_votes": "down_votes"}.get(option, option)
        if field not in columns:
            raise ManifestError(
                f"source {spec}: {option}={value} needs the TSV field {field}, which this release "
                f"does not have (it has {', '.join(columns)})"
            )
        if option in ("min_up_votes", "max_down_votes"):
            try:
                bound = int(value)
            except ValueError:
                raise ManifestError(
                    f"source {spec}: {option}={value}: expected a whole number"
                ) from None
            votes = pl.col(field).cast(pl.Int64, strict=False)
            kept[option] = votes >= bound if option == "min_up_votes" else votes <= bound
        else:
            kept[option] = pl.col(field).is_in(value.split("+"))
    return {option: expr.fill_null(False) for option, expr in kept.items()}


def read_common_voice(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> SourceRows:
    """A Common Voice language folder or one of its TSVs (see the module doc), in one batch."""
    folder = spec.path if spec.path.is_dir() else spec.path.parent
    fixed = spec.options.get("lang")
    folder_lang = fixed or pl.select(project_language(pl.lit(folder.name))).item()
    frames, bad = [], []
    for split, tsv in _tsv_files(spec):
        frame, tsv_bad = _read_tsv(tsv, split, SPLITS.index(split) if split in SPLITS else 0)
        bad += [b | {"lang": folder_lang} for b in tsv_bad]
        frames.append(frame.with_columns(pl.lit(str(tsv)).alias("_file")))
    frame = pl.concat(frames, how="diagonal").sort("rank", "line", maintain_order=True)
    columns = [c for c in frame.columns if c not in ("line", "split", "rank", "_file")]
    if fixed is not None:
        lang = pl.lit(fixed, dtype=pl.String)
    else:
        locale = pl.col("locale") if "locale" in columns else pl.lit("", pl.String)
        given = locale.fill_null("").str.strip_chars()
        lang = project_language(pl.when(given != "").then(given).otherwise(pl.lit(folder.name)))
    frame = frame.with_columns(
        pl.col("path").str.strip_chars(),
        lang.alias("_lang"),
        pl.concat_str("_file", pl.lit(":"), pl.col("line").cast(pl.String)).alias("_origin"),
    )
    # a clip is imported once, from the first TSV that lists it (held-out first, then file order)
    no_path = pl.col("path").is_null() | (pl.col("path") == "")
    frame = frame.with_columns((pl.col("path").is_first_distinct() | no_path).alias("_first"))
    keeper = frame.filter("_first").select(
        "path", pl.col("split").alias("_kept_split"), pl.col("_origin").alias("_kept_at")
    )
    again = frame.filter(~pl.col("_first")).join(keeper, on="path", how="left")
    overlap = pl.col("split").is_in(RELEASE_SPLITS).not_() & pl.col("_kept_split").is_in(
        RELEASE_SPLITS
    )
    left_out: dict[str, int] = {}
    if n := again.filter(overlap).height:
        left_out["in_train_dev_or_test"] = n
    for origin, clip, kept_at, row_lang in (
        again.filter(~overlap).select("_origin", "path", "_kept_at", "_lang").iter_rows()
    ):
        detail = f"{clip} is also {Path(kept_at).name}, where it is kept"
        bad.append(_bad(origin, "clip_listed_twice", detail, row_lang))
    frame = frame.filter("_first")
    for option, keeps in _filters(spec, columns).items():
        left = frame.height
        frame = frame.filter(keeps)
        if left - frame.height:
            left_out[f"{option}={spec.options[option]}"] = left - frame.height
    clips = str((folder / "clips").absolute()) + "/"
    frame = frame.with_columns(
        (pl.lit(clips) + pl.col("path")).alias("_audio"),
        pl.col("sentence").str.strip_chars().alias("_text"),
    )
    no_text = pl.col("_text").is_null() | (pl.col("_text") == "")
    for origin, missing_path, row_lang in (
        frame.filter(no_path | no_text).select("_origin", no_path, "_lang").iter_rows()
    ):
        if missing_path:
            bad.append(_bad(origin, "audio_path_missing", "no path", row_lang))
        else:
            bad.append(_bad(origin, "transcript_missing", "empty sentence", row_lang))
    frame = frame.filter(~no_path & ~no_text)
    frame = frame.join(_durations(folder), on="path", how="left", maintain_order="left")
    origins = frame.get_column("_origin")
    seconds, keep, audio_bad = _check_audio(
        frame.get_column("_audio"),
        frame.get_column("_given"),
        lambda i: origins[i],
        frame.get_column("_lang"),
        spec.options.get("check", "header"),
        workers,
    )
    bad += audio_bad
    frame = frame.with_columns(seconds.alias("_duration")).filter(pl.Series(keep))
    shard, names, shards = _groups_by_directory(
        frame.get_column("_audio"), spec.name, "", False, folder
    )
    own = frame.get_column("path").str.replace(r"\.[^./]*$", "")
    where = frame.select(pl.col("split") + ":" + pl.col("line").cast(pl.String)).to_series()
    speaker = pl.lit(None, pl.String)
    if "client_id" in frame.columns:
        speaker = pl.col("client_id").str.strip_chars().replace("", None)
    rows = frame.select(
        shard.alias("shard"),
        RowIds(spec.name).assign(own, where).alias("segment_id"),
        pl.col("_text")
        .map_batches(_strip_tags, return_dtype=pl.String)
        .alias("transcription_native"),
        pl.col("_lang").alias("segment_language"),
        speaker.alias("speaker_id"),
        pl.col("_duration").alias("duration_s"),
        pl.lit(None, pl.Float64).alias("tx_quality_score"),
        names.alias("tar_member_name"),
        pl.col("_origin").alias("origin"),
        pl.col("split"),
    )
    bad.sort(key=lambda b: origin_order(b["origin"]))
    return SourceRows(rows.select(*ROW_SCHEMA, "split"), shards, bad, left_out=left_out)
