"""The manifest contract: its columns, the shard files it is built from, the ``<|lang|>`` tag of its
transcripts, its summaries, and the readers and writers every manifest step shares.

Manifests (master, train and validation alike) are parquet files, one row per utterance:

    segment_id        unique utterance id
    shard_id          the group the audio came in: a shard's path under SHARDS_DIR,
                      "<source>/<lang>/<shard>"; for an imported source "<source>/<group>" (a tar
                      shard, a parquet file, a recording, an audio directory)
    text              ``tagged_text(lang, transcript)``: "<|hi|> नमस्ते दुनिया"; the transcript is
                      cleaned (build_manifest.clean_text) and not empty
    duration          seconds
    lang              language code matching ``LANG_CODE_PATTERN``; ``text`` starts with its tag
    audio_filepath    the utterance's audio file (absolute path; FLAC or WAV, any rate and channels)
    source            the ``<source>`` directory, or the name of an imported source
then ``EXTRA_COLUMNS``, carried through for deduplication and the leak-free split:
    tx_quality_score  transcript quality from the shard metadata (nullable)
    speaker_id        speaker from the shard metadata (nullable)

``audio_filepath`` is the one place that says where a row's audio is: every reader of audio goes
through ``audio_path_expr`` or ``audio_dirs_and_names``. Manifests written before the column existed
name the audio as ``dirname(tar_path)/tar_member_name`` (``LEGACY_AUDIO_COLUMNS``); both functions
read either form, so those manifests still load unchanged.

A shard is a directory ``<SHARDS_DIR>/<source>/<lang>/<shard>/`` holding ``METADATA_FILE``,
``INDEX_FILE`` and ``TAR_FILE``. Every step that writes a manifest writes its summary (rows in,
kept, dropped per reason and per language) at ``summary_path(manifest)``.

Only the standard library is imported at load: dataset.py and the training callbacks import this
module in every training process and DataLoader worker, which have no use for polars; the
functions that take or build polars or pyarrow objects import them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from atomic_files import atomic_write
from process_control import UserError

if TYPE_CHECKING:
    import polars as pl
    import pyarrow as pa

OUTPUT_COLUMNS = (
    "segment_id",
    "shard_id",
    "text",
    "duration",
    "lang",
    "audio_filepath",
    "source",
)
AUDIO_COLUMN = "audio_filepath"
# How manifests written before AUDIO_COLUMN named their audio: dirname(tar_path)/tar_member_name.
LEGACY_AUDIO_COLUMNS = ("tar_path", "tar_member_name")
EXTRA_COLUMNS = ("tx_quality_score", "speaker_id")
METADATA_FILE = "metadata.parquet"
INDEX_FILE = "audio_index.parquet"
TAR_FILE = "audio.tar"
SUMMARY_SUFFIX = ".summary.json"
# A plain language code ("hi", "en-in", "mni"): what a ``lang`` value, and so a tag, may hold.
LANG_CODE_PATTERN = r"^[a-z][a-z0-9_-]*$"
# The language of a row whose language is not known (ISO 639's "undetermined"): scored under that
# name, and decoded auto, as a row that names no language (there is no tag to start from).
UNKNOWN_LANG = "und"


def known_lang(lang: str | None) -> str | None:
    """``lang``, or None where it names no language: None, empty or ``UNKNOWN_LANG``."""
    return None if not lang or lang == UNKNOWN_LANG else lang


# --- the language tag ------------------------------------------------------------------------
_OPEN, _CLOSE, _SEPARATOR = "<|", "|>", " "
_TAG_BODY = r"[^|<>\s]*"  # what a regex takes for the language inside a tag
# Any tag, anywhere in a text: what ``strip_lang_tag`` removes.
TAG_PATTERN = rf"<\|{_TAG_BODY}\|>"
_TAG = re.compile(TAG_PATTERN)
# A tag at the start of a text and the one separator after it (a text may be the bare tag).
_LEADING_TAG = rf"^<\|(?P<lang>{_TAG_BODY})\|>(?: |$)"


def lang_tag(lang: str) -> str:
    """The tag of a language, one tokenizer piece: ``lang_tag("hi") == "<|hi|>"``."""
    return f"{_OPEN}{lang}{_CLOSE}"


def tag_prefix(lang: str) -> str:
    """What every manifest text of ``lang`` starts with: ``tag_prefix("hi") == "<|hi|> "``."""
    return lang_tag(lang) + _SEPARATOR


def tagged_text(lang: str, transcript: str) -> str:
    """A manifest text: ``tagged_text("hi", "नमस्ते") == "<|hi|> नमस्ते"``."""
    return tag_prefix(lang) + transcript


def tag_prefix_expr(lang_col: str | pl.Expr = "lang") -> pl.Expr:
    """``tag_prefix`` of each row's language as a polars expression (null where the language is)."""
    import polars as pl

    return pl.concat_str(pl.lit(_OPEN), lang_col, pl.lit(_CLOSE + _SEPARATOR))


def tagged_text_expr(transcript: str | pl.Expr, lang_col: str | pl.Expr = "lang") -> pl.Expr:
    """``tagged_text`` of each row as a polars expression (null where the language or the
    transcript is); a str names a column."""
    import polars as pl

    return pl.concat_str(pl.lit(_OPEN), lang_col, pl.lit(_CLOSE + _SEPARATOR), transcript)


_FIRST_TAG = re.compile(rf"\s*{re.escape(_OPEN)}({_TAG_BODY}){re.escape(_CLOSE)}")


def leading_lang(text: str) -> str | None:
    """The language of the tag ``text`` starts with (leading spaces aside), or None:
    ``leading_lang("<|hi|> नमस्ते") == "hi"``."""
    match = _FIRST_TAG.match(text)
    return match.group(1) or None if match else None


def strip_lang_tag(text: str) -> str:
    """``text`` without any ``<|lang|>`` tag, whitespace collapsed to single spaces."""
    return " ".join(_TAG.sub(" ", text).split())


def split_lang_tags(texts: pa.Array | pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
    """(languages, transcripts) of manifest texts, vectorized: "<|hi|> नमस्ते" -> ("hi", "नमस्ते").

    A text splits when it starts with a tag followed by one space or by its end (the bare tag
    gives an empty transcript). Where it does not (or is null), the language is null and the
    transcript is the text unchanged; callers decide whether that is an error. Both come back
    chunked when ``texts`` is.
    """
    import pyarrow.compute as pc

    langs = pc.struct_field(pc.extract_regex(texts, _LEADING_TAG), [0])  # null where no match
    transcripts = pc.replace_substring_regex(texts, _LEADING_TAG, "", max_replacements=1)
    return langs, transcripts


# --- readers and writers -----------------------------------------------------------------------
class ManifestError(UserError, RuntimeError):
    """Input a manifest step cannot use (missing SHARDS_DIR, no shards, a bad shard or manifest);
    the message names the path and what is wrong with it."""


# A UTF-8 byte-order mark: what Windows tools and spreadsheets put at the start of a UTF-8 file.
UTF8_BOM = b"\xef\xbb\xbf"
# The byte-order marks of the encodings a spreadsheet's "Unicode text" is saved in (UTF-32 first:
# its little-endian mark begins with UTF-16's).
_OTHER_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def text_start(path: str | Path, head: bytes) -> int:
    """Where the text of a UTF-8 text file whose first bytes are ``head`` (4 or more, or the whole
    file) begins: after a UTF-8 byte-order mark (3), else at 0. Every text input a manifest step
    reads (TSV, CSV, JSON lines, Kaldi tables) starts there, so a file saved with a mark reads as
    one without. A file starting with a UTF-16 or UTF-32 mark is a ManifestError naming it."""
    if head.startswith(UTF8_BOM):
        return len(UTF8_BOM)
    for mark, encoding in _OTHER_BOMS:
        if head.startswith(mark):
            raise ManifestError(
                f"{path}: {encoding} text (its byte-order mark says so); re-save it as UTF-8"
            )
    return 0


def summary_path(manifest: str | Path) -> Path:
    """The summary beside a manifest: ``<manifest minus .parquet>.summary.json``."""
    manifest = Path(manifest)
    stem = manifest.name.removesuffix(".parquet")
    return manifest.with_name(stem + SUMMARY_SUFFIX)


def write_manifest_file(
    frame: pl.DataFrame, path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write ``frame`` to ``path`` with the writer settings every manifest uses (and ``metadata`` as
    parquet key-value metadata); no temporary file: see ``write_manifest`` for that."""
    frame.write_parquet(
        path, compression="zstd", compression_level=1, statistics=False, metadata=metadata
    )


def write_manifest(frame: pl.DataFrame, path: str | Path) -> None:
    """Write ``frame`` as parquet to a temp file beside ``path`` and rename it over ``path``
    (``atomic_write``): a crash never leaves a partial manifest under its name."""
    atomic_write(path, lambda tmp: write_manifest_file(frame, tmp))


# The parquet metadata key make_train_val.py writes into both halves of one split (and its summary).
SPLIT_ID_KEY = "split_id"

# A source's own split of its rows (the master's optional ``split`` column): each name a source
# may give, and what make_train_val.py does with its rows: train on them, validate on them, or hold
# them out for the test manifest. Common Voice's validated, other and invalidated TSVs add only
# clips outside its train, dev and test, so they train.
SPLIT_COLUMN = "split"
SPLIT_ROLES = {
    "train": "train",
    "validated": "train",
    "other": "train",
    "invalidated": "train",
    "dev": "val",
    "validation": "val",
    "test": "test",
}
# What a source's ``split=`` option may name (source_readers).
SOURCE_SPLITS = ("train", "dev", "test")


def split_id(path: str | Path) -> str | None:
    """The split id in a manifest's parquet metadata, or None (a manifest written elsewhere)."""
    import pyarrow.parquet as pq

    meta = pq.read_metadata(path).metadata or {}
    value = meta.get(SPLIT_ID_KEY.encode())
    return value.decode() if value is not None else None


def check_same_split(train: str | Path, val: str | Path) -> None:
    """ManifestError when both manifests carry a split id and the ids differ: they come from
    different make_train_val runs (a crash between its renames), and validation may overlap train."""
    a, b = split_id(train), split_id(val)
    if a is not None and b is not None and a != b:
        raise ManifestError(
            f"{train} and {val} come from different make_train_val.py runs (split ids {a[:8]} and "
            f"{b[:8]}): validation rows may be in train. Rerun scripts/make_train_val.py"
        )


def check_language_selection(selected, seen, step: str) -> list[str]:
    """LANGUAGES (``selected``, lower-cased codes) against the languages the data has (``seen``):
    ManifestError naming the codes seen when no selected code has a row (nothing would be kept);
    else the selected codes no row has, which ``step`` should warn about."""
    if not selected:
        return []
    seen = sorted(str(code) for code in seen if code is not None)
    missing = [code for code in selected if code not in seen]
    if len(missing) == len(selected):
        raise ManifestError(
            f"LANGUAGES={','.join(selected)} keeps nothing: no row has "
            f"{'that language' if len(selected) == 1 else 'any of these languages'}. The data's "
            f"languages are {', '.join(seen) or '(none)'}; set LANGUAGES to some of them (or leave "
            f"it empty for all) and rerun {step}"
        )
    return missing


def json_text(data: dict) -> str:
    """``data`` as the pipeline writes every JSON summary: indented, keys sorted, UTF-8 as is."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_json_atomically(data: dict, path: str | Path) -> None:
    """Write ``json_text(data)`` to a temp file beside ``path`` and rename it over ``path``."""
    text = json_text(data)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def counts_by(frame: pl.DataFrame, *keys: str) -> dict:
    """Row counts as nested {key1: {key2: n}} (or {key: n}), keys sorted (an Enum key by name)."""
    import polars as pl

    out: dict = {}
    counts = frame.group_by(list(keys)).len()
    counts = counts.with_columns(
        pl.col(k).cast(pl.String) for k in keys if isinstance(counts.schema[k], pl.Enum)
    )
    for row in counts.sort(list(keys)).iter_rows():
        *path, n = row
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = int(n)
    return out


# --- NeMo JSON manifests ---------------------------------------------------------------------------
# One JSON object per line, as NeMo's ASR datasets, transcribe_speech.py and speech_to_text_eval.py
# read them: audio_filepath, duration, text (here without the language tag) and lang.
NEMO_JSON_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class NemoManifestRow:
    audio_filepath: str  # absolute, or as given when relative paths are resolved by the caller
    duration: float | None
    text: str | None
    lang: str | None


def is_nemo_json(path: str | Path) -> bool:
    """Whether ``path`` names a NeMo JSON manifest (by its suffix) rather than a parquet one."""
    return Path(path).suffix.lower() in NEMO_JSON_SUFFIXES


def read_nemo_manifest(path: str | Path) -> list[NemoManifestRow]:
    """The rows of a NeMo JSON manifest. A relative ``audio_filepath`` is resolved against the
    manifest's directory (as NeMo does); ``text`` loses a leading language tag, which gives ``lang``
    where the row has none. ManifestError names
    the file and line of a row that is not a JSON object with an ``audio_filepath``, or a ``duration``
    that is not a number."""
    path = Path(path)
    data = path.read_bytes()
    try:
        content = data[text_start(path, data[:4]) :].decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ManifestError(
            f"{path}:{line}: not UTF-8 ({exc.reason}); re-encode {path.name} as UTF-8"
        ) from None
    rows = []
    for number, line in enumerate(content.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ManifestError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not row.get("audio_filepath"):
            raise ManifestError(f"{path}:{number}: expected a JSON object with audio_filepath")
        audio = Path(str(row["audio_filepath"]))
        if not audio.is_absolute():
            audio = path.parent / audio
        duration = row.get("duration")
        if duration is not None and not isinstance(duration, (int, float)):
            raise ManifestError(f"{path}:{number}: duration {duration!r} is not a number")
        text = row.get("text")
        lang = row.get("lang") or (leading_lang(str(text)) if text is not None else None)
        rows.append(
            NemoManifestRow(
                str(audio),
                None if duration is None else float(duration),
                None if text is None else strip_lang_tag(str(text)),
                None if lang is None else str(lang),
            )
        )
    if not rows:
        raise ManifestError(f"{path}: no rows")
    return rows


def nemo_json_path(manifest: str | Path) -> Path:
    """The NeMo JSON manifest written beside a parquet one: ``<stem>.json``."""
    manifest = Path(manifest)
    return manifest.with_name(manifest.name.removesuffix(".parquet") + ".json")


def audio_columns(columns) -> list[str]:
    """The columns that locate a row's audio in a manifest with ``columns``: ``[AUDIO_COLUMN]``, or
    ``LEGACY_AUDIO_COLUMNS`` for a manifest written before it; ManifestError when it has neither."""
    columns = set(columns)
    if AUDIO_COLUMN in columns:
        return [AUDIO_COLUMN]
    if set(LEGACY_AUDIO_COLUMNS) <= columns:
        return list(LEGACY_AUDIO_COLUMNS)
    raise ManifestError(
        f"the manifest has no {AUDIO_COLUMN} column (nor the older "
        f"{' + '.join(LEGACY_AUDIO_COLUMNS)}): rebuild it with build_manifest.py and "
        f"scripts/make_train_val.py"
    )


def audio_path_expr(columns=(AUDIO_COLUMN,)) -> pl.Expr:
    """Each row's audio file as a polars expression named ``audio_filepath``, for a manifest with
    ``columns`` (see ``audio_columns``)."""
    import polars as pl

    if audio_columns(columns) == [AUDIO_COLUMN]:
        return pl.col(AUDIO_COLUMN)
    tar_path, member = LEGACY_AUDIO_COLUMNS
    return pl.concat_str(
        pl.col(tar_path).str.replace(r"/[^/]*$", ""), pl.lit("/"), pl.col(member)
    ).alias(AUDIO_COLUMN)


def with_audio_column(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with ``AUDIO_COLUMN`` in place of ``LEGACY_AUDIO_COLUMNS`` where it has those."""
    if AUDIO_COLUMN in frame.columns:
        return frame
    names = frame.columns
    frame = frame.with_columns(audio_path_expr(names))
    at = min(names.index(c) for c in LEGACY_AUDIO_COLUMNS)
    rest = [c for c in names if c not in LEGACY_AUDIO_COLUMNS]
    return frame.select(*rest[:at], AUDIO_COLUMN, *rest[at:])


def audio_dirs_and_names(columns: dict[str, pa.Array]) -> tuple[pa.DictionaryArray, pa.Array]:
    """(directory, file name) of each row's audio, from the ``audio_columns`` of a batch of manifest
    rows (``columns`` maps their names to arrays; a directory column may come dictionary-encoded).
    Directories come back dictionary-encoded: a corpus has few of them, so each is decoded once;
    the path is split at its last "/"."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if AUDIO_COLUMN in columns:
        paths = columns[AUDIO_COLUMN]
        if pa.types.is_dictionary(paths.type):
            paths = paths.cast(pa.string())
        dirs = pc.replace_substring_regex(paths, r"/[^/]*$", "", max_replacements=1)
        names = pc.replace_substring_regex(paths, r"^.*/", "", max_replacements=1)
        return dirs.dictionary_encode(), names
    tar_path, member = (columns[c] for c in LEGACY_AUDIO_COLUMNS)
    tars = tar_path if pa.types.is_dictionary(tar_path.type) else tar_path.dictionary_encode()
    dictionary = pc.replace_substring_regex(
        tars.dictionary.cast(pa.string()), r"/[^/]*$", "", max_replacements=1
    )
    dirs = pa.DictionaryArray.from_arrays(tars.indices, dictionary)
    if pa.types.is_dictionary(member.type):
        member = member.cast(pa.string())
    return dirs, member


def nemo_json_frame(frame: pl.DataFrame, keep_tag: bool = False) -> pl.DataFrame:
    """A manifest's rows in NeMo's columns, for ``write_ndjson``: ``audio_filepath``, ``duration``,
    ``text`` (without the language tag, unless ``keep_tag``), ``lang``. Vectorized: a 70M-row
    manifest is a few polars passes."""
    import polars as pl

    text = pl.col("text")
    return frame.select(
        audio_path_expr(frame.columns),
        pl.col("duration").cast(pl.Float64),
        (text if keep_tag else text.str.replace(rf"^{TAG_PATTERN} ?", "")).alias("text"),
        pl.col("lang"),
    )
