"""Which language a transcript's writing system says it is in: the letters of each Unicode script
are counted, and a script holding most of them names a language (Tamil ta, Latin en, ...).

Used by scripts/make_train_val.py to correct language tags and by build_manifest.py to give a
language to imported rows that come with none. Devanagari is shared by many languages (hi, mr, ne,
sa, ...) and never names one by itself. polars is imported by the functions that count with it, so
that this module imports on a training node that has no polars.
"""

from __future__ import annotations

import bisect
import collections
import functools
import unicodedata
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import polars as pl

# Script (Rust-regex Script name) -> (language it implies, languages legitimately written in it).
SCRIPT_LANGUAGES: dict[str, tuple[str | None, frozenset[str]]] = {
    "Tamil": ("ta", frozenset({"ta"})),
    "Telugu": ("te", frozenset({"te"})),
    "Kannada": ("kn", frozenset({"kn"})),
    "Malayalam": ("ml", frozenset({"ml"})),
    "Gujarati": ("gu", frozenset({"gu"})),
    "Gurmukhi": ("pa", frozenset({"pa"})),
    "Oriya": ("or", frozenset({"or"})),
    "Latin": ("en", frozenset({"en"})),
    "Arabic": ("ur", frozenset({"ur", "ks", "sd"})),
    "Bengali": ("bn", frozenset({"bn", "as", "mni"})),
    "Devanagari": (
        None,
        frozenset(
            {
                "hi",
                "mr",
                "ne",
                "sa",
                "kok",
                "mai",
                "doi",
                "brx",
                "bho",
                "mag",
                "awa",
                "hne",
                "raj",
                "new",
                "sd",
                "ks",
            }
        ),
    ),
}
ASSAMESE_LETTERS = "\u09f0\u09f1"  # RA and WA with the Assamese shapes; Bengali has neither
ASSAMESE_EXEMPT = frozenset({"as", "mni"})  # Manipuri in Bengali script also writes WA
LETTER = r"[\p{L}\p{M}]"


def _script_class(script: str) -> str:
    # sc= (Script), not the Script_Extensions default: dandas and digits shared across Indic
    # scripts must not vote, and the letter/mark intersection drops digits and punctuation.
    return rf"[\p{{sc={script}}}&&[\p{{L}}\p{{M}}]]"


# The script a tag's language is normally written in (the first listed for ks and sd).
LANG_SCRIPT: dict[str, str] = {}
for _script, (_, _langs) in SCRIPT_LANGUAGES.items():
    for _lang in sorted(_langs):
        LANG_SCRIPT.setdefault(_lang, _script)


# The letters of each script of SCRIPT_LANGUAGES by Unicode block, for counting without polars (a
# training node has none): where those blocks hold a letter or mark, its script is the block's.
# A letter of no listed block counts as OTHER_SCRIPT. Generic combining marks (U+0300-U+036F)
# count as Latin, the script they are written over in these corpora.
OTHER_SCRIPT = "Other"
_SCRIPT_BLOCKS: tuple[tuple[int, int, str], ...] = tuple(
    sorted(
        [
            (0x0041, 0x005A, "Latin"),
            (0x0061, 0x007A, "Latin"),
            (0x00AA, 0x00AA, "Latin"),
            (0x00BA, 0x00BA, "Latin"),
            (0x00C0, 0x02AF, "Latin"),
            (0x0300, 0x036F, "Latin"),
            (0x1E00, 0x1EFF, "Latin"),
            (0x2C60, 0x2C7F, "Latin"),
            (0xA720, 0xA7FF, "Latin"),
            (0xFF21, 0xFF3A, "Latin"),
            (0xFF41, 0xFF5A, "Latin"),
            (0x0600, 0x06FF, "Arabic"),
            (0x0750, 0x077F, "Arabic"),
            (0x0870, 0x08FF, "Arabic"),
            (0xFB50, 0xFDFF, "Arabic"),
            (0xFE70, 0xFEFF, "Arabic"),
            (0x0900, 0x097F, "Devanagari"),
            (0x1CD0, 0x1CFF, "Devanagari"),
            (0xA8E0, 0xA8FF, "Devanagari"),
            (0x0980, 0x09FF, "Bengali"),
            (0x0A00, 0x0A7F, "Gurmukhi"),
            (0x0A80, 0x0AFF, "Gujarati"),
            (0x0B00, 0x0B7F, "Oriya"),
            (0x0B80, 0x0BFF, "Tamil"),
            (0x11FC0, 0x11FFF, "Tamil"),
            (0x0C00, 0x0C7F, "Telugu"),
            (0x0C80, 0x0CFF, "Kannada"),
            (0x0D00, 0x0D7F, "Malayalam"),
        ]
    )
)
_BLOCK_STARTS = [start for start, _, _ in _SCRIPT_BLOCKS]


@functools.lru_cache(maxsize=65536)
def letter_script(char: str) -> str | None:
    """The script of one character when it is a letter or a mark (a SCRIPT_LANGUAGES key, or
    OTHER_SCRIPT), None for anything else: digits, punctuation, spaces, joiners, the word-boundary
    mark of SentencePiece."""
    if unicodedata.category(char)[0] not in "LM":
        return None
    point = ord(char)
    at = bisect.bisect_right(_BLOCK_STARTS, point) - 1
    if at >= 0 and _SCRIPT_BLOCKS[at][0] <= point <= _SCRIPT_BLOCKS[at][1]:
        return _SCRIPT_BLOCKS[at][2]
    return OTHER_SCRIPT


def script_letters(texts) -> dict[str, int]:
    """How many letters and marks of each script (``letter_script``) the strings ``texts`` hold
    together; scripts with none are left out."""
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        counts.update(letter_script(c) for c in text)
    counts.pop(None, None)
    return dict(counts)


def scripts_of(text: str) -> frozenset[str]:
    """The scripts of the letters and marks of ``text`` (empty for a piece of digits or
    punctuation, or the word-boundary mark alone)."""
    return frozenset(s for s in map(letter_script, text) if s is not None)


def _by_groups(frame: pl.DataFrame, key: str, compute) -> pl.Series:
    """``compute(group_frame, key_value) -> Series`` per distinct ``key``, reassembled in row order
    (``frame`` needs a row index ``i``). A per-group regex runs over its own rows only, where a
    when/then chain would run every branch over every row."""
    import polars as pl

    parts = []
    for value in frame.get_column(key).unique().to_list():
        group = frame.filter(pl.col(key).is_null() if value is None else pl.col(key) == value)
        parts.append(pl.DataFrame({"i": group.get_column("i"), "v": compute(group, value)}))
    return pl.concat(parts).sort("i").get_column("v")


def detect_corrections(
    body: pl.Series, lang: pl.Series, threshold: float
) -> tuple[pl.Series, pl.Series]:
    """(corrected lang, deciding script or null) per row, from the transcript ``body`` (no tag).

    Vectorized in two stages: each row's letters are counted, and counted in the script of its own
    tag (one regex pass per tag script, over that tag's rows only); only rows whose own script
    falls short of ``threshold``, and Bengali-script rows holding an Assamese letter, are then
    counted in every script. The deciding script is set where one script reached the threshold.
    """
    import polars as pl

    frame = (
        pl.DataFrame({"body": body, "lang": lang})
        .with_row_index("i")
        .with_columns(
            pl.col("body").str.count_matches(LETTER).alias("letters"),
            pl.col("lang")
            .replace_strict(LANG_SCRIPT, default=None, return_dtype=pl.String)
            .alias("own_script"),
        )
    )
    own = _by_groups(
        frame,
        "own_script",
        lambda g, script: (
            g.get_column("body").str.count_matches(_script_class(script))
            if script is not None
            else pl.Series([0] * g.height, dtype=pl.UInt32)
        ),
    )
    frame = frame.with_columns(own.cast(pl.UInt32).alias("own"))
    has_assamese = pl.col("body").str.contains(f"[{ASSAMESE_LETTERS}]")
    suspects = frame.filter(
        (pl.col("letters") > 0)
        & (
            (pl.col("own").cast(pl.Float64) < threshold * pl.col("letters"))
            | (
                (pl.col("own_script") == "Bengali")
                & ~pl.col("lang").is_in(list(ASSAMESE_EXEMPT))
                & has_assamese
            )
        )
    )
    corrected = frame.get_column("lang")
    deciding = pl.Series("script", [None] * frame.height, dtype=pl.String)
    if suspects.is_empty():
        return corrected, deciding
    scripts = list(SCRIPT_LANGUAGES)
    counts = (
        suspects.select(
            *[pl.col("body").str.count_matches(_script_class(s)).alias(s) for s in scripts]
        )
        .to_numpy()
        .reshape(suspects.height, len(scripts))
    )
    best = counts.argmax(axis=1)
    reached = (
        counts[np.arange(len(best)), best] >= threshold * suspects.get_column("letters").to_numpy()
    )
    legit = pl.DataFrame(
        [(s, l) for s, (_, ls) in SCRIPT_LANGUAGES.items() for l in ls],
        schema=["script", "lang"],
        orient="row",
    ).with_columns(pl.lit(True).alias("legit"))
    defaults = {s: d for s, (d, _) in SCRIPT_LANGUAGES.items() if d is not None}
    voted = (
        suspects.select("i", "lang", has_assamese.alias("assamese"))
        .with_columns(
            pl.Series("script", np.array(scripts, dtype=object)[best].tolist(), dtype=pl.String),
            pl.Series("reached", reached),
        )
        .with_columns(pl.when(pl.col("reached")).then(pl.col("script")).alias("script"))
        .join(legit, on=["script", "lang"], how="left", maintain_order="left")
        .with_columns(
            pl.col("script")
            .replace_strict(defaults, default=None, return_dtype=pl.String)
            .alias("default")
        )
    )
    new_lang = (
        pl.when(pl.col("script").is_null())
        .then(pl.col("lang"))
        .when(
            (pl.col("script") == "Bengali")
            & pl.col("assamese")
            & ~pl.col("lang").is_in(list(ASSAMESE_EXEMPT))
        )
        .then(pl.lit("as"))
        .when(pl.col("default").is_not_null() & pl.col("legit").is_null())
        .then(pl.col("default"))
        .otherwise(pl.col("lang"))
    )
    voted = voted.with_columns(new_lang.alias("new_lang"))
    idx = voted.get_column("i")
    return (
        corrected.scatter(idx, voted.get_column("new_lang")),
        deciding.scatter(idx, voted.get_column("script")),
    )
