"""The standard rows every reader of source_readers produces: the source spec, the rows a reader
build_manifest.py, the bad-row reasons, and the audio checks and FLAC writing the readers use."""

from __future__ import annotations

import concurrent.futures
import io
import json
import multiprocessing
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import soundfile as sf

import config
from atomic_files import atomic_write
from manifest_schema import ManifestError

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
OPTIONS = frozenset({f"{k}_field" for k in FIELDS} | {"name", "lang", "tars", "check", "split"})
# A row's stated duration may differ from its audio header by this many seconds, plus 1 %. An MP3's
# encoder delay and padding frames, which a duration counted from its frames includes and
# libsndfile leaves out where the file has a Xing/Info header, measured 24-48 ms at 48 kHz and
# 37-71 ms at 32 kHz (LAME CBR and VBR; docs/bring_your_own_data.md): within it.
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
    "not_tsv",
    "clip_listed_twice",
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
    "reason", "detail", "lang"}``, the files skipped ``{"path", "reason"}``, and the rows the
    source's own options left out, counted per option (not bad: the user asked for it). A reader
    may add a ``split`` column (the source's own split of each row), which the master keeps."""

    rows: pl.DataFrame
    shards: list[Shard]
    bad: list[dict] = field(default_factory=list)
    bad_files: list[dict] = field(default_factory=list)
    left_out: dict[str, int] = field(default_factory=dict)


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


def _lang_expr(spec: SourceSpec, frame: pl.DataFrame, lang: str | None) -> pl.Expr:
    if "lang" in spec.options:
        return pl.lit(spec.options["lang"], dtype=pl.String)
    return _as_string(frame, lang)


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


# Where an MP3 encoder writes the stream's length: the first frame of LAME's and most encoders' VBR
# (Xing) and CBR (Info) files, Fraunhofer's VBRI.
_MP3_LENGTH_TAGS = (b"Xing", b"Info", b"VBRI")


def _mp3_without_length_tag(path: str) -> bool:
    """Whether ``path`` is an MP3 whose first frame holds no length tag (``_MP3_LENGTH_TAGS``), as
    an encoder writing to a pipe leaves it. libsndfile then takes the stream's length from the
    first frame's bitrate, and a variable-bitrate file decodes short: only that many samples."""
    if not path.lower().endswith(".mp3"):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    start = 0
    if head[:3] == b"ID3" and len(head) >= 10:  # an ID3v2 tag (its size: 4 x 7 bits) comes first
        size = 0
        for byte in head[6:10]:
            size = size << 7 | byte & 0x7F
        start = 10 + size
    sync = re.search(rb"\xff[\xe0-\xff]", head[start:])
    if sync is None:
        return False
    first = start + sync.start()
    return not any(tag in head[first : first + 200] for tag in _MP3_LENGTH_TAGS)


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
            detail = f"{path}: duration {given_np[i]:g} s, the audio holds {s:.3f} s"
            if s < given_np[i] and _mp3_without_length_tag(path):
                detail += (
                    " (an MP3 without a Xing/Info header, as an encoder writing to a pipe leaves "
                    "it: libsndfile decodes a variable-bitrate one short; re-encode it, e.g. to "
                    "FLAC)"
                )
            bad.append(_bad(origins(i), "duration_mismatch", detail, langs[i]))
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
