"""Readers of the data build_manifest.py imports besides the in-house shards: NeMo JSON manifests
(plain, and tarred), Hugging Face audio parquet, and Kaldi data directories.

A source is named as ``KIND:PATH`` with options after a second colon, comma-separated:

    nemo:/data/cv_hi/train.json                      audio files on disk, paths as NeMo reads them
    nemo:/data/tarred/tarred_audio_manifest.json:tars=/data/tarred/audio_{0..127}.tar
    hf:/data/fleurs_hi:lang=hi                       a folder (or one file) of parquet files
    kaldi:/data/kaldi/train:name=mucs_te,lang=te     wav.scp, text, [segments, utt2spk, utt2lang]

Options: ``name`` (the ``source`` column and the group ids; default the file or folder name),
``lang`` (the language of every row), ``lang_field``, ``text_field``, ``speaker_field``,
``duration_field``, ``quality_field``, ``id_field``, ``audio_field`` (the field to read instead of
the first of ``FIELDS``), ``tars`` (NeMo's ``{a..b}`` or ``_OP_a..b_CL_`` pattern of a tarred
manifest's tar files), ``check`` (``header``, the default, ``exists`` or ``none``: see below).

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

A bad row is dropped and counted under its reason (``BAD_ROW_REASONS``) with its file and line
(1-based) or row (0-based, parquet); build_manifest.py's ``--strict`` makes the first one an error.
A file that cannot be used at all (an unreadable parquet file, one without an audio column, a
missing tar) is reported with its path and skipped.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import mmap
import multiprocessing
import os
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import soundfile as sf

import config
from atomic_files import atomic_write
from manifest_schema import ManifestError

KINDS = ("shards", "nemo", "hf", "kaldi")
# The fields looked for, in this order, when the source's options do not name one.
FIELDS = {
    "audio": ("audio_filepath", "audio", "audio_path", "path"),
    "text": ("text", "sentence", "transcription", "transcript", "normalized_text"),
    "lang": ("lang", "language", "locale"),
    "speaker": ("speaker_id", "speaker", "client_id", "spk_id"),
    "duration": ("duration", "duration_s"),
    "quality": ("tx_quality_score",),
    "id": ("segment_id", "utt_id", "id"),
}
OPTIONS = frozenset({f"{k}_field" for k in FIELDS} | {"name", "lang", "tars", "check"})
# A row's stated duration may differ from its audio header by this many seconds, plus 1 %.
DURATION_TOLERANCE = 0.1
BAD_ROW_REASONS = (
    "not_json",
    "audio_path_missing",
    "transcript_missing",
    "audio_not_found",
    "audio_unreadable",
    "audio_command",
    "duration_mismatch",
    "segment_past_end",
    "segment_invalid",
    "not_utf8",
)
DONE_MARKER = ".written.json"  # in each unit's output folder, once all its audio is verified
MAX_EXAMPLES = 20  # bad rows listed per source in the summary; the rest are counted


@dataclass(frozen=True)
class Shard:
    """A group of rows whose audio files lie in one directory: an in-house shard, or a group of an
    imported source (a tar shard, a parquet file, a recording, an audio folder)."""

    shard_id: str  # in-house: path under SHARDS_DIR, "<source>/<lang>/<shard>"; else "<name>/..."
    source: str
    lang: str  # the language of rows that name none ("" when the source gives none)
    path: Path  # the directory the audio files are in (an in-house shard's own directory)
    scored: bool = True  # rows carry tx_quality_score: MIN_QUALITY applies only then

    @property
    def audio_dir(self) -> str:
        return os.path.abspath(self.path)


@dataclass(frozen=True)
class SourceSpec:
    kind: str
    path: Path
    options: dict[str, str]

    @property
    def name(self) -> str:
        if "name" in self.options:
            return self.options["name"]
        return self.path.name.split(".")[0] if self.path.is_file() else self.path.name

    def __str__(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.kind}:{self.path}" + (f":{extra}" if extra else "")


@dataclass
class SourceRows:
    """What a reader gives build_manifest.py: ``rows`` in the columns it filters (``shard`` is a
    position in ``shards``; ``tar_member_name`` the audio file's name in its shard's directory;
    ``origin`` its file and line, or parquet file and row, written as a bad row's is, so that a
    row the filters drop later is reported with its place too), the bad rows ``{"origin",
    "reason", "detail", "lang"}`` and the files skipped ``{"path", "reason"}``."""

    rows: pl.DataFrame
    shards: list[Shard]
    bad: list[dict] = field(default_factory=list)
    bad_files: list[dict] = field(default_factory=list)


ROW_SCHEMA = {
    "shard": pl.UInt32,
    "segment_id": pl.String,
    "transcription_native": pl.String,
    "segment_language": pl.String,
    "speaker_id": pl.String,
    "duration_s": pl.Float64,
    "tx_quality_score": pl.Float64,
    "tar_member_name": pl.String,
    "origin": pl.String,
}


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
            if not eq or key not in OPTIONS:
                raise ManifestError(
                    f"source {text!r}: unknown option {item!r}; options are "
                    f"{', '.join(sorted(OPTIONS))}"
                )
            options[key] = value.strip()
    if options.get("check", "header") not in ("header", "exists", "none"):
        raise ManifestError(f"source {text!r}: check must be header, exists or none")
    if kind == "shards" and options:
        raise ManifestError(f"source {text!r}: shards take no options")
    spec = SourceSpec(kind, Path(path), options)
    if not spec.path.exists():
        raise ManifestError(f"source {text!r}: {spec.path} does not exist")
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
    reader = {"nemo": read_nemo, "hf": read_hf_parquet, "kaldi": read_kaldi}[spec.kind]
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
        yield result


# --- shared helpers ------------------------------------------------------------------------
def _pick(
    spec: SourceSpec, what: str, columns: Sequence[str], required: bool = False
) -> str | None:
    """The column holding ``what``: the option's field, else the first of ``FIELDS[what]``."""
    option = spec.options.get(f"{what}_field")
    if option is not None:
        if option not in columns:
            raise ManifestError(
                f"{spec.path}: {what}_field={option} is not a field of the source (it has "
                f"{', '.join(columns)})"
            )
        return option
    found = next((c for c in FIELDS[what] if c in columns), None)
    if found is None and required:
        raise ManifestError(
            f"{spec.path}: no {what} field (looked for {', '.join(FIELDS[what])}; it has "
            f"{', '.join(columns)}): name it with {what}_field=..."
        )
    return found


def _as_string(frame: pl.DataFrame, column: str | None) -> pl.Expr:
    if column is None or column not in frame.columns:
        return pl.lit(None, dtype=pl.String)
    dtype = frame.schema[column]
    if dtype == pl.String:
        return pl.col(column)
    if dtype.is_numeric() or dtype == pl.Boolean:
        return pl.col(column).cast(pl.String)
    return pl.lit(None, dtype=pl.String)


def _as_float(frame: pl.DataFrame, column: str | None) -> pl.Expr:
    if column is None or column not in frame.columns:
        return pl.lit(None, dtype=pl.Float64)
    return pl.col(column).cast(pl.Float64, strict=False)


def _standard_rows(frame: pl.DataFrame, speaker: str | None, quality: str | None) -> pl.DataFrame:
    """The ``_id``, ``_text``, ``_lang`` and ``_origin`` columns a reader prepared, and the
    ``speaker`` and ``quality`` fields, as ``ROW_SCHEMA`` columns (``shard``, ``duration_s`` and
    ``tar_member_name`` come from the caller); a transcript loses a leading language tag."""
    return frame.select(
        pl.col("_id").cast(pl.String).alias("segment_id"),
        pl.col("_text")
        .map_batches(_strip_tags, return_dtype=pl.String)
        .alias("transcription_native"),
        pl.col("_lang").cast(pl.String).alias("segment_language"),
        _as_string(frame, speaker).alias("speaker_id"),
        _as_float(frame, quality).alias("tx_quality_score"),
        pl.col("_origin").alias("origin"),
    )


def _strip_tags(texts: pl.Series) -> pl.Series:
    # a transcript written with this project's tag ("<|hi|> ...") keeps only its words
    return texts.str.replace(r"^\s*<\|[^|<>\s]*\|>\s?", "")


def _fill_languages(rows: pl.DataFrame, shards: Sequence[Shard]) -> pl.DataFrame:
    """Rows with neither a language of their own nor one from their shard get the language their
    transcript's script names (SCRIPT_VOTE_THRESHOLD of its letters in one script), where one does
    (Devanagari does not); the rest keep none."""
    from script_languages import detect_corrections

    shard_lang = pl.Series([s.lang for s in shards], dtype=pl.String).gather(rows["shard"])
    own = rows["segment_language"].str.strip_chars()
    missing = (own.is_null() | (own == "")) & (shard_lang == "")
    if not missing.any():
        return rows
    where = missing.arg_true()
    texts = rows["transcription_native"].gather(where).fill_null("")
    nothing = pl.Series([None] * len(where), dtype=pl.String)
    detected, _ = detect_corrections(texts, nothing, config.SCRIPT_VOTE_THRESHOLD)
    return rows.with_columns(rows["segment_language"].scatter(where, detected))


class RowIds:
    """The segment_ids of one source's rows, in the order the source lists them.

    A row whose own id (``id_field``) is set, and not taken by an earlier row of the source, gets
    ``<name>/<own id>``; any other row gets ``<name>:<where>``, its place in the source (its line,
    or its parquet file and row). A name holds neither "/" nor ":" and is unique in a build
    (``parse_source``, ``build_manifest.sources_of``), so the two forms never meet and two sources
    never share an id, whatever ids they carry; the same files give the same ids on every rerun.
    An own id repeated within a source (FLEURS numbers sentences, not recordings) does not make
    two recordings one: the later rows take their place instead. Own ids already taken are
    remembered as 64-bit hashes across batches; a hash collision only gives a row its place-id.
    """

    def __init__(self, name: str):
        self.name = name
        self._taken = np.empty(0, dtype=np.uint64)

    def assign(self, own: pl.Series, where: pl.Series) -> pl.Series:
        own = own.cast(pl.String).str.strip_chars()
        hashes = own.hash().to_numpy()
        before = np.zeros(len(own), bool)
        if len(self._taken):
            at = np.minimum(np.searchsorted(self._taken, hashes), len(self._taken) - 1)
            before = self._taken[at] == hashes
        usable = (own.is_not_null() & (own != "")).fill_null(False).to_numpy()
        first = own.is_first_distinct().to_numpy()
        take = usable & first & ~before
        new = np.unique(hashes[take])
        self._taken = np.insert(self._taken, np.searchsorted(self._taken, new), new)
        return pl.select(
            pl.when(pl.lit(pl.Series(take)))
            .then(pl.concat_str(pl.lit(f"{self.name}/"), pl.lit(own)))
            .otherwise(pl.concat_str(pl.lit(f"{self.name}:"), pl.lit(where.cast(pl.String))))
            .alias("segment_id")
        ).to_series()


def _bad(origin: str, reason: str, detail: str, lang: str | None = None) -> dict:
    assert reason in BAD_ROW_REASONS, reason
    return {"origin": origin, "reason": reason, "detail": detail, "lang": lang}


def _groups_by_directory(
    paths: pl.Series, name: str, lang: str, scored: bool, base: Path
) -> tuple[pl.Series, pl.Series, list[Shard]]:
    """(shard position, file name) per path and one Shard per distinct directory, in path order;
    the shard id is ``<name>/<directory relative to base>`` (or its absolute path without the
    leading "/" when it is outside ``base``)."""
    dirs = paths.str.replace(r"/[^/]*$", "")
    names = paths.str.replace(r"^.*/", "")
    unique = dirs.unique(maintain_order=True)
    position = pl.DataFrame({"d": unique, "p": pl.Series(range(len(unique)), dtype=pl.UInt32)})
    shard = pl.DataFrame({"d": dirs}).join(position, on="d", how="left", maintain_order="left")
    base_text = os.path.abspath(base).rstrip("/") + "/"
    shards = []
    for directory in unique.to_list():
        rel = directory[len(base_text) :] if directory.startswith(base_text) else directory
        rel = rel.strip("/") or "."
        shards.append(Shard(f"{name}/{rel}", name, lang, Path(directory), scored))
    return shard.get_column("p"), names, shards


def _probe(paths: Sequence[str], workers: int) -> tuple[np.ndarray, list[str | None]]:
    """(seconds per file, NaN where it failed; the failure per file: ``audio_not_found``,
    ``audio_unreadable`` with the reason, or None), read from the headers on ``workers`` threads
    (libsndfile runs without the GIL)."""

    def one(path: str) -> tuple[float, str | None]:
        try:
            info = sf.info(path)
        except FileNotFoundError:
            return float("nan"), "audio_not_found"
        except (sf.LibsndfileError, RuntimeError, OSError) as exc:
            if not os.path.exists(path):
                return float("nan"), "audio_not_found"
            return float("nan"), f"audio_unreadable:{exc}"
        if info.frames <= 0 or info.samplerate <= 0:
            return float("nan"), "audio_unreadable:no samples"
        return info.frames / info.samplerate, None

    results = _on_threads(one, paths, workers)
    seconds = np.array([s for s, _ in results], dtype=np.float64).reshape(len(paths))
    return seconds, [problem for _, problem in results]


def _exists(paths: pl.Series | Sequence[str], workers: int) -> np.ndarray:
    """Whether each path names an existing entry. Where the paths are many per directory, each
    directory is listed once (a listing returns thousands of names in the time of a few stat
    calls) and the paths are matched to the listings by a 64-bit hash (a false match needs a hash
    collision: odds about 1e-7 for a million paths); otherwise each path is looked up."""
    paths = pl.Series(paths, dtype=pl.String)
    dirs = paths.str.replace(r"/[^/]*$", "").unique().to_list()
    if len(paths) < 16 * len(dirs):
        found = _on_threads(os.path.isfile, paths.to_list(), workers)
        return np.array(found, dtype=bool).reshape(-1)

    def listing(directory: str) -> pl.Series:
        try:
            names = os.listdir(directory)
        except OSError:
            names = []
        return (directory + "/" + pl.Series(names, dtype=pl.String)).hash()

    listed = pl.concat(_on_threads(listing, dirs, workers, chunk=1))
    return paths.hash().is_in(listed.implode()).to_numpy()


def _on_threads(function, items: Sequence, workers: int, chunk: int = 2048) -> list:
    """``[function(x) for x in items]`` on ``workers`` threads, a chunk of items per task (a task
    per item would cost more than a stat call)."""
    chunks = [items[i : i + chunk] for i in range(0, len(items), chunk)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        done = pool.map(lambda part: [function(x) for x in part], chunks)
        return [result for part in done for result in part]


def _mismatch(given: float, header: float) -> bool:
    return abs(given - header) > DURATION_TOLERANCE + 0.01 * header


def _check_audio(
    paths: pl.Series,
    given: pl.Series,
    origins: Callable[[int], str],
    langs: pl.Series,
    mode: str,
    workers: int,
) -> tuple[pl.Series, np.ndarray, list[dict]]:
    """(duration per row, rows to keep, bad rows) for audio files used where they are: headers
    read for every row (``mode`` ``header``) or for the rows without a duration (``exists``: the
    others are looked up; ``none``: the others are trusted)."""
    given_np = given.cast(pl.Float64).to_numpy().copy()
    keep = np.ones(len(paths), bool)
    bad = []
    trusted = ~np.isnan(given_np) if mode != "header" else np.zeros(len(paths), bool)
    if mode == "exists" and trusted.any():
        rows = np.flatnonzero(trusted)
        for i in rows[~_exists(paths.gather(rows), workers)]:
            keep[i] = False
            bad.append(_bad(origins(int(i)), "audio_not_found", paths[int(i)], langs[int(i)]))
    probe = np.flatnonzero(~trusted)
    probe_paths = paths.gather(probe).to_list()
    seconds, problems = _probe(probe_paths, workers)
    for i, path, s, problem in zip(probe, probe_paths, seconds, problems):
        i = int(i)
        if problem is not None:
            reason, _, why = problem.partition(":")
            keep[i] = False
            detail = path + (f": {why}" if why else "")
            bad.append(_bad(origins(i), reason, detail, langs[i]))
        elif np.isnan(given_np[i]):
            given_np[i] = s
        elif _mismatch(given_np[i], s):
            keep[i] = False
            bad.append(
                _bad(
                    origins(i),
                    "duration_mismatch",
                    f"{path}: duration {given_np[i]:g} s, the audio holds {s:.3f} s",
                    langs[i],
                )
            )
    bad.sort(key=lambda b: origin_order(b["origin"]))
    return pl.Series("duration_s", given_np), keep, bad


def origin_order(origin: str) -> tuple[str, int]:
    """The sort key of a row's origin, ``file:line`` or ``file row N``: file, then line or row."""
    match = _ORIGIN.fullmatch(origin)
    return (match[1], int(match[2])) if match else (origin, 0)


_ORIGIN = re.compile(r"(.*)(?::| row )(\d+)")


def _write_flac(path: Path, data: np.ndarray, rate: int, subtype: str | None) -> None:
    pcm = subtype if subtype in ("PCM_16", "PCM_24", "PCM_S8") else "PCM_16"
    atomic_write(path, lambda tmp: sf.write(tmp, data, rate, format="FLAC", subtype=pcm))


_ERROR_OPENING = re.compile(r"^Error opening .*?: ")


def _audio_bytes_to_flac(data: bytes, out: Path) -> float:
    """Write encoded audio ``data`` to ``out`` as FLAC (FLAC bytes as they are, once they decode);
    return its seconds. Raises ValueError when it does not decode."""
    try:
        info = sf.info(io.BytesIO(data))
        if data[:4] == b"fLaC":
            atomic_write(out, lambda tmp: Path(tmp).write_bytes(data))
        else:
            samples, rate = sf.read(io.BytesIO(data), always_2d=True, dtype="float32")
            _write_flac(out, samples, rate, info.subtype)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise ValueError(f"does not decode: {_ERROR_OPENING.sub('', str(exc))}") from None
    if info.frames <= 0:
        raise ValueError("no samples")
    return info.frames / info.samplerate


def _unit_done(folder: Path) -> dict | None:
    """The record of a unit written before (``DONE_MARKER``), or None."""
    try:
        return json.loads((folder / DONE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _mark_done(folder: Path, record: dict) -> None:
    text = json.dumps(record, ensure_ascii=False)
    atomic_write(folder / DONE_MARKER, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _in_processes(function, tasks: list, workers: int) -> Iterator:
    """``function`` over ``tasks`` in forked processes (one task per call), results in task order."""
    if workers <= 1 or len(tasks) <= 1:
        yield from map(function, tasks)
        return
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(
        min(workers, len(tasks)), mp_context=context
    ) as pool:
        yield from pool.map(function, tasks)


# --- NeMo JSON -----------------------------------------------------------------------------
_CHUNK_BYTES = 16 << 20
_INFER_ROWS = 10_000  # rows whose fields and types decide a manifest's columns on the fast path


def _json_chunks(path: Path) -> Iterator[tuple[int, bytes]]:
    """(number of the chunk's first line, whole lines) of the file, about ``_CHUNK_BYTES`` each,
    cut from a memory map of it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            start, line = 0, 1
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
    try:
        frame = pl.read_ndjson(path, infer_schema_length=_INFER_ROWS)
        if frame.height and frame.height == _line_count(path):
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


def read_nemo(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> SourceRows | Iterator[SourceRows]:
    """A NeMo JSON manifest: one object per line with ``audio_filepath``, ``text`` and usually
    ``duration`` (other fields per ``FIELDS``). A relative audio path is resolved against the
    manifest's folder, as NeMo does. With ``tars``, the audio paths are member names of the tars
    (the row's ``shard_id`` field, when present, names its tar), written out once as FLAC, and the
    rows come as one batch; without, in batches of about ``_CHUNK_BYTES`` of the file."""
    if "tars" not in spec.options:
        return _nemo_batches(spec, out_dir, workers, progress)
    frame, bad = _read_json_rows(spec.path)
    if not frame.height and not bad:
        raise ManifestError(f"{spec.path}: no rows")
    frame, fields = _nemo_fields(spec, frame, bad, first=True, ids=RowIds(spec.name))
    return _nemo_tarred(spec, frame, out_dir, bad, workers, progress, fields)


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
    an audio field (ManifestError naming the fields it has); a later one without is all bad."""
    path = spec.path
    columns = [c for c in frame.columns if c != "line"]
    audio = _pick(spec, "audio", columns, required=first)
    fields = {
        "text": _pick(spec, "text", columns),
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


def _lang_expr(spec: SourceSpec, frame: pl.DataFrame, lang: str | None) -> pl.Expr:
    if "lang" in spec.options:
        return pl.lit(spec.options["lang"], dtype=pl.String)
    return _as_string(frame, lang)


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
    """``read_nemo`` for a tarred manifest: the tars written out as FLAC, rows matched to them."""
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


# --- Hugging Face audio parquet ------------------------------------------------------------------
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


# --- Kaldi data directory --------------------------------------------------------------------
def _kaldi_lines(path: Path, undecodable: list) -> Iterator[tuple[int, str, str]]:
    """``(line number, key, rest of the line)`` of a Kaldi table file, fields split on any
    whitespace (Kaldi's tables take spaces and tabs alike). A line that is not UTF-8 goes into
    ``undecodable`` as ``(key, "file:line", why)``, its key read with surrogate escapes so that it
    still matches the same bytes in the other files."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            parts = raw.split(maxsplit=1)
            if not parts:
                continue
            try:
                key = parts[0].decode("utf-8")
                rest = parts[1].decode("utf-8").strip() if len(parts) > 1 else ""
            except UnicodeDecodeError as exc:
                key = parts[0].decode("utf-8", "surrogateescape")
                why = f"not UTF-8 ({exc.reason}, byte {exc.object[exc.start : exc.start + 1]!r})"
                undecodable.append(
                    (key, f"{path}:{number}", f"{why}: re-encode {path.name} as UTF-8")
                )
                continue
            yield number, key, rest


def _kaldi_table(
    path: Path, required: bool, undecodable: dict[str, tuple[str, str]]
) -> dict[str, tuple[str, int]]:
    """``key -> (rest of the line, line number)`` of a Kaldi table file (``key value...``); the
    keys of its lines that are not UTF-8 go into ``undecodable`` as ``key -> (file:line, why)``."""
    if not path.is_file():
        if required:
            raise ManifestError(f"{path} not found: a Kaldi data directory needs wav.scp and text")
        return {}
    lost: list = []
    table = {key: (rest, number) for number, key, rest in _kaldi_lines(path, lost)}
    for key, origin, why in lost:
        undecodable.setdefault(key, (origin, why))
    return table


_PLAIN_NAME = re.compile(r"[\w+-][\w.+-]*")
_UNSAFE = re.compile(r"[^\w.+-]")


def _file_name(key: str) -> str:
    """A file name of its own for ``key`` (an utterance, recording or tar member): the key itself
    when it is a plain name without "__"; else its characters outside letters, digits and
    ``._+-`` as "_", then "__" and a digest of the key. A plain name never holds "__" and every
    other name does, so two keys get one name only through a 48-bit digest collision."""
    if _PLAIN_NAME.fullmatch(key) and "__" not in key and len(key) <= 200:
        return key
    import hashlib

    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=6).hexdigest()
    return f"{_UNSAFE.sub('_', key)[:100]}__{digest}"


def _valid_segment(start: float, end: float | None) -> str | None:
    """Why ``[start, end)`` (seconds; end None: to the end of the file) cannot be a segment, or
    None: soundfile reads a negative start from the file's end, so it would cut the wrong audio."""
    if not np.isfinite(start) or start < 0:
        return f"start {start:g} s: expected a number >= 0"
    if end is not None and (not np.isfinite(end) or end <= start):
        return f"segment {start:g}-{end:g} s: expected an end after its start"
    return None


def _cut_recording(task: tuple[str, str, list[tuple[str, float, float]]]) -> dict:
    """Write each (utterance, start, end) of one recording to ``<folder>/<_file_name(utt)>.flac``
    (end -1: to the recording's end), then the done marker: ``{"seconds": {utt: s}, "files":
    {utt: file}, "bad": {utt: reason}, "recording_seconds": s}``. A segment ending past the
    recording's end is bad."""
    recording, folder, segments = task
    folder_path = Path(folder)
    done = _unit_done(folder_path)
    if (
        done is not None
        and "files" in done
        and all(u in done["seconds"] or u in done["bad"] for u, *_ in segments)
    ):
        return done  # written before (asked for other segments now, or named otherwise: cut again)
    folder_path.mkdir(parents=True, exist_ok=True)
    try:
        info = sf.info(recording)
    except (sf.LibsndfileError, RuntimeError, OSError) as exc:
        reason = "audio_not_found" if not os.path.exists(recording) else "audio_unreadable"
        return {"error": reason, "detail": f"{recording}: {exc}"}
    total = info.frames / info.samplerate
    seconds, files, bad = {}, {}, {}
    for utt, start, end in segments:
        end = total if end < 0 else end
        if start < 0 or end > total + DURATION_TOLERANCE or start >= min(end, total):
            bad[utt] = f"segment {start:g}-{end:g} s, the recording holds {total:.3f} s"
            continue
        first, last = (
            int(round(start * info.samplerate)),
            int(round(min(end, total) * info.samplerate)),
        )
        samples, rate = sf.read(recording, start=first, stop=last, always_2d=True, dtype="float32")
        files[utt] = f"{_file_name(utt)}.flac"
        _write_flac(folder_path / files[utt], samples, rate, info.subtype)
        seconds[utt] = len(samples) / rate
    record = {
        "recording": recording,
        "seconds": seconds,
        "files": files,
        "bad": bad,
        "recording_seconds": total,
    }
    _mark_done(folder_path, record)
    return record


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if np.isfinite(value) and value > 0 else None


def read_kaldi(
    spec: SourceSpec, out_dir: Path, *, workers: int, progress: bool = True
) -> SourceRows:
    """A Kaldi data directory: ``wav.scp`` (recording -> audio file; a command ending in "|" is not
    run: convert those first) and ``text``; optional ``segments`` (cut out once as FLAC),
    ``utt2spk``, ``utt2lang`` and ``utt2dur`` (a value that is not a positive number is ignored:
    the audio header gives the duration). Fields are separated by any whitespace. A line that is
    not UTF-8 makes the utterances it speaks of bad rows (``not_utf8``) with its file and line."""
    directory = spec.path
    segments_path = directory / "segments"
    segmented = segments_path.is_file()
    bad_recordings: dict[str, tuple[str, str]] = {}
    bad_utts: dict[str, tuple[str, str]] = {}
    wav = _kaldi_table(directory / "wav.scp", True, bad_recordings)
    texts = _kaldi_table(directory / "text", True, bad_utts)
    speakers = _kaldi_table(directory / "utt2spk", False, bad_utts)
    langs = _kaldi_table(directory / "utt2lang", False, bad_utts)
    durs = _kaldi_table(directory / "utt2dur", False, bad_utts)
    fixed = spec.options.get("lang")
    bad: list[dict] = []

    def lang_of(utt: str) -> str | None:
        return fixed or langs.get(utt, (None,))[0]

    utterances = []  # (utt, recording, start, end, line, origin)
    if segmented:
        listing: list = []
        for number, utt, rest in _kaldi_lines(segments_path, listing):
            origin = f"{segments_path}:{number}"
            parts = rest.split()
            try:
                recording, start, end = parts[0], float(parts[1]), float(parts[2])
            except (IndexError, ValueError):
                bad.append(_bad(origin, "audio_path_missing", f"{utt} {rest}"))
                continue
            problem = _valid_segment(start, None if end < 0 else end)
            if problem is not None:
                bad.append(_bad(origin, "segment_invalid", problem, lang_of(utt)))
                continue
            utterances.append((utt, recording, start, end, number, origin))
    else:
        listing = [(r, origin, why) for r, (origin, why) in bad_recordings.items()]
        bad_recordings = {}
        utterances = [
            (r, r, 0.0, -1.0, n, f"{directory / 'wav.scp'}:{n}") for r, (_, n) in wav.items()
        ]
    bad += [_bad(origin, "not_utf8", why) for _, origin, why in listing]
    kept, by_recording = [], {}
    for utt, recording, start, end, line, origin in utterances:
        undecodable = bad_utts.get(utt) or bad_recordings.get(recording)
        if undecodable is not None:
            bad.append(_bad(undecodable[0], "not_utf8", undecodable[1], lang_of(utt)))
        elif recording not in wav:
            bad.append(
                _bad(
                    origin, "audio_not_found", f"recording {recording} not in wav.scp", lang_of(utt)
                )
            )
        elif wav[recording][0].endswith("|"):
            bad.append(
                _bad(
                    origin,
                    "audio_command",
                    f"{recording}: wav.scp runs a command; write the "
                    f"audio to files first (e.g. wav-copy, sox)",
                    lang_of(utt),
                )
            )
        elif utt not in texts:
            bad.append(
                _bad(
                    origin, "transcript_missing", f"{utt} not in {directory / 'text'}", lang_of(utt)
                )
            )
        else:
            kept.append((utt, recording, start, end, line, origin))
            by_recording.setdefault(recording, []).append((utt, start, end))
    segment_ids = RowIds(spec.name).assign(
        pl.Series([u for u, *_ in kept], dtype=pl.String),
        pl.Series([line for *_, line, _ in kept], dtype=pl.UInt32),
    )

    def resolve(recording: str) -> str:
        audio = Path(wav[recording][0])
        return str(audio if audio.is_absolute() else (directory / audio).absolute())

    records: dict[str, dict] = {}
    if segmented:
        recordings = sorted(by_recording)
        folders = {r: str(out_dir / _file_name(r)) for r in recordings}
        tasks = [(resolve(r), folders[r], by_recording[r]) for r in recordings]
        from tqdm import tqdm

        with tqdm(
            total=len(tasks),
            desc=f"cutting {spec.name} segments",
            unit="recording",
            disable=not progress,
        ) as bar:
            for recording, record in zip(recordings, _in_processes(_cut_recording, tasks, workers)):
                records[recording] = record
                bar.update(1)
        shards = [
            Shard(f"{spec.name}/{r}", spec.name, "", Path(folders[r]), False) for r in recordings
        ]
        position = {r: k for k, r in enumerate(recordings)}
        rows = []
        for (utt, recording, start, end, line, origin), segment_id in zip(kept, segment_ids):
            record = records[recording]
            if "error" in record:
                bad.append(_bad(origin, record["error"], record["detail"], lang_of(utt)))
            elif utt in record["bad"]:
                bad.append(_bad(origin, "segment_past_end", record["bad"][utt], lang_of(utt)))
            else:
                rows.append(
                    (
                        position[recording],
                        segment_id,
                        texts[utt][0],
                        lang_of(utt),
                        speakers.get(utt, (None,))[0],
                        record["seconds"][utt],
                        None,
                        record["files"][utt],
                        origin,
                    )
                )
        frame = pl.DataFrame(rows, schema=ROW_SCHEMA, orient="row")
    else:
        paths = pl.Series([resolve(r) for r, *_ in kept], dtype=pl.String)
        given = pl.Series(
            [_seconds(durs[u][0]) if u in durs else None for u, *_ in kept], dtype=pl.Float64
        )
        origins = [o for *_, o in kept]
        seconds, keep, audio_bad = _check_audio(
            paths,
            given,
            lambda i: origins[i],
            pl.Series([lang_of(u) for u, *_ in kept], dtype=pl.String),
            spec.options.get("check", "header"),
            workers,
        )
        bad += audio_bad
        shard, names, shards = _groups_by_directory(paths, spec.name, "", False, directory)
        frame = pl.DataFrame(
            {
                "shard": shard,
                "segment_id": segment_ids,
                "transcription_native": [texts[u][0] for u, *_ in kept],
                "segment_language": [lang_of(u) for u, *_ in kept],
                "speaker_id": [speakers.get(u, (None,))[0] for u, *_ in kept],
                "duration_s": seconds,
                "tx_quality_score": pl.Series([None] * len(kept), dtype=pl.Float64),
                "tar_member_name": names,
                "origin": origins,
            },
            schema=ROW_SCHEMA,
        ).filter(pl.Series(keep))
    frame = frame.with_columns(
        pl.col("transcription_native").map_batches(_strip_tags, return_dtype=pl.String)
    )
    bad.sort(key=lambda b: origin_order(b["origin"]))
    return SourceRows(frame, shards, bad)
