"""Mozilla Common Voice releases: a language folder (``train.tsv``, ``dev.tsv``, ``test.tsv``,
``validated.tsv``, ``other.tsv``, ``invalidated.tsv`` as present, ``clips/`` with the MP3s and, in
newer releases, ``clip_durations.tsv``), or one of its TSVs.

    cv:/data/cv-corpus-17.0-2024-03-15/hi                     train, dev and test
    cv:/data/cv-corpus-17.0-2024-03-15/hi:splits=validated    every validated clip (see below)
    cv:/data/cv-corpus-17.0-2024-03-15/hi/test.tsv:name=cv_hi_test   the test split alone
    cv:/data/cv/hi:min_up_votes=3,max_down_votes=0,segment=Benchmark

Each row keeps its release split (``split``: the TSV's name), its speaker (``client_id``) and its
language (the ``locale`` column, else the folder's name, as the project's code: ``LOCALES``).
Clips are used where they are (MP3 at 48 kHz decodes through soundfile and is resampled when
loaded); durations come from ``clip_durations.tsv`` when the folder has one, else from the
headers. ``check`` works as for NeMo manifests: ``header`` reads every clip's header, ``exists``
only looks up the clips ``clip_durations.tsv`` times, ``none`` trusts them.

Options besides the common ones: ``splits`` (the TSVs of a folder to read, joined by ``+``:
default ``train+dev+test``; make_train_val.py puts the test rows into the test manifest, never into
train; ``validated``, ``other`` and ``invalidated`` hold the release's test and dev clips too, so
asking for any of them also reads the folder's ``test.tsv`` and ``dev.tsv``, whose clips keep their
split), and filters on what Common Voice marks: ``min_up_votes``,
``max_down_votes``, ``segment``, ``variant``, ``gender``, ``age`` (the last four keep the rows
whose field is one of the values, joined by ``+``). Rows a filter leaves out are not bad: they are
counted in the summary's ``left_out``.

The TSVs are read as Common Voice writes them: fields separated by tabs, quotes as they are (a
sentence may hold ``"``); a byte-order mark (a TSV re-saved on Windows or by a spreadsheet) is read
through, and a header without ``path`` or ``sentence`` is an error naming the file and its
columns. A line with more fields than the header is read once more as quoted CSV (a field in
quotes holding a tab); a line whose fields still do not match the header is a bad row
(``not_tsv``). A clip is imported once: one listed by two TSVs of ``train``, ``dev`` and ``test``
stays in the held-out one (test, then dev) and its other rows are bad (``clip_listed_twice``);
``validated``, ``other`` and ``invalidated`` add only the clips the release splits leave out.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import polars as pl

from manifest_schema import ManifestError, text_start
from source_readers.standard_rows import (
    ROW_SCHEMA,
    Shard,
    SourceRows,
    SourceSpec,
    _bad,
    _check_audio,
    _strip_tags,
    origin_order,
)

# Common Voice's TSVs, held-out first: a clip listed by several is imported from the first.
SPLITS = ("test", "dev", "train", "validated", "other", "invalidated")
# test is safe to import with the rest: make_train_val.py routes its rows to the test manifest
DEFAULT_SPLITS = ("train", "dev", "test")
# The three the release itself splits into; the others overlap them by design.
RELEASE_SPLITS = frozenset({"train", "dev", "test"})
# Read with any of the others, so that their clips keep the release's held-out split (the test
# manifest, validation) instead of training as validated clips, and their speakers' other clips
# are found as leaks by make_train_val.py.
HELD_OUT_SPLITS = ("test", "dev")
FILTERS = ("min_up_votes", "max_down_votes", "segment", "variant", "gender", "age")
FILTER_FIELDS = {"min_up_votes": "up_votes", "max_down_votes": "down_votes"}  # else the option
OPTIONS = frozenset({"splits", *FILTERS})
# Common Voice locales whose code in this project drops the region (the rest: lower-cased).
LOCALES = {"pa-IN": "pa", "gu-IN": "gu", "ne-NP": "ne", "ga-IE": "ga", "hy-AM": "hy", "sv-SE": "sv"}
DURATIONS_FILE = "clip_durations.tsv"
# The columns a TSV cannot be read without.
REQUIRED_COLUMNS = ("path", "sentence")


def project_language(locale: pl.Expr) -> pl.Expr:
    """A Common Voice locale as the project's language code: ``pa-IN`` -> ``pa``, ``hi`` -> ``hi``."""
    return locale.str.strip_chars().replace(LOCALES).str.to_lowercase()


def _tsv_files(spec: SourceSpec) -> list[tuple[str, Path]]:
    """(split, TSV) to read, held-out first: the ``splits`` asked for, and with any of validated,
    other and invalidated the folder's test and dev (``HELD_OUT_SPLITS``); ManifestError naming
    what is missing."""
    if spec.path.is_file():
        return [(spec.path.stem, spec.path)]
    wanted = spec.options.get("splits", "+".join(DEFAULT_SPLITS)).split("+")
    unknown = [s for s in wanted if s not in SPLITS]
    if unknown:
        raise ManifestError(
            f"source {spec}: splits={'+'.join(wanted)}: {', '.join(unknown)} is not a Common "
            f"Voice TSV; choose among {'+'.join(SPLITS)}"
        )
    if not RELEASE_SPLITS.issuperset(wanted):  # validated, other, invalidated: held-out clips too
        wanted += [s for s in HELD_OUT_SPLITS if s not in wanted]
    found = [(s, spec.path / f"{s}.tsv") for s in SPLITS if s in wanted]
    found = [(s, p) for s, p in found if p.is_file()]
    if not found:
        raise ManifestError(
            f"{spec.path}: none of {', '.join(f'{s}.tsv' for s in wanted)} found: point cv: at a "
            f"Common Voice language folder (its TSVs and clips/) or at one of its TSVs"
        )
    return found


def _lines(data: bytes, path: Path) -> pl.Series:
    """The file's lines (a trailing "\r" removed), read by polars' multi-threaded CSV reader as one
    column (no field separator a text file holds); ManifestError naming the first line that is not
    UTF-8."""
    try:
        lines = pl.read_csv(
            io.BytesIO(data),
            separator="\x00",
            quote_char=None,
            has_header=False,
            infer_schema=False,
            new_columns=["text"],
            empty_string_is_null=False,
        ).to_series()
        if lines.len() == data.count(b"\n") + (not data.endswith(b"\n")):
            return lines.str.strip_suffix("\r")
    except pl.exceptions.PolarsError:
        pass  # a NUL byte in a line, or bytes that are not UTF-8: as Python reads them
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ManifestError(
            f"{path}:{line}: not UTF-8 ({exc.reason}); re-encode {path.name} as UTF-8"
        ) from None
    return pl.Series("text", text.removesuffix("\n").split("\n")).str.strip_suffix("\r")


def _read_tsv(
    path: Path, split: str, rank: int, wanted: set[str]
) -> tuple[pl.DataFrame, list[dict], list[str]]:
    """The TSV's ``wanted`` fields as strings with ``line`` (1-based), ``split`` and ``rank``
    columns; its lines that do not parse, as bad rows; and its header. When every line has the
    header's field count the fields come from polars' CSV reader (quotes off: as Common Voice
    writes them); otherwise the lines are split on tabs in polars, and only the lines whose field
    count differs from the header's go through Python's csv reader."""
    data = path.read_bytes()
    data = data[text_start(path, data[:4]) :]
    first = data[: data.find(b"\n") if b"\n" in data else len(data)]
    header = first.decode("utf-8", "replace").removesuffix("\r").split("\t")
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise ManifestError(
            f"{path}:1: no {' or '.join(missing)} column: a Common Voice TSV's header names "
            f"{' and '.join(REQUIRED_COLUMNS)}; this one has {', '.join(map(repr, header))[:300]}"
        )
    width = len(header)
    labels = {"split": pl.lit(split, dtype=pl.String), "rank": pl.lit(rank, dtype=pl.UInt8)}
    keep = [c for c in dict.fromkeys(header) if c in wanted]
    rows = data.count(b"\n") + (not data.endswith(b"\n")) - 1
    # Every line has the header's field count when no line has more (polars raises on one) and
    # the file holds exactly (width - 1) tabs per line (a shorter or blank line would leave fewer)
    if len(set(header)) == width and data.count(b"\t") == (width - 1) * (rows + 1):
        try:
            table = pl.read_csv(
                io.BytesIO(data),
                columns=keep,
                separator="\t",
                quote_char=None,
                infer_schema=False,
                empty_string_is_null=False,
            )
        except pl.exceptions.PolarsError:
            table = None  # a line with more fields, or bytes that are not UTF-8: line by line
        if table is not None and table.height == rows:
            line = pl.int_range(2, rows + 2, dtype=pl.UInt32, eager=True).alias("line")
            return table.with_columns(line, **labels), [], header
    lines = _lines(data, path)
    frame = pl.DataFrame(
        {"text": lines.slice(1), "line": pl.int_range(2, len(lines) + 1, eager=True)}
    ).with_columns(pl.col("line").cast(pl.UInt32))
    fields = pl.col("text").str.count_matches("\t", literal=True) + 1
    frame = frame.with_columns(fields.alias("_fields"))
    frame = frame.filter(pl.col("text") != "")
    ragged = frame.filter(pl.col("_fields") != width)
    frame = frame.filter(pl.col("_fields") == width)
    split_up = pl.col("text").str.splitn("\t", width)
    frame = frame.select(split_up.struct.rename_fields(header).struct.field(*keep), "line")
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
        extra = extra.select(*keep, pl.col("line").cast(pl.UInt32))
        frame = pl.concat([frame, extra]).sort("line")
    return frame.with_columns(**labels), bad, header


def _given_durations(folder: Path, clips: pl.Series) -> pl.Series:
    """Each clip's seconds from the folder's ``clip_durations.tsv`` (milliseconds; null where it
    has none, or no such file). Looked up by a 64-bit hash of the name, then checked on the name,
    so a hash collision only leaves a clip to its header."""
    file = folder / DURATIONS_FILE
    none = pl.Series("_given", [None] * len(clips), dtype=pl.Float64)
    if not file.is_file():
        return none
    data = file.read_bytes()
    data = data[text_start(file, data[:4]) :]
    table = pl.read_csv(io.BytesIO(data), separator="\t", quote_char=None, infer_schema=False)
    if table.width < 2:
        return none
    names, seconds = table[:, 0], table[:, 1].cast(pl.Float64, strict=False) / 1000
    keys, at = names.hash(), pl.int_range(0, table.height, dtype=pl.UInt32, eager=True)
    try:
        found = clips.hash().replace_strict(keys, at, default=None)
    except pl.exceptions.InvalidOperationError:  # a clip listed twice: its first row counts
        first = keys.is_first_distinct()
        found = clips.hash().replace_strict(keys.filter(first), at.filter(first), default=None)
    same = (names.gather(found) == clips).fill_null(False)
    return seconds.gather(found).zip_with(same, none).alias("_given")


def _filters(spec: SourceSpec, columns: list[str]) -> dict[str, pl.Expr]:
    """The filter options as ``{option: rows it keeps}``; ManifestError on a bad value or a field
    the TSVs lack."""
    kept = {}
    for option in FILTERS:
        value = spec.options.get(option)
        if value is None:
            continue
        field = FILTER_FIELDS.get(option, option)
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
    wanted = {"client_id", "path", "sentence", "locale"}
    wanted |= {FILTER_FIELDS.get(option, option) for option in FILTERS if option in spec.options}
    frames, bad, columns = [], [], []
    for split, tsv in _tsv_files(spec):  # held-out first: the order a clip's first row wins in
        rank = SPLITS.index(split) if split in SPLITS else 0
        frame, tsv_bad, header = _read_tsv(tsv, split, rank, wanted)
        bad += [b | {"lang": folder_lang} for b in tsv_bad]
        frames.append(frame.with_columns(pl.lit(str(tsv)).alias("_file")))
        columns += [c for c in header if c not in columns]
    frame = pl.concat(frames, how="diagonal") if len(frames) > 1 else frames[0]
    if fixed is not None:
        lang = pl.lit(fixed, dtype=pl.String)
    else:
        locale = pl.col("locale") if "locale" in frame.columns else pl.lit("", pl.String)
        given = locale.fill_null("").str.strip_chars()
        lang = project_language(pl.when(given != "").then(given).otherwise(pl.lit(folder.name)))
    frame = frame.with_columns(
        lang.alias("_lang"),
        pl.concat_str("_file", pl.lit(":"), pl.col("line").cast(pl.String)).alias("_origin"),
    )
    # a clip is imported once, from the first TSV that lists it (held-out first, then file order);
    # only the rows whose name's hash repeats are compared by name
    no_path = pl.col("path").is_null() | (pl.col("path") == "")
    maybe = frame.select(pl.col("path").hash().is_duplicated() & ~no_path).to_series()
    left_out: dict[str, int] = {}
    if maybe.any():
        where = maybe.arg_true()
        candidates = frame.select("path", "split", "_origin", "_lang").gather(where)
        later = ~candidates.get_column("path").is_first_distinct()
        keeper = candidates.filter(~later).select(
            "path", pl.col("split").alias("_kept_split"), pl.col("_origin").alias("_kept_at")
        )
        again = candidates.filter(later).join(keeper, on="path", how="left")
        overlap = pl.col("split").is_in(RELEASE_SPLITS).not_() & pl.col("_kept_split").is_in(
            RELEASE_SPLITS
        )
        if n := again.filter(overlap).height:
            left_out["in_train_dev_or_test"] = n
        for origin, clip, kept_at, row_lang in (
            again.filter(~overlap).select("_origin", "path", "_kept_at", "_lang").iter_rows()
        ):
            detail = f"{clip} is also {Path(kept_at).name}, where it is kept"
            bad.append(_bad(origin, "clip_listed_twice", detail, row_lang))
        drop = pl.Series([False] * frame.height).scatter(where.filter(later), True)
        frame = frame.filter(~drop)
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
    origins = frame.get_column("_origin")
    seconds, keep, audio_bad = _check_audio(
        frame.get_column("_audio"),
        _given_durations(folder, frame.get_column("path")),
        lambda i: origins[i],
        frame.get_column("_lang"),
        spec.options.get("check", "header"),
        workers,
    )
    bad += audio_bad
    frame = frame.with_columns(seconds.alias("_duration")).filter(pl.Series(keep))
    # every clip lies in clips/, and a clip is one row: its name is its id
    shards = [Shard(f"{spec.name}/clips", spec.name, "", folder / "clips", False)]
    speaker = pl.lit(None, pl.String)
    if "client_id" in frame.columns:
        speaker = pl.col("client_id").str.strip_chars().replace("", None)
    rows = frame.select(
        pl.lit(0, dtype=pl.UInt32).alias("shard"),
        (f"{spec.name}/" + pl.col("path").str.replace(r"\.[^./]*$", "")).alias("segment_id"),
        pl.col("_text")
        .map_batches(_strip_tags, return_dtype=pl.String)
        .alias("transcription_native"),
        pl.col("_lang").alias("segment_language"),
        speaker.alias("speaker_id"),
        pl.col("_duration").alias("duration_s"),
        pl.lit(None, pl.Float64).alias("tx_quality_score"),
        pl.col("path").alias("tar_member_name"),
        pl.col("_origin").alias("origin"),
        pl.col("split"),
    )
    bad.sort(key=lambda b: origin_order(b["origin"]))
    return SourceRows(rows.select(*ROW_SCHEMA, "split"), shards, bad, left_out=left_out)
