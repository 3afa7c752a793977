"""Transcript cleaning: the rules every transcript goes through before it is tagged and kept
(build_manifest.py runs them over each shard's and each imported source's rows).

``clean_text_column`` runs the rules as Rust-regex passes over a polars column, and a row takes
only the passes that can change it; ``clean_text`` and ``clean_texts`` are the same rules for
Python strings. The rules and their order are listed in ``clean_text``'s docstring.

Two styles (``STYLES``, the TRANSCRIPT_STYLE knob): ``plain`` removes every punctuation mark and
symbol; ``punctuated`` keeps the sentence punctuation (``SENTENCE_MARKS``: . , ? ! ; : and the
danda, double danda and Arabic-script comma, question mark and full stop) attached to the word
before it, for a model that writes punctuation. Neither changes case.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Sequence

try:
    import polars as pl
except ImportError:  # a GPU node with the training-only wheelhouse: see clean_text_without_polars
    pl = None

# Each rule is one Rust-regex replace over a column; their order is part of the contract.
_ZW_JOINERS = r"\x{200C}\x{200D}"  # ZWNJ, ZWJ
_ZW_SPACE = r"\x{200B}"
_APOSTROPHE_SLOT = "\ue000"  # private use: rule 1 deletes any in the input before using it
# 1. Format characters (bidi marks, BOM, soft hyphen, word joiner) and private-use characters are
#    invisible and spell nothing: deleted. ZWNJ/ZWJ are exempt (rule 6): they choose between a
#    conjunct and a half form in Indic scripts and spell the Malayalam chillus (NA + VIRAMA + ZWJ).
#    The zero-width space is a word break, so rule 4 turns it into a space. This runs before NFC
#    (rule 2): a mark after a deleted bidi mark may compose with the letter before it.
_INVISIBLE = rf"[[\p{{Cf}}\p{{Co}}]&&[^{_ZW_JOINERS}{_ZW_SPACE}]]"
# 3. An apostrophe between letters is part of the word ("don't", "o'clock"); it is kept (as ')
#    while every other quote goes. It rides through rule 4 as a placeholder. Two passes, because
#    the letter after one apostrophe can be the letter before the next ("rock'n'roll") and regex
#    matches do not overlap.
_IN_WORD_APOSTROPHE = r"([\p{L}\p{M}])['\x{2019}](\p{L})"
# 4. Tags in square or angle brackets ([music], <noise>, <|hi|>) are annotations, not speech:
#    removed with their contents. Every Unicode punctuation or symbol character (Latin and Indic:
#    . , ! ? " ( ) danda U+0964, double danda U+0965, guillemets, curly quotes, low-9 quote,
#    ellipsis, hyphen, en and em dash, Urdu full stop, comma and question mark, $ % + ...) becomes
#    a space, so "ek-do" and "a...b" stay two words instead of being glued into one. Control
#    characters count as whitespace. The same pass collapses every run of them into one space.
#    A run that is a single plain space is its own result, so the pattern skips it (most word gaps
#    are one space, and each match costs time): it matches the runs holding a tag, a mark or other
#    whitespace, and the runs of two or more spaces.
_TAG_OR_MARK = rf"(?:\[[^\[\]]*\]|<[^<>]*>|[[\p{{P}}\p{{S}}\p{{Cc}}\s{_ZW_SPACE}]--[ ]])"
_TAGS_PUNCT_SPACE = rf" *{_TAG_OR_MARK}(?:{_TAG_OR_MARK}| )*| {{2,}}"
# 6. A ZWNJ/ZWJ spells something only inside a word or after a combining sign: one that starts a
#    word, stands alone, or ends a word after anything but a combining sign (a chillu ends in
#    VIRAMA + ZWJ, so that one stays) is stray or left over from removed punctuation: deleted with
#    the space it leaves. One pass: the first branch takes word-initial runs, the second a word's
#    trailing run together with the spaces and word-initial joiners after it.
_STRAY_JOINERS = (
    rf"(^|\s)[\s{_ZW_JOINERS}]*[{_ZW_JOINERS}]\s*"
    rf"|([^\p{{M}}{_ZW_JOINERS}])[{_ZW_JOINERS}]+(?:(\s)[\s{_ZW_JOINERS}]*|$)"
)
# The only joiners rule 6 can remove, since rules 3-4 turn their neighbours into spaces: one after
# anything but a letter, a sign or another joiner (or at the start), and a run before anything but
# those (or at the end) unless a combining sign precedes it. A chillu (NA + VIRAMA + ZWJ) ending a
# word matches neither, so Malayalam text takes the single-pass path.
_EDGE_JOINER = (
    rf"(?:^|[^\p{{L}}\p{{M}}{_ZW_JOINERS}])[{_ZW_JOINERS}]"
    rf"|[^\p{{M}}{_ZW_JOINERS}][{_ZW_JOINERS}]+(?:[^\p{{L}}\p{{M}}{_ZW_JOINERS}]|$)"
)
# Rows that none of these match are left unchanged by rules 3, 5 and 6, so they skip those passes:
# bit flags of the extra passes a row needs, with the pattern that says it needs them.
_APOSTROPHE_PASSES, _JOINER_PASS = 1, 2
_PASS_NEEDED_WHERE = {_APOSTROPHE_PASSES: _IN_WORD_APOSTROPHE, _JOINER_PASS: _EDGE_JOINER}

# The single-pass path (``clean_text_column``) does rules 3-5 without capture groups, which cost
# Rust regex a slower engine on every match: rule 4's pass leaves apostrophes alone, so that each
# neighbour an apostrophe had that was a tag, a mark or whitespace is now a space; an apostrophe
# then stands in a word when it is alone between a letter or sign and a letter, and every other
# one is in a run of apostrophes and spaces that holds a space or two apostrophes or touches an
# end: the run becomes one space. That holds while an apostrophe's neighbours are letters, signs,
# spaces or apostrophes; a row with one after anything else (a digit, a joiner) or before anything
# but a letter takes the multi-pass path.
_APOSTROPHES = "'\u2019"
_TAG_OR_MARK_BUT_APOSTROPHE = _TAG_OR_MARK.replace("--[ ]]", f"--[ {_APOSTROPHES}]]")
_TAGS_PUNCT_SPACE_BUT_APOSTROPHES = (
    rf" *{_TAG_OR_MARK_BUT_APOSTROPHE}(?:{_TAG_OR_MARK_BUT_APOSTROPHE}| )*"
    rf"| {{2,}}"
)
_A = f"[{_APOSTROPHES}]"
_APOSTROPHES_OUTSIDE_WORDS = (
    rf" +{_A}[ {_APOSTROPHES}]*|{_A}+ [ {_APOSTROPHES}]*"
    rf"|{_A}{{2,}}[ {_APOSTROPHES}]*|^{_A}+[ {_APOSTROPHES}]*|{_A}+$"
)
_APOSTROPHE_ODD_NEIGHBOUR = rf"[^\p{{L}}\p{{M}} {_APOSTROPHES}]{_A}|{_A}[^\p{{L}} {_APOSTROPHES}]"

STYLES = ("plain", "punctuated")
# The punctuated style keeps these where the text has them: the marks a model that writes
# punctuation (Parakeet-TDT 0.6B v2/v3) writes, and their Indic and Arabic-script counterparts.
# Quotes, brackets, dashes and symbols go as in the plain style: what a speaker says is the same
# with or without them, and bases write them inconsistently.
SENTENCE_MARKS = ".,?!;:\u0964\u0965\u060c\u061f\u06d4"
_M = f"[{SENTENCE_MARKS}]"
_TAG_OR_MARK_BUT_SENTENCE = _TAG_OR_MARK.replace("--[ ]]", f"--[ {SENTENCE_MARKS}]]")
_TAGS_PUNCT_SPACE_BUT_SENTENCE = (
    rf" *{_TAG_OR_MARK_BUT_SENTENCE}(?:{_TAG_OR_MARK_BUT_SENTENCE}| )*| {{2,}}"
)
# A joiner between a letter and a kept mark, or right after a mark, spells nothing (as a joiner at
# a word's edge in rule 6); one after a combining sign (a chillu) stays.
_JOINER_AT_MARK = rf"([^\p{{M}}{_ZW_JOINERS}])[{_ZW_JOINERS}]+({_M})|({_M})[{_ZW_JOINERS}]+"
# A kept mark belongs to the word before it ("what ?" -> "what?", "है ।" -> "है।"); a mark with
# no word before it (the text's start, after a removed tag) is dropped with the spaces around it.
_SPACE_BEFORE_MARK = rf" +({_M})"
_LEADING_MARKS = rf"^[ {SENTENCE_MARKS}]+"


def _clean(
    expr: pl.Expr, apostrophes: bool = True, joiners: bool = True, punctuated: bool = False
) -> pl.Expr:
    """Rules 3-7 on text that rules 1-2 made; a rule that cannot change a row may be switched off.
    ``punctuated``: rule 4 keeps ``SENTENCE_MARKS``, and rule 8 attaches them to their word."""
    placeholder = r"${1}" + _APOSTROPHE_SLOT + r"${2}"
    if apostrophes:
        expr = expr.str.replace_all(_IN_WORD_APOSTROPHE, placeholder).str.replace_all(
            _IN_WORD_APOSTROPHE, placeholder
        )
    expr = expr.str.replace_all(
        _TAGS_PUNCT_SPACE_BUT_SENTENCE if punctuated else _TAGS_PUNCT_SPACE, " "
    )
    if apostrophes:
        expr = expr.str.replace_all(_APOSTROPHE_SLOT, "'", literal=True)
    if joiners:
        expr = expr.str.replace_all(_STRAY_JOINERS, "${1}${2}${3}")
    if punctuated:
        expr = (
            expr.str.replace_all(_JOINER_AT_MARK, "${1}${2}${3}")
            .str.replace_all(_SPACE_BEFORE_MARK, "${1}")
            .str.replace_all(_LEADING_MARKS, "")
        )
    return expr.str.strip_chars()


def _regex_v1(pattern: str):
    """``pattern`` (Rust-regex syntax, as the polars passes use it) compiled by the ``regex``
    package in its V1 mode, which reads the same set operations (``&&``, ``--``) and ``\\p{..}``
    classes; ``\\x{..}`` escapes are rewritten as ``\\U........``."""
    import re

    import regex

    pattern = re.sub(r"\\x\{([0-9A-Fa-f]+)\}", lambda m: f"\\U{int(m[1], 16):08X}", pattern)
    return regex.compile(pattern, flags=regex.V1)


@functools.cache
def _rules_without_polars(style: str) -> list:
    """Rules 1 and 3-8 of ``style`` as (compiled pattern, replacement) pairs, in ``_clean``'s
    order; ``(None, "NFC")`` stands for rule 2."""
    slot = r"\g<1>" + _APOSTROPHE_SLOT + r"\g<2>"
    punctuated = style == "punctuated"
    rules = [
        (_regex_v1(_INVISIBLE), ""),
        (None, "NFC"),
        (_regex_v1(_IN_WORD_APOSTROPHE), slot),
        (_regex_v1(_IN_WORD_APOSTROPHE), slot),
        (_regex_v1(_TAGS_PUNCT_SPACE_BUT_SENTENCE if punctuated else _TAGS_PUNCT_SPACE), " "),
        (_regex_v1(_APOSTROPHE_SLOT), "'"),
        (_regex_v1(_STRAY_JOINERS), r"\g<1>\g<2>\g<3>"),
    ]
    if punctuated:
        rules += [
            (_regex_v1(_JOINER_AT_MARK), r"\g<1>\g<2>\g<3>"),
            (_regex_v1(_SPACE_BEFORE_MARK), r"\g<1>"),
            (_regex_v1(_LEADING_MARKS), ""),
        ]
    return rules


def clean_text_without_polars(text: str, style: str = "plain") -> str:
    """``clean_text(text, style)`` where polars is not installed: the same rules, the same
    patterns, run by the ``regex`` package (NeMo brings it, through transformers) one string at a
    time. A training node installed from the training-only wheelhouse has no polars, and its
    validation scores through this (``evaluation.normalize_for_scoring``, and
    ``punctuation_scoring`` in the punctuated style); tests hold it equal to ``clean_text``."""
    for pattern, replacement in _rules_without_polars(check_style(style)):
        if pattern is None:
            text = unicodedata.normalize("NFC", text)
        else:  # a group that took no part gives "", as polars' ${n} does
            text = pattern.sub(replacement, text)
    return text.strip()


def check_style(style: str, variable: str = "TRANSCRIPT_STYLE") -> str:
    """``style`` when it is one of ``STYLES``; else ValueError naming ``variable``."""
    if style not in STYLES:
        raise ValueError(f"{variable}={style!r}: expected one of {', '.join(STYLES)}")
    return style


def clean_text_expr(expr: pl.Expr) -> pl.Expr:
    """Every cleaning rule as one polars expression (null stays null); see ``clean_text``.

    Runs every pass on every row; ``clean_text_column`` gives the same result faster.
    """
    return _clean(expr.str.replace_all(_INVISIBLE, "").str.normalize("NFC"))


@functools.cache
def _nfc_may_change() -> str:
    """A regex matching every text that NFC could change (and a few it leaves alone).

    From the Unicode quick-check idea: a text is already NFC unless it holds a character NFC never
    outputs, two adjacent combining marks that ordering could swap, a character that composes
    with the next one, or a decomposable character followed by a combining mark. Built once from
    ``unicodedata``; ``clean_text_column`` normalizes only the rows it matches.
    """
    never, combining, decomposable, firsts, seconds = set(), set(), set(), set(), set()
    for cp in range(0x30000):  # all canonical decompositions lie below U+30000
        ch = chr(cp)
        if unicodedata.combining(ch):
            combining.add(ch)
        decomposition = unicodedata.decomposition(ch)
        if not decomposition or decomposition.startswith("<"):
            continue
        if unicodedata.normalize("NFC", ch) != ch:
            never.add(ch)
            continue
        decomposable.add(ch)
        parts = decomposition.split()
        if len(parts) == 2:
            firsts.add(chr(int(parts[0], 16)))
            seconds.add(chr(int(parts[1], 16)))

    def cls(chars: set[str]) -> str:  # as ranges of consecutive code points: quicker to compile
        points = sorted(map(ord, chars))
        starts = [p for i, p in enumerate(points) if i == 0 or points[i - 1] != p - 1]
        ends = [p for i, p in enumerate(points) if i == len(points) - 1 or points[i + 1] != p + 1]
        return (
            "["
            + "".join(
                f"\\x{{{a:X}}}" + (f"-\\x{{{b:X}}}" if b > a else "") for a, b in zip(starts, ends)
            )
            + "]"
        )

    hangul_jamo = r"[\x{1100}-\x{11FF}]"  # composed by algorithm, not by the decomposition table
    return (
        f"{cls(never)}|{cls(combining)}{cls(combining)}|{cls(firsts)}{cls(seconds)}"
        f"|{cls(decomposable)}{cls(combining | seconds)}|{hangul_jamo}"
    )


def _delete_invisibles_and_normalize(texts: pl.Series) -> pl.Series:
    """Rules 1 and 2, run only on the rows holding an invisible character or a character NFC
    could change (most text is NFC already, and normalizing costs several regex passes)."""
    may_change = texts.str.contains(f"{_INVISIBLE}|{_nfc_may_change()}").fill_null(False)
    if not may_change.any():
        return texts
    idx = may_change.arg_true()
    return texts.scatter(
        idx, texts.gather(idx).str.replace_all(_INVISIBLE, "").str.normalize("NFC")
    )


@functools.cache
def _needs_more_than_one_pass() -> str:
    """A regex matching every text that rule 1, 2 or 6 could change (and a few more).

    A text it does not match holds no invisible character (rule 1), is NFC already (rule 2) and
    holds no joiner rule 6 could remove: its cleaning is rules 3-5 as ``clean_text_column``'s
    single pass (and, with an apostrophe, the pass after it) and the trim. One alternation costs
    about as much as one of its parts, so this single check replaces three on most rows.
    """
    return "|".join(f"(?:{pattern})" for pattern in (_INVISIBLE, _nfc_may_change(), _EDGE_JOINER))


def _clean_special(texts: pl.Series) -> pl.Series:
    """``clean_text_column`` on rows that may need more than rules 4 and 7: ``_delete_invisibles_and_normalize``, then
    rows are grouped by which of rules 3, 5 and 6 can change them, and each group runs only those."""
    t = pl.col("t")
    frame = (
        pl.DataFrame({"t": _delete_invisibles_and_normalize(texts)})
        .with_row_index("i")
        .with_columns(
            pl.sum_horizontal(
                flag * t.str.contains(pattern).fill_null(False).cast(pl.UInt8)
                for flag, pattern in _PASS_NEEDED_WHERE.items()
            ).alias("passes")
        )
    )
    parts = [
        frame.filter(pl.col("passes") == passes).select(
            "i", _clean(t, bool(passes & _APOSTROPHE_PASSES), bool(passes & _JOINER_PASS))
        )
        for passes in sorted(frame.get_column("passes").unique().to_list())
    ]
    return pl.concat(parts).sort("i").get_column("t")


def clean_text_column(texts: pl.Series, style: str = "plain") -> pl.Series:
    """``clean_text`` over a string Series, vectorized (null stays null), in ``style``.

    The punctuated style runs every pass on every row (rules 1-2 only where they can change it).

    Most transcripts hold no invisible character, are NFC already and hold no joiner at a word
    edge: one check finds them, and they take a single tags/punctuation/space pass and the trim
    instead of all seven rules, plus, for those holding an apostrophe, one pass that turns the
    apostrophes outside words into spaces (see ``_APOSTROPHES_OUTSIDE_WORDS``). The others, and
    the rows with an apostrophe beside a digit or a joiner, go through ``_clean_special``. Tests
    check that this equals ``clean_text_expr`` on every row.
    """
    texts = texts.cast(pl.String)
    if check_style(style) == "punctuated":
        return (
            pl.DataFrame({"t": _delete_invisibles_and_normalize(texts)})
            .select(_clean(pl.col("t"), punctuated=True))
            .get_column("t")
            .alias(texts.name)
        )
    t, special, apostrophe, odd = (
        pl.col("t"),
        pl.col("special"),
        pl.col("apostrophe"),
        pl.col("odd"),
    )
    frame = (
        pl.DataFrame({"t": texts})
        .with_row_index("i")
        .with_columns(
            special=t.str.contains(_needs_more_than_one_pass()).fill_null(False),
            apostrophe=t.str.contains_any(list(_APOSTROPHES)).fill_null(False),
        )
    )
    any_special, any_apostrophe = frame.select(special.any(), apostrophe.any()).row(0)
    if not (any_special or any_apostrophe):
        return texts.str.replace_all(_TAGS_PUNCT_SPACE, " ").str.strip_chars()
    one_pass = (frame.filter(~special) if any_special else frame).with_columns(
        t.str.replace_all(_TAGS_PUNCT_SPACE_BUT_APOSTROPHES, " ")
    )
    with_apostrophe = one_pass.filter(apostrophe).with_columns(
        odd=t.str.contains(_APOSTROPHE_ODD_NEIGHBOUR)
    )
    in_words = (
        t.str.replace_all(_APOSTROPHES_OUTSIDE_WORDS, " ")
        .str.replace_all("\u2019", "'", literal=True)
        .str.strip_chars()
    )
    parts = [
        one_pass.filter(~apostrophe).select("i", t.str.strip_chars()),
        with_apostrophe.filter(~odd).select("i", in_words),
    ]
    odd_rows = with_apostrophe.filter(odd).get_column("i")
    if any_special or odd_rows.len():
        rest = frame.filter(special | pl.col("i").is_in(odd_rows.implode()))
        parts.append(rest.select("i", _clean_special(rest.get_column("t")).alias("t")))
    return pl.concat(parts).sort("i").get_column("t").alias(texts.name)


# Texts that send rows down every cleaning pass (an in-word apostrophe, an invisible mark, a stray
# joiner, a text NFC changes, plain punctuation, apostrophes in and outside words, an apostrophe
# after a digit), so one call compiles every regex.
WARM_UP_TEXTS = [
    "don\u2019t\u200f",
    "x\u200d y",
    "e\u0301 [t]",
    "a, b",
    "a\u2019b\u200d",
    "it's 'x'",
    "9'a",
]


def clean_texts(texts: Sequence[str | None], style: str = "plain") -> list[str | None]:
    """``clean_text`` over a sequence."""
    return clean_text_column(pl.Series("t", list(texts), dtype=pl.String), style).to_list()


def clean_text(text: str, style: str = "plain") -> str:
    """Clean one transcript in ``style`` (``STYLES``); the rules, in order:

    1. Invisible format characters deleted (bidi marks, BOM, soft hyphen, word joiner), except
       ZWNJ/ZWJ (Indic conjunct control, Malayalam chillus); the zero-width space separates words.
    2. Unicode NFC, so that one spelling has one code-point sequence.
    3. Apostrophes between two letters kept and written as ``'`` ("don’t" -> "don't"); every other
       quote is punctuation.
    4. Tags in brackets removed with their contents: ``[music]``, ``<noise>``, ``<|en|>``. All other
       punctuation and symbols (danda, double danda, quotes incl. « » ‘ ’ “ ” „, ellipsis, dashes,
       brackets, ...) replaced by a space, so neighbouring words are never glued; whitespace runs
       collapsed to one space.
    5. (the apostrophes of rule 3 are restored)
    6. ZWNJ/ZWJ that spell nothing removed: alone, at the start of a word, or at the end of a word
       after anything but a combining sign (a chillu, NA + VIRAMA + ZWJ, ends a word and stays).
    7. Leading and trailing whitespace trimmed.
    8. Punctuated style only: rule 4 keeps ``SENTENCE_MARKS`` (. , ? ! ; : danda, double danda,
       Arabic comma, question mark and full stop), written as they are; the spaces before one are
       removed, so it ends the word before it ("what ?" -> "what?"), and marks with no word before
       them are dropped. Case is never changed, in either style.
    """
    return clean_texts([text], style)[0] or ""
