"""Turn the master manifest into the train and validation manifests ("v2"): correct language tags by
script, deduplicate, and split without leaks.

Usage:
    python scripts/make_train_val.py --help
    python scripts/make_train_val.py          # MASTER_MANIFEST_PATH -> TRAIN_/VAL_MANIFEST_PATH
    python scripts/make_train_val.py --val-per-lang 500 --lang-fixes fixes.csv --keep-duplicate-texts

Steps, in order (every dropped row is counted under its reason; rows in = train + val + dropped is
asserted and printed, and written to ``<train manifest minus .parquet>.summary.json``):

1. Language-tag correction by script. Each transcript's letters (Unicode letters and combining
   signs; digits, punctuation, dandas and ZWJ/ZWNJ do not vote) are counted per Unicode script.
   When one script holds at least SCRIPT_VOTE_THRESHOLD (0.9) of them, and the tag is not a
   language written in that script, the tag becomes that script's language:
       Tamil ta, Telugu te, Kannada kn, Malayalam ml, Gujarati gu, Gurmukhi pa, Oriya or,
       Latin en, Arabic (Perso-Arabic) ur (ks and sd, also written in it, are kept),
       Bengali: as when the text holds an Assamese-only letter (RA U+09F0 or WA U+09F1, tags other
       than mni), otherwise bn unless tagged as or mni (they share the script: not unambiguous).
   Devanagari is shared by hi, mr, ne, sa, ... and is never corrected from the script; a
   Devanagari text tagged with a language of another script is counted as an unresolved conflict.
   ``--lang-fixes FILE`` (CSV with header ``segment_id,lang``) then sets tags explicitly, for
   Devanagari or anything else. ``lang`` and the ``<|lang|>`` prefix of ``text`` always change
   together. The confusion table (given -> corrected) is printed and stored in the summary.
2. LANGUAGES (when set) is applied to the corrected tags: ``language_not_selected``.
3. Deduplication: one row per segment_id, the best tx_quality_score kept (``duplicate_segment_id``),
   then one per audio file (``duplicate_audio``: rows naming the same file are the same utterance);
   then rows with the same (lang, text, duration) as a better one (``duplicate_text``), unless
   ``--keep-duplicate-texts``. Ties break on shard_id, segment_id, so reruns keep the same rows.
4. Split. Rows are grouped by speaker where the manifest has one (non-null), else by shard_id;
   a whole group goes to one side, so no speaker (or shard) and no segment_id is in both. A
   speaker is (source, speaker_id) here and in the leak check: two corpora that both number their
   speakers "1" hold two people, unless ``--same-speakers A,B`` says sources A and B share
   speakers (Common Voice's client_id is one contributor in every locale). An id that several
   sources use is named in one warning line with that flag. Groups
   are ranked by a keyed BLAKE2 hash of (--seed, group) - stable across runs, machines and Python
   versions - and taken into validation in that order while they fit every one of their
   languages' quota: --val-per-lang rows, but at most VAL_MAX_FRACTION of the language's rows.
   A language whose groups do not fit exactly ends a little short; the summary says by how much.
   A language that gives validation more than VAL_WARN_FRACTION (a third) of its rows is warned
   about on stderr, one line each, with its train and validation rows and the flags that keep
   more for training (a small corpus under the default 50 % cap is the usual case).

Outputs are written atomically and sorted like the master manifest (shard_id, segment_id): the
same inputs give byte-identical outputs.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import hashlib
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

import config
from atomic_files import write_together
from manifest_schema import (
    LANG_CODE_PATTERN,
    LEGACY_AUDIO_COLUMNS,
    OUTPUT_COLUMNS,
    SPLIT_COLUMN,
    SPLIT_ID_KEY,
    SPLIT_ROLES,
    ManifestError,
    check_language_selection,
    counts_by,
    is_nemo_json,
    json_text,
    nemo_json_frame,
    nemo_json_path,
    summary_path,
    tag_prefix_expr,
    tagged_text_expr,
    text_start,
    with_audio_column,
    write_manifest_file,
)
from script_languages import SCRIPT_LANGUAGES, detect_corrections
from scripts.split_report import format_large_validation, format_shared_speaker_ids, format_summary
from transcript_style import STYLE_KEY, manifest_style


class SplitError(ManifestError):
    """Input make_train_val cannot use (missing manifest, columns, malformed text)."""


# --- input -----------------------------------------------------------------------------------
def load_master(path: Path) -> pl.DataFrame:
    """The master manifest, checked: required columns present, text prefixed by its own tag; the
    optional ``EXTRA_COLUMNS`` a master lacks are added as nulls (no score, no speaker)."""
    path = Path(path)
    if not path.is_file():
        raise SplitError(
            f"master manifest {path} not found: run build_manifest.py first, or set "
            f"MASTER_MANIFEST_PATH (or --master)"
        )
    if is_nemo_json(path):
        raise SplitError(
            f"{path} is a NeMo JSON manifest, not a master manifest: import it first with "
            f"python build_manifest.py --source nemo:{path} (see README, Bring your own data)"
        )
    try:
        frame = pl.read_parquet(path)
    except Exception as exc:
        raise SplitError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if set(LEGACY_AUDIO_COLUMNS) <= set(frame.columns):
        frame = with_audio_column(frame)
    missing = [c for c in OUTPUT_COLUMNS if c not in frame.columns]
    if missing:
        raise SplitError(
            f"{path}: missing column(s) {missing}; expected the build_manifest.py schema "
            f"{list(OUTPUT_COLUMNS)}"
        )
    # the optional columns (a source without speakers or scores, a master built before them)
    if "tx_quality_score" not in frame.columns:
        frame = frame.with_columns(pl.lit(None, dtype=pl.Float64).alias("tx_quality_score"))
    if "speaker_id" not in frame.columns:
        frame = frame.with_columns(pl.lit(None, dtype=pl.String).alias("speaker_id"))
    bad_prefix = frame.filter(
        ~pl.col("text").str.starts_with(tag_prefix_expr())
        | pl.col("text").is_null()
        | pl.col("lang").is_null()
    )
    if bad_prefix.height:
        first = bad_prefix.row(0, named=True)
        raise SplitError(
            f"{path}: {bad_prefix.height} row(s) whose text does not start with '<|lang|> ' "
            f"for their lang, e.g. segment_id={first['segment_id']!r} lang={first['lang']!r} "
            f"text={first['text'][:60] if first['text'] else None!r}; rebuild it with build_manifest.py"
        )
    return frame


def load_lang_fixes(path: Path) -> pl.DataFrame:
    """``segment_id,lang`` rows from a CSV; raises SplitError naming a bad header or code."""
    path = Path(path)
    if not path.is_file():
        raise SplitError(f"--lang-fixes {path}: file not found")
    with open(path, "rb") as f:
        try:
            text_start(path, f.read(4))  # polars reads a UTF-8 byte-order mark through
        except ManifestError as exc:
            raise SplitError(f"--lang-fixes {exc}") from None
    try:
        fixes = pl.read_csv(path, schema_overrides={"segment_id": pl.String, "lang": pl.String})
    except Exception as exc:
        raise SplitError(f"--lang-fixes {path}: unreadable CSV ({exc})") from None
    if fixes.columns[:2] != ["segment_id", "lang"]:
        raise SplitError(
            f"--lang-fixes {path}: expected the header 'segment_id,lang', got {fixes.columns}"
        )
    fixes = fixes.select(pl.col("segment_id"), pl.col("lang").str.strip_chars().str.to_lowercase())
    bad = fixes.filter(
        pl.col("segment_id").is_null()
        | ~pl.col("lang").str.contains(LANG_CODE_PATTERN).fill_null(False)
    )
    if bad.height:
        raise SplitError(
            f"--lang-fixes {path}: {bad.height} row(s) without a segment_id or with a bad "
            f"language code, first: {bad.row(0)}"
        )
    duplicated = (
        fixes.filter(pl.col("segment_id").is_duplicated())
        .group_by("segment_id")
        .agg(pl.col("lang").n_unique())
    )
    conflicting = duplicated.filter(pl.col("lang") > 1)
    if conflicting.height:
        raise SplitError(
            f"--lang-fixes {path}: segment_id {conflicting.item(0, 'segment_id')!r} is given "
            f"different languages"
        )
    return fixes.unique("segment_id", keep="first", maintain_order=True)


# --- speakers ------------------------------------------------------------------------------------
# The internal column holding each row's speaker (null: unknown), one value per person.
SPEAKER_KEY = "speaker_key"
# Between a speaker's namespace and its id where an id is used by more than one namespace: a
# character no speaker id holds in practice, so the two forms of a key never meet.
_NAMESPACE_SEPARATOR = "\x1f"
# A speaker id of 32 or more hex digits is a hash of one identity (Common Voice's client_id is 128):
# the same in two sources, it is the same person, whatever --same-speakers says.
HASHED_SPEAKER_ID = r"^[0-9a-fA-F]{32,}$"


def speaker_namespaces(
    sources: Sequence[str], same_speakers: Sequence[str], master: Path
) -> dict[str, str]:
    """{source: the namespace its speaker ids live in}: each source its own, except the sources
    that ``same_speakers`` says share speakers (each item a comma-separated list of source names
    or shell-style patterns, ``cv_*``; items naming a common source join into one namespace, named
    by its first source in sorted order). A name or pattern matching no source is a SplitError
    naming the master's sources."""
    sources = sorted(set(sources))
    parent = {source: source for source in sources}

    def root(source: str) -> str:
        while parent[source] != source:
            source = parent[source]
        return source

    for item in same_speakers:
        members: list[str] = []
        for pattern in (part.strip() for part in item.split(",")):
            if not pattern:
                continue
            matched = fnmatch.filter(sources, pattern)
            if not matched:
                raise SplitError(
                    f"--same-speakers {item}: no source of {master} is named {pattern!r}; its "
                    f"sources are {', '.join(sources) or '(none)'}"
                )
            members += matched
        for member in members[1:]:
            a, b = sorted((root(members[0]), root(member)))
            parent[b] = a
    return {source: root(source) for source in sources}


def speaker_keys(
    frame: pl.DataFrame, same_speakers: Sequence[str], master: Path
) -> tuple[pl.Series, dict[str, Any]]:
    """Each row's speaker as one string (``SPEAKER_KEY``; null where ``speaker_id`` is), and what
    the summary says about speaker ids that several sources use.

    A speaker is (source, speaker id): two corpora that both number their speakers "1" or
    "spk001" hold two different people, unless ``same_speakers`` puts the sources in one namespace
    (``speaker_namespaces``). A hashed id (``HASHED_SPEAKER_ID``: Common Voice's client_id) is one
    person in every source, so Common Voice locales read as separate sources share speakers. A
    speaker id only one namespace uses is its own key, so a source whose ids no other source uses
    keeps its speakers' keys, and with them its split, whatever else the master holds; an id
    several namespaces use is keyed by namespace and id. The summary entry: ``{"ids": n,
    "sources": [...], "example": id}`` of the ids used in more than one namespace and not hashed
    ({} when none)."""
    sources = frame.get_column("source").cast(pl.String).fill_null("")
    namespace = speaker_namespaces(sources.unique().to_list(), same_speakers, master)
    spaces = pl.DataFrame(
        {
            "source": sources,
            "id": frame.get_column("speaker_id").cast(pl.String),
            "ns": sources.replace_strict(namespace, return_dtype=pl.String),
        }
    )
    # A hashed id (Common Voice's client_id: 128 hex digits of one contributor in every locale)
    # names one person wherever it appears: it is never a per-corpus number like "1" or "spk001".
    hashed = pl.col("id").str.contains(HASHED_SPEAKER_ID)
    shared = (
        pl.col("id").is_not_null()
        & ~hashed.fill_null(False)
        & (pl.col("ns").n_unique().over("id") > 1)
    )
    spaces = spaces.with_columns(shared.alias("shared"))
    keys = spaces.select(
        pl.when("shared")
        .then(pl.concat_str("ns", pl.lit(_NAMESPACE_SEPARATOR), "id"))
        .otherwise("id")
        .alias(SPEAKER_KEY)
    ).to_series()
    sharing = spaces.filter("shared")
    report: dict[str, Any] = {}
    if sharing.height:
        report = {
            "ids": sharing.get_column("id").n_unique(),
            "sources": sorted(sharing.get_column("source").unique()),
            "example": sharing.get_column("id").min(),
        }
    return keys, report


# --- split -----------------------------------------------------------------------------------
def group_hash(keys: Sequence[str], seed: int) -> np.ndarray:
    """A stable 64-bit rank per group key: BLAKE2b keyed by the seed (Python's hash() is salted)."""
    salt = str(seed).encode()
    return np.array(
        [
            int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8, key=salt).digest(), "big")
            for k in keys
        ],
        dtype=np.uint64,
    )


def choose_val_groups(groups: pl.DataFrame, quota: dict[str, int], seed: int) -> set[str]:
    """Groups for validation. ``groups``: one row per (group, lang) with ``n`` rows.

    Groups are visited in hash order; one is taken when its rows fit the remaining quota of every
    language it has rows in. The loop is per group, not per row, and stops as soon as every quota
    is met (about val_per_lang * languages rows visited in the common case).
    """
    keys = groups.get_column("group").unique().sort()
    order = pl.DataFrame({"group": keys, "rank": group_hash(keys.to_list(), seed)}).sort(
        ["rank", "group"]
    )
    per_group = (
        groups.group_by("group")
        .agg(pl.col("lang"), pl.col("n"))
        .join(order, on="group")
        .sort(["rank", "group"])
    )
    remaining = {lang: q for lang, q in quota.items() if q > 0}
    chosen: set[str] = set()
    for key, langs, ns in per_group.select("group", "lang", "n").iter_rows():
        if not remaining:
            break
        if all(remaining.get(lang, 0) >= n for lang, n in zip(langs, ns)):
            chosen.add(key)
            for lang, n in zip(langs, ns):
                remaining[lang] -= n
                if remaining[lang] == 0:
                    del remaining[lang]
    return chosen


# --- main pipeline -------------------------------------------------------------------------------
def make_train_val(
    master: Path | None = None,
    train_path: Path | None = None,
    val_path: Path | None = None,
    *,
    test_path: Path | None = None,
    splits: str | None = None,
    keep_leaks: bool = False,
    val_per_lang: int | None = None,
    seed: int | None = None,
    lang_fixes: Path | None = None,
    keep_duplicate_texts: bool = False,
    threshold: float | None = None,
    max_val_fraction: float | None = None,
    languages: Sequence[str] | None = None,
    allow_short_val: bool = False,
    nemo_json: bool = False,
    nemo_json_tags: bool = False,
    same_speakers: Sequence[str] = (),
) -> dict[str, Any]:
    """Write the train and validation manifests and the summary, as one set; return the summary.
    With ``nemo_json``, a NeMo JSON manifest beside each (``<stem>.json``: audio_filepath, duration,
    text without the tag (with it when ``nemo_json_tags``), lang) joins the set.

    The three files are written under temporary names first and renamed only when all three are
    complete, and all carry one ``split_id`` (the parquet files in their metadata), so a failure
    leaves the previous set as it was and a set mixed by a crash between the renames is detected by
    ``manifest_schema.check_same_split``. An unusable split is a SplitError: an empty master, nothing
    left to train on, or (with val_per_lang > 0) a language with a quota that gets no validation row,
    unless ``allow_short_val``.

    ``splits`` is ``keep`` (the master's ``split`` column decides each row's side; rows without
    one are split as ``resplit`` does, for the languages with no validation rows of their own, and
    train otherwise), ``resplit`` (train and dev rows pooled and split by speaker) or None (keep
    when the master has a split column with a value). Either way a ``test`` row goes to the test
    manifest (``test_path``, written with the set when there are test rows) and never to train or
    validation. Rows whose speaker or audio is also in a more held-out split are leaks
    (``mark_leaks``): dropped unless ``keep_leaks``, and reported either way.

    A speaker is (source, speaker_id) wherever speakers are grouped or compared (the split, the
    leaks, their counts); ``same_speakers`` names sources that share speakers (``speaker_keys``).

    None means the config value (MASTER_MANIFEST_PATH, TRAIN_MANIFEST_PATH, VAL_MANIFEST_PATH,
    TEST_MANIFEST_PATH, VAL_PER_LANG, SEED, SCRIPT_VOTE_THRESHOLD, VAL_MAX_FRACTION, LANGUAGES).
    """
    started = time.perf_counter()
    master = Path(config.MASTER_MANIFEST_PATH if master is None else master)
    train_path = Path(config.TRAIN_MANIFEST_PATH if train_path is None else train_path)
    val_path = Path(config.VAL_MANIFEST_PATH if val_path is None else val_path)
    test_path = Path(config.TEST_MANIFEST_PATH if test_path is None else test_path)
    val_per_lang = config.VAL_PER_LANG if val_per_lang is None else val_per_lang
    seed = config.SEED if seed is None else seed
    threshold = config.SCRIPT_VOTE_THRESHOLD if threshold is None else threshold
    max_val_fraction = config.VAL_MAX_FRACTION if max_val_fraction is None else max_val_fraction
    languages = tuple(config.LANGUAGES if languages is None else languages)
    if val_per_lang < 0:
        raise SplitError(f"--val-per-lang {val_per_lang}: expected a count >= 0")
    if train_path.resolve() == val_path.resolve():
        raise SplitError(f"train and validation manifests are the same file: {train_path}")
    if test_path.resolve() in (train_path.resolve(), val_path.resolve()):
        raise SplitError(f"the test manifest {test_path} is also the train or validation manifest")
    if splits not in (None, "keep", "resplit"):
        raise SplitError(f"--splits {splits}: expected keep or resplit")

    frame = load_master(master).with_row_index("row")
    rows_in = frame.height
    if rows_in == 0:
        raise SplitError(
            f"{master}: the master manifest has no rows; see its summary "
            f"({summary_path(master).name}) for what build_manifest.py dropped"
        )
    columns = [c for c in frame.columns if c != "row"]
    keys, shared_ids = speaker_keys(frame, same_speakers, master)
    frame = frame.with_columns(keys)
    if shared_ids:
        print(f"make_train_val: warning: {format_shared_speaker_ids(shared_ids)}", file=sys.stderr)
    has_splits = SPLIT_COLUMN in frame.columns and frame[SPLIT_COLUMN].null_count() < rows_in
    splits = splits or ("keep" if has_splits else "resplit")
    frame = frame.with_columns(split_roles(frame, splits, master))
    frame, tags = correct_languages(frame, threshold, lang_fixes)
    frame = mark_unselected_languages(frame, languages, master)
    frame = mark_duplicates(frame, keep_duplicate_texts)
    kept = frame.filter(pl.col("reason").is_null())
    if kept.filter(pl.col("role").fill_null("") != "test").is_empty():
        raise SplitError(
            f"every one of the {rows_in} rows of {master} was dropped or is a test row "
            f"({counts_by(frame, 'reason')}): nothing to train on; check "
            f"LANGUAGES={','.join(languages) or '(all)'} and the master"
        )
    train, val, test, split = place_rows(
        kept, splits, val_per_lang, max_val_fraction, seed, allow_short_val
    )
    large_val = large_validation_shares(
        split.pop("resplit_train"), split.pop("resplit_val"), config.VAL_WARN_FRACTION
    )
    for line in format_large_validation(large_val, config.VAL_WARN_FRACTION):
        print(f"make_train_val: warning: {line}", file=sys.stderr)
    sides = pl.concat(
        [
            part.with_columns(pl.lit(side).alias("side"))
            for side, part in (("train", train), ("val", val), ("test", test))
        ],
        how="diagonal",
    )
    sides, leaks = mark_leaks(sides, keep_duplicate_texts, keep_leaks)
    removed = sides.filter(pl.col("leak").is_not_null() & ~pl.lit(keep_leaks))
    if removed.height:
        frame = (
            frame.join(
                removed.select("row", pl.col("leak").alias("leak_reason")), on="row", how="left"
            )
            .with_columns(pl.coalesce("leak_reason", "reason").alias("reason"))
            .drop("leak_reason")
        )
    train, val, test = (
        sides.filter((pl.col("side") == side) & ~pl.col("row").is_in(removed["row"].implode()))
        for side in ("train", "val", "test")
    )
    if train.is_empty() and removed.filter(pl.col("side") == "train").height:
        raise SplitError(
            f"every training row of {master} leaks into validation or test ({leaks['rows']}): "
            f"nothing to train on; check the master's split column, or pass --keep-leaks"
        )
    summary = {
        **count_rows(rows_in, frame, train, val, split["quota"], test),
        **tags,
        "leaks": leaks,
        "speaker_ids_in_several_sources": shared_ids,
        "split": {
            **{k: v for k, v in split.items() if k != "quota"},
            "large_val_share": large_val,
            "seed": seed,
            "val_per_lang": val_per_lang,
            "max_val_fraction": max_val_fraction,
        },
        "settings": {
            "master": str(master),
            "threshold": threshold,
            "languages": list(languages),
            "keep_duplicate_texts": keep_duplicate_texts,
            "splits": splits,
            "keep_leaks": keep_leaks,
            "same_speakers": list(same_speakers),
        },
    }
    order = ["shard_id", "segment_id", "row"]
    halves = {
        train_path: train.sort(order).select(columns),
        val_path: val.sort(order).select(columns),
    }
    if test.height:
        halves[test_path] = test.sort(order).select(columns)
        summary["test_manifest"] = str(test_path)
    summary["split_id"] = split_id = _split_id(halves.values(), seed)
    summary["settings"][STYLE_KEY] = style = manifest_style(master)
    if nemo_json:
        summary["nemo_json"] = [str(nemo_json_path(path)) for path in halves]
    write_split(
        halves,
        summary,
        summary_path(train_path),
        split_id,
        style=style,
        nemo_json=nemo_json,
        nemo_json_tags=nemo_json_tags,
    )
    # What an earlier split left that this one did not write would pass for this split's: its
    # test manifest (when this one has none) and NeMo JSON twins (when this one writes none).
    stale = [] if test.height else [test_path]
    stale += [nemo_json_path(path) for path in (*halves, *stale) if not nemo_json]
    stale += [] if test.height or not nemo_json else [nemo_json_path(test_path)]
    _set_aside_superseded(stale, split_id)
    summary["seconds"] = round(time.perf_counter() - started, 3)
    return summary


def _set_aside_superseded(paths: Sequence[Path], split_id: str) -> None:
    """Manifests of ``paths`` left by an earlier split (a test manifest when this one has no test
    rows, NeMo JSON twins when this one writes none) would pass for this split's: their rows may
    now be elsewhere. Each is renamed ``<name>.superseded<suffix>``, or ``<name>.superseded-2
    <suffix>``, ``-3``, ... when that name holds one of a split before, with a warning; nothing is
    deleted or overwritten."""
    present = [path for path in paths if path.exists()]
    if not present:
        return
    for n in itertools.count(1):
        tag = "superseded" if n == 1 else f"superseded-{n}"
        asides = [path.with_name(f"{path.stem}.{tag}{path.suffix}") for path in present]
        if not any(aside.exists() for aside in asides):
            break
    for path, aside in zip(present, asides):
        path.replace(aside)
        print(
            f"make_train_val: warning: {path} belonged to an earlier split (this one, "
            f"{split_id}, wrote none): renamed {aside}, so it is not taken for this split's",
            file=sys.stderr,
        )


# --- the steps, in order ------------------------------------------------------------------------
def correct_languages(
    frame: pl.DataFrame, threshold: float, lang_fixes: Path | None
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Step 1: language tags from the script, then the explicit fixes; ``lang`` and the text's tag
    change together. Returns the frame (with ``body``, ``given_lang``, ``script_lang``, ``script``
    and ``fixed_lang`` beside) and the summary's tag entries."""
    body = frame.select(pl.col("text").str.strip_prefix(tag_prefix_expr())).to_series()
    by_script, deciding = detect_corrections(body, frame.get_column("lang"), threshold)
    frame = frame.with_columns(
        body.alias("body"),
        frame.get_column("lang").alias("given_lang"),
        by_script.alias("script_lang"),
        deciding.alias("script"),
    )
    fixes_summary: dict[str, Any] = {}
    if lang_fixes is not None:
        fixes = load_lang_fixes(lang_fixes)
        matched = fixes.join(frame.select("segment_id"), on="segment_id", how="semi")
        fixes_summary = {
            "file": str(lang_fixes),
            "rows": fixes.height,
            "matched": matched.height,
            "unmatched_segment_ids": fixes.height - matched.height,
        }
        frame = frame.join(
            fixes.rename({"lang": "fixed_lang"}), on="segment_id", how="left", maintain_order="left"
        )
    else:
        frame = frame.with_columns(pl.lit(None, dtype=pl.String).alias("fixed_lang"))
    frame = frame.with_columns(pl.coalesce("fixed_lang", "script_lang").alias("lang"))
    frame = frame.with_columns(tagged_text_expr("body").alias("text"))
    changed = frame.filter(pl.col("lang") != pl.col("given_lang"))
    devanagari = list(SCRIPT_LANGUAGES["Devanagari"][1])
    unresolved = counts_by(
        frame.filter(
            (pl.col("script") == "Devanagari")
            & ~pl.col("given_lang").is_in(devanagari)
            & pl.col("fixed_lang").is_null()
        ),
        "given_lang",
    )
    return frame, {
        "lang_corrections": counts_pairs(changed),
        "lang_corrections_by_cause": {
            "script": counts_pairs(changed.filter(pl.col("fixed_lang").is_null())),
            "lang_fixes": counts_pairs(changed.filter(pl.col("fixed_lang").is_not_null())),
        },
        "unresolved_devanagari_conflicts": unresolved,
        "lang_fixes": fixes_summary,
    }


def mark_unselected_languages(
    frame: pl.DataFrame, languages: Sequence[str], master: Path
) -> pl.DataFrame:
    """Step 2: ``reason`` column added, ``language_not_selected`` where LANGUAGES leaves a row out
    (a warning names selected codes no row has; none kept at all is an error)."""
    frame = frame.with_columns(pl.lit(None, dtype=pl.String).alias("reason"))
    languages_without_rows = check_language_selection(
        languages, frame.get_column("lang").drop_nulls().unique(), "make_train_val.py"
    )
    if languages_without_rows:
        print(
            f"make_train_val: warning: LANGUAGES lists {', '.join(languages_without_rows)}, which "
            f"no row of {master} has (after tag correction)",
            file=sys.stderr,
        )
    if not languages:
        return frame
    return frame.with_columns(
        pl.when(~pl.col("lang").is_in(list(languages)))
        .then(pl.lit("language_not_selected"))
        .otherwise("reason")
        .alias("reason")
    )


def mark_duplicates(frame: pl.DataFrame, keep_duplicate_texts: bool) -> pl.DataFrame:
    """Step 3: among the rows not dropped yet, one per utterance: one per segment_id
    (``duplicate_segment_id``; build_manifest.py makes an imported row's id unique to its source,
    so only a shard's re-delivered utterance shares one), then one per audio file
    (``duplicate_audio``), then one per (lang, text, duration) (``duplicate_text``) unless
    ``keep_duplicate_texts``; the best tx_quality_score wins, ties broken on shard_id,
    segment_id, audio_filepath, row. With a ``role`` column (``split_roles``), rows are compared
    only with rows of the same role (train and no role together): a copy across a source's own
    splits is a leak, which ``mark_leaks`` finds and reports, not a duplicate."""
    best_first = ["tx_quality_score", "shard_id", "segment_id", "audio_filepath", "row"]
    descending = [True, False, False, False, False]
    alive = frame.filter(pl.col("reason").is_null()).sort(
        best_first, descending=descending, nulls_last=True
    )
    held = pl.col("role").fill_null("train") if "role" in frame.columns else pl.lit("train")

    def first(*key: str) -> pl.Expr:
        return pl.struct(held.alias("_held"), *key).is_first_distinct()

    dup_id = alive.filter(~first("segment_id")).get_column("row")
    alive = alive.filter(first("segment_id"))
    dup_audio = alive.filter(~first("audio_filepath")).get_column("row")
    alive = alive.filter(first("audio_filepath"))
    dup_text = (
        alive.filter(~first("lang", "text", "duration")).get_column("row")
        if not keep_duplicate_texts
        else pl.Series([], dtype=pl.UInt32)
    )
    return frame.with_columns(
        pl.when(pl.col("row").is_in(dup_id.implode()))
        .then(pl.lit("duplicate_segment_id"))
        .when(pl.col("row").is_in(dup_audio.implode()))
        .then(pl.lit("duplicate_audio"))
        .when(pl.col("row").is_in(dup_text.implode()))
        .then(pl.lit("duplicate_text"))
        .otherwise("reason")
        .alias("reason")
    )


def split_roles(frame: pl.DataFrame, splits: str, master: Path) -> pl.Series:
    """Each row's side as its source gave it (the ``split`` column through ``SPLIT_ROLES``):
    ``train``, ``val``, ``test``, or null for a row without a split of its own. With ``resplit``
    only ``test`` is kept (the rest is pooled). In ``keep`` mode a split name outside
    ``SPLIT_ROLES`` is a SplitError naming it."""
    if SPLIT_COLUMN not in frame.columns:
        return pl.Series("role", [None] * frame.height, dtype=pl.String)
    given = frame.get_column(SPLIT_COLUMN).cast(pl.String)
    role = given.replace_strict(SPLIT_ROLES, default=None, return_dtype=pl.String)
    unknown = given.filter(given.is_not_null() & role.is_null())
    if splits == "keep" and unknown.len():
        counts = ", ".join(f"{v!r} ({n} rows)" for v, n in unknown.value_counts(sort=True).rows())
        raise SplitError(
            f"{master}: split column holds {counts}, which is none of "
            f"{', '.join(SPLIT_ROLES)}: import that source with :split=train|dev|test, or pass "
            f"--splits resplit to split by speaker"
        )
    if splits == "resplit":
        is_test = (role == "test").fill_null(False)
        role = role.zip_with(is_test, pl.Series([None] * role.len(), dtype=pl.String))
    return role.alias("role")


def place_rows(
    kept: pl.DataFrame,
    splits: str,
    val_per_lang: int,
    max_val_fraction: float,
    seed: int,
    allow_short_val: bool,
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, dict[str, Any]]:
    """Step 4: (train, validation, test, the summary's split entries plus ``quota`` and the rows
    ``split_by_groups`` placed as ``resplit_train`` and ``resplit_val``). Test rows are the test
    rows whatever ``splits`` says. ``resplit`` splits every other row by speaker; ``keep`` keeps
    the train and validation rows where their source put them and splits by speaker only the rows
    without a split of their own of the languages that have no validation rows of their own (the
    others' go to train). A language with train rows and no validation row is a SplitError unless
    ``allow_short_val``."""
    role = pl.col("role")
    test = kept.filter(role == "test")
    if splits == "resplit":
        pool = kept.filter(role.is_null())
        train, val, split = split_by_groups(
            pool, val_per_lang, max_val_fraction, seed, allow_short_val
        )
        return (
            train,
            val,
            test,
            {"mode": "resplit", **split, "resplit_train": train, "resplit_val": val},
        )
    own_val, own_train = kept.filter(role == "val"), kept.filter(role == "train")
    unsplit = kept.filter(role.is_null())
    with_val = own_val.get_column("lang").unique().implode()
    to_split = unsplit.filter(~pl.col("lang").is_in(with_val))
    split: dict[str, Any] = {"quota": {}}
    placed_train, placed_val = to_split.clear(), to_split.clear()
    if to_split.height:
        placed_train, placed_val, split = split_by_groups(
            to_split, val_per_lang, max_val_fraction, seed, allow_short_val
        )
    train = pl.concat(
        [own_train, unsplit.filter(pl.col("lang").is_in(with_val)), placed_train], how="diagonal"
    )
    val = pl.concat([own_val, placed_val], how="diagonal")
    no_val = sorted(set(train.get_column("lang")) - set(val.get_column("lang")))
    if no_val and not allow_short_val:
        raise SplitError(
            f"no validation rows for {', '.join(no_val)}: their rows come with a train split and "
            f"none with dev; import the source's dev split too (a Common Voice folder's dev.tsv, or "
            f"a source with :split=dev), pass --splits resplit to split train by speaker, or pass "
            f"--allow-short-val"
        )
    return (
        train,
        val,
        test,
        {
            "mode": "keep",
            "kept": {"train": own_train.height, "val": own_val.height, "test": test.height},
            "resplit_languages": sorted(set(to_split.get_column("lang"))),
            **split,
            "resplit_train": placed_train,
            "resplit_val": placed_val,
        },
    )


# How held out each side is: a leak is removed from the less held-out side.
HELD_OUT = {"test": 0, "val": 1, "train": 2}


def mark_leaks(
    sides: pl.DataFrame, keep_duplicate_texts: bool, keep_leaks: bool
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Step 5: ``sides`` (the placed rows, ``side`` train, val or test) with ``leak``: a row's
    ``leak_audio`` when its utterance (the same segment_id, the same audio file, or, unless
    ``keep_duplicate_texts``, the same language, text and duration) is also on a more held-out
    side (test, then val, then train), else ``leak_speaker`` when its speaker (``SPEAKER_KEY``)
    is; null otherwise.
    The rows of the most held-out side never leak. Also the report: ``{"removed": not keep_leaks,
    "rows": {"audio"|"speaker": {"train/test": n, ...}}, "speakers": {"train/test": n, ...}}``
    ("train/test": train rows that are also in test)."""
    rank = pl.col("side").replace_strict(HELD_OUT, return_dtype=pl.Int8)
    keys: list[Any] = ["segment_id", "audio_filepath"]
    if not keep_duplicate_texts:
        keys.append(pl.struct("lang", "text", "duration"))
    audio = pl.min_horizontal([rank.min().over(key) for key in keys])
    speaker = pl.when(pl.col(SPEAKER_KEY).is_not_null()).then(rank.min().over(SPEAKER_KEY))
    sides = sides.with_columns(rank.alias("_rank"), audio.alias("_audio"), speaker.alias("_spk"))
    names = {rank: side for side, rank in HELD_OUT.items()}
    sides = sides.with_columns(
        pl.when(pl.col("_audio") < pl.col("_rank"))
        .then(pl.lit("leak_audio"))
        .when(pl.col("_spk") < pl.col("_rank"))
        .then(pl.lit("leak_speaker"))
        .alias("leak"),
        pl.when(pl.col("_audio") < pl.col("_rank"))
        .then(pl.col("_audio"))
        .otherwise(pl.col("_spk"))
        .replace_strict(names, default=None, return_dtype=pl.String)
        .alias("_against"),
    )
    leaking = sides.filter(pl.col("leak").is_not_null()).with_columns(
        pl.concat_str("side", pl.lit("/"), "_against").alias("pair"),
        pl.col("leak").str.strip_prefix("leak_").alias("kind"),
    )
    speakers = (
        leaking.filter(pl.col("kind") == "speaker")
        .group_by("pair")
        .agg(pl.col(SPEAKER_KEY).n_unique())
    )
    report = {
        "removed": not keep_leaks,
        "rows": counts_by(leaking, "kind", "pair"),
        "speakers": dict(sorted(speakers.rows())),
    }
    return sides.drop("_rank", "_audio", "_spk", "_against"), report


def split_by_groups(
    kept: pl.DataFrame, val_per_lang: int, max_val_fraction: float, seed: int, allow_short_val: bool
) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any]]:
    """Step 4: (train, validation, the summary's split entries plus ``quota``). Rows are grouped by
    speaker (``SPEAKER_KEY``: source and speaker_id), else shard, else, for a language whose every
    group exceeds its quota and has no speakers, by utterance; whole groups go to validation in
    hash order while they fit every one of their languages' quota (see ``choose_val_groups`` and
    ``_take_spanning_groups``)."""
    has_speaker = kept.get_column(SPEAKER_KEY).null_count() < kept.height
    group = (
        pl.when(pl.col(SPEAKER_KEY).is_not_null())
        .then(pl.concat_str(pl.lit("speaker:"), pl.col(SPEAKER_KEY)))
        .otherwise(pl.concat_str(pl.lit("shard:"), pl.col("shard_id")))
    )
    kept = kept.with_columns(group.alias("group"))
    lang_rows = dict(kept.group_by("lang").len().iter_rows())
    quota = {lang: min(val_per_lang, int(max_val_fraction * n)) for lang, n in lang_rows.items()}
    # Without speakers a shard is the group; a language whose every shard is larger than its quota
    # could give validation nothing, so its rows are split one utterance at a time instead (said in
    # the summary: there is no speaker information to keep apart).
    smallest = dict(
        kept.group_by("group", "lang").len().group_by("lang").agg(pl.col("len").min()).iter_rows()
    )
    by_segment = sorted(
        lang
        for lang, q in quota.items()
        if q > 0
        and smallest[lang] > q
        and kept.filter(
            (pl.col("lang") == lang) & pl.col("group").str.starts_with("speaker:")
        ).is_empty()
    )
    if by_segment:
        kept = kept.with_columns(
            pl.when(pl.col("lang").is_in(by_segment))
            .then(pl.concat_str(pl.lit("segment:"), pl.col("segment_id")))
            .otherwise("group")
            .alias("group")
        )
    chosen = choose_val_groups(kept.group_by("group", "lang").agg(pl.len().alias("n")), quota, seed)
    chosen, spanning_taken = _take_spanning_groups(kept, chosen, quota, seed)
    in_val = pl.col("group").is_in(pl.Series(sorted(chosen), dtype=pl.String).implode())
    val = kept.filter(in_val)
    train = kept.filter(~in_val)
    empty_val = sorted(
        lang for lang, q in quota.items() if q > 0 and not val.filter(pl.col("lang") == lang).height
    )
    if empty_val and not allow_short_val:
        raise SplitError(
            f"no validation rows for {', '.join(empty_val)} "
            f"({_why_no_validation(kept, empty_val, lang_rows, smallest, quota)}); the split would "
            f"score nothing there. Validation takes whole speaker groups: raise --val-per-lang to at "
            f"least {max(smallest[lang] for lang in empty_val)} (the smallest such group; "
            f"--max-val-fraction must allow it too), add speakers, or pass --allow-short-val"
        )
    assert val.join(train, on="group", how="semi").is_empty(), "a group is in both splits"
    assert val.join(train, on="segment_id", how="semi").is_empty(), "a segment_id is in both splits"
    return (
        train,
        val,
        {
            "grouped_by": "speaker (source, speaker_id), else shard_id"
            if has_speaker
            else "shard_id",
            "grouped_by_utterance": by_segment,
            "groups_spanning_languages_taken": spanning_taken,
            "val_groups": len(chosen),
            "train_groups": train.get_column("group").n_unique(),
            "quota": quota,
        },
    )


def large_validation_shares(
    train: pl.DataFrame, val: pl.DataFrame, fraction: float
) -> dict[str, dict[str, int]]:
    """``{lang: {"train": n, "val": m}}`` of the languages with more than ``fraction`` of their
    split rows in validation."""
    train_rows, val_rows = counts_by(train, "lang"), counts_by(val, "lang")
    return {
        lang: {"train": train_rows.get(lang, 0), "val": n}
        for lang, n in sorted(val_rows.items())
        if n > fraction * (n + train_rows.get(lang, 0))
    }


def _why_no_validation(
    kept: pl.DataFrame,
    empty: list[str],
    lang_rows: dict[str, int],
    smallest: dict[str, int],
    quota: dict[str, int],
) -> str:
    """Why each language in ``empty`` got no validation row: its group count and sizes against its
    quota (groups that also hold other languages' rows are taken by ``_take_spanning_groups``)."""
    sizes = dict(kept.group_by("lang").agg(pl.col("group").n_unique()).iter_rows())
    return "; ".join(
        f"{lang}: its {lang_rows[lang]} rows are {sizes[lang]} speaker/shard group(s), the "
        f"smallest of {smallest[lang]} rows, and validation may take {quota[lang]}"
        for lang in empty
    )


def count_rows(
    rows_in: int,
    frame: pl.DataFrame,
    train: pl.DataFrame,
    val: pl.DataFrame,
    quota: dict,
    test: pl.DataFrame | None = None,
) -> dict[str, Any]:
    """The summary's counts: rows in, train, validation and test rows, drops per reason and
    language, validation and test per language and validation's shortfall against the quota.
    Asserts that every row is accounted for."""
    test = val.clear() if test is None else test
    dropped_rows = frame.filter(pl.col("reason").is_not_null())
    dropped = counts_by(dropped_rows, "reason")
    val_by_lang = counts_by(val, "lang")
    total = train.height + val.height + test.height + sum(dropped.values())
    assert rows_in == total, f"row accounting broke: {rows_in} in != {total} out"
    return {
        "rows_in": rows_in,
        "rows_out": train.height,
        "val_rows": val.height,
        "test_rows": test.height,
        "test_by_lang": counts_by(test, "lang"),
        "dropped": dropped,
        "dropped_by_lang": counts_by(dropped_rows, "lang", "reason"),
        "kept_by_lang": counts_by(train, "lang"),
        "val_by_lang": val_by_lang,
        "val_shortfall": {
            lang: q - val_by_lang.get(lang, 0)
            for lang, q in sorted(quota.items())
            if q > val_by_lang.get(lang, 0)
        },
    }


def _split_id(halves, seed: int) -> str:
    """An id derived from the two halves' rows, so the same input and seed give byte-identical
    files again."""
    digest = hashlib.sha256()
    for half in halves:
        digest.update(half.hash_rows(seed=seed).to_numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:32]


def _take_spanning_groups(
    kept: pl.DataFrame, chosen: set[str], quota: dict[str, int], seed: int
) -> tuple[set[str], dict[str, Any]]:
    """When a language got no validation row because every group holding its rows also holds rows
    of other languages (a speaker recorded in two languages) that do not fit their quotas at once,
    validation takes, for each such language, the one group that puts the fewest rows of other
    languages over their quotas (ties: hash order). A speaker stays on one side; the other
    languages' validation grows past its quota by that group's rows, which the summary lists.
    Returns the chosen groups and ``{"groups", "languages", "rows_over_quota"}`` (empty when
    nothing was taken)."""
    in_val = kept.filter(
        pl.col("group").is_in(pl.Series(sorted(chosen), dtype=pl.String).implode())
    )
    have = dict(in_val.group_by("lang").len().iter_rows())
    empty = sorted(lang for lang, q in quota.items() if q > 0 and lang not in have)
    if not empty:
        return chosen, {}
    per_group = kept.group_by("group", "lang").len()
    spanning = (
        per_group.group_by("group")
        .agg(pl.col("lang").n_unique().alias("langs"))
        .filter(pl.col("langs") > 1)
    ).get_column("group")
    taken, over = [], {}
    chosen = set(chosen)
    for lang in empty:
        if lang in have:  # a group taken for an earlier language brought it rows
            continue
        candidates = per_group.filter(
            pl.col("group").is_in(spanning.implode())
            & ~pl.col("group").is_in(pl.Series(sorted(chosen), dtype=pl.String).implode())
        ).filter(pl.col("group").is_in(per_group.filter(pl.col("lang") == lang)["group"].implode()))
        if candidates.is_empty():
            continue
        others = (
            candidates.filter(pl.col("lang") != lang)
            .group_by("group")
            .agg(pl.col("len").sum().alias("others"))
        )
        keys = others.get_column("group").to_list()
        ranked = others.with_columns(pl.Series("rank", group_hash(keys, seed))).sort(
            ["others", "rank", "group"]
        )
        best = ranked.item(0, "group")
        chosen.add(best)
        taken.append(best)
        for other, n in per_group.filter(pl.col("group") == best).select("lang", "len").iter_rows():
            have[other] = have.get(other, 0) + n
            if have[other] > quota.get(other, 0):
                over[other] = have[other] - quota.get(other, 0)
    if not taken:
        return chosen, {}
    languages = sorted(lang for lang in empty if lang in have)
    return chosen, {"groups": len(taken), "languages": languages, "rows_over_quota": over}


def write_split(
    manifests: dict[Path, pl.DataFrame],
    summary: dict,
    summary_file: Path,
    split_id: str,
    nemo_json: bool = False,
    nemo_json_tags: bool = False,
    style: str | None = None,
) -> None:
    """Write the manifests (``split_id`` in each parquet's metadata; with ``nemo_json`` a NeMo JSON
    manifest beside each) and the summary as one set (``atomic_files.write_together``, the summary
    last): a failure leaves the previous set whole. ``style``: the master's transcript style, kept
    in each parquet's metadata (``transcript_style.STYLE_KEY``; None: unrecorded)."""
    writers = {
        path: functools.partial(_write_half, frame, split_id, style)
        for path, frame in manifests.items()
    }
    if nemo_json:
        for path, frame in manifests.items():
            writers[nemo_json_path(path)] = functools.partial(
                _write_nemo_json, frame, nemo_json_tags
            )
    writers[summary_file] = lambda tmp: Path(tmp).write_text(json_text(summary), encoding="utf-8")
    try:
        write_together(writers, split_id[:8])
    except OSError as exc:
        raise SplitError(
            f"cannot write the split ({exc.filename or ''}: {exc.strerror or exc}); the previous "
            f"train, validation and summary are unchanged"
        ) from None
    # A crash between two renames leaves files with different split ids (check_same_split refuses
    # them) and no summary.


def _write_half(frame: pl.DataFrame, split_id: str, style: str | None, path: str) -> None:
    metadata = {SPLIT_ID_KEY: split_id, **({STYLE_KEY: style} if style else {})}
    write_manifest_file(frame, path, metadata=metadata)


def _write_nemo_json(frame: pl.DataFrame, keep_tag: bool, path: str) -> None:
    nemo_json_frame(frame, keep_tag).write_ndjson(path)


def counts_pairs(changed: pl.DataFrame) -> dict[str, int]:
    """{"given->corrected": n} for the changed rows, sorted."""
    return {
        f"{g}->{c}": int(n)
        for g, c, n in changed.group_by("given_lang", "lang")
        .len()
        .sort("given_lang", "lang")
        .iter_rows()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_epilog(
            "make_train_val",
            "example:\n  python scripts/make_train_val.py --val-per-lang 500 --lang-fixes fixes.csv",
        ),
    )
    parser.add_argument(
        "--master",
        type=Path,
        default=None,
        help=f"input manifest (default MASTER_MANIFEST_PATH = {config.MASTER_MANIFEST_PATH})",
    )
    parser.add_argument(
        "--train",
        type=Path,
        default=None,
        help=f"train manifest to write (default TRAIN_MANIFEST_PATH = {config.TRAIN_MANIFEST_PATH})",
    )
    parser.add_argument(
        "--val",
        type=Path,
        default=None,
        help=f"validation manifest to write (default VAL_MANIFEST_PATH = {config.VAL_MANIFEST_PATH})",
    )
    parser.add_argument(
        "--test",
        type=Path,
        default=None,
        help="test manifest to write when the master has test rows (default TEST_MANIFEST_PATH = "
        f"{config.TEST_MANIFEST_PATH})",
    )
    parser.add_argument(
        "--splits",
        choices=("keep", "resplit"),
        default=None,
        help="keep: each row goes where its source's split puts it (train, dev -> validation, "
        "test -> test manifest); resplit: train and dev pooled and split by speaker (test rows "
        "still go to the test manifest). Default: keep when the master has a split column",
    )
    parser.add_argument(
        "--keep-leaks",
        action="store_true",
        help="keep rows whose speaker or audio is also in a more held-out split (reported either "
        "way; removed by default)",
    )
    parser.add_argument(
        "--same-speakers",
        action="append",
        default=[],
        metavar="SOURCE,SOURCE",
        help="sources whose speaker ids name the same people (comma-separated source names or "
        "patterns such as 'cv_*'; repeatable): their speakers are kept on one side and checked for "
        "leaks together. By default a speaker is (source, speaker_id): two corpora that both "
        "number their speakers '1' hold different people",
    )
    parser.add_argument(
        "--val-per-lang",
        type=int,
        default=None,
        help=f"validation utterances per language (default VAL_PER_LANG = {config.VAL_PER_LANG})",
    )
    parser.add_argument(
        "--max-val-fraction",
        type=float,
        default=None,
        help=f"cap on a language's share in validation (default VAL_MAX_FRACTION = {config.VAL_MAX_FRACTION})",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help=f"split seed (default SEED = {config.SEED})"
    )
    parser.add_argument(
        "--lang-fixes",
        type=Path,
        default=None,
        help="CSV with header segment_id,lang: tags to set explicitly (e.g. Devanagari languages)",
    )
    parser.add_argument(
        "--keep-duplicate-texts",
        action="store_true",
        help="keep rows with the same (lang, text, duration) as another row",
    )
    parser.add_argument(
        "--allow-short-val",
        action="store_true",
        help="write the split even when a language with a quota gets no validation row",
    )
    parser.add_argument(
        "--nemo-json",
        action="store_true",
        help="also write a NeMo JSON manifest beside each split (<stem>.json: audio_filepath, "
        "duration, text without the tag, lang) for NeMo's own scripts",
    )
    parser.add_argument(
        "--nemo-json-keep-tag",
        action="store_true",
        help="like --nemo-json, with the <|lang|> tag kept at the start of each text: the targets "
        "this project trains on, for training with NeMo's own scripts",
    )
    parser.add_argument(
        "--script-threshold",
        type=float,
        default=None,
        help="share of letters in one script that decides the tag "
        f"(default SCRIPT_VOTE_THRESHOLD = {config.SCRIPT_VOTE_THRESHOLD})",
    )
    args = parser.parse_args(argv)
    train_path = Path(config.TRAIN_MANIFEST_PATH if args.train is None else args.train)
    val_path = Path(config.VAL_MANIFEST_PATH if args.val is None else args.val)
    try:
        summary = make_train_val(
            args.master,
            train_path,
            val_path,
            test_path=args.test,
            splits=args.splits,
            keep_leaks=args.keep_leaks,
            val_per_lang=args.val_per_lang,
            seed=args.seed,
            lang_fixes=args.lang_fixes,
            keep_duplicate_texts=args.keep_duplicate_texts,
            threshold=args.script_threshold,
            max_val_fraction=args.max_val_fraction,
            allow_short_val=args.allow_short_val,
            nemo_json=args.nemo_json or args.nemo_json_keep_tag,
            nemo_json_tags=args.nemo_json_keep_tag,
            same_speakers=args.same_speakers,
        )
    except ManifestError as exc:
        print(f"make_train_val: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary, train_path, val_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
