"""How the text of an environment variable becomes a knob's value (config.py declares the knobs).

Each parser takes the variable's text and returns the value, or raises ValueError saying what is
expected (config.py puts the variable's name and the text in front); each check takes a parsed
value and returns None, or what is expected.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from file_names import is_utf8

# Speed perturbation factors a run may ask for (SPEED_PERTURB): a factor outside is a typo
# ('90,100,110'), not an augmentation.
SPEED_FACTOR_RANGE = (0.5, 2.0)


SPEED_FACTORS_MOST = 16


def integer(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def number(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("expected a finite number")
    return value


def text(raw: str) -> str:
    # A text setting (a run name, INIT_MODEL's or RESUME_FROM's path) is written into run records,
    # hparams and W&B as text: a byte that is not UTF-8 would fail there, after the model and the
    # caches are built, so it fails here, as a path setting does.
    raw = raw.strip()
    if not is_utf8(raw):
        raise ValueError(
            "expected UTF-8 text (bytes that are not UTF-8 shown as \\xNN): for a file, rename it in "
            "UTF-8 or point at a symlink with a UTF-8 name"
        )
    return raw


def path(raw: str) -> Path:
    raw = raw.strip()
    if not raw:
        raise ValueError("expected a path")
    # A path is written into manifests, W&B, run records and model cards as text; a byte that is
    # not UTF-8 would fail there, hours in, so it fails here.
    if not is_utf8(raw):
        raise ValueError(
            "expected a path in UTF-8 (bytes that are not UTF-8 shown as \\xNN): rename it in UTF-8 or "
            "point at a symlink with a UTF-8 name"
        )
    return Path(raw).expanduser()


def languages(raw: str) -> tuple[str, ...]:
    # The data's codes are lower case ('hi', 'en'); 'EN' means the same language.
    codes = tuple(dict.fromkeys(c.strip().lower() for c in raw.split(",") if c.strip()))
    bad = [c for c in codes if not c.replace("-", "").replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"expected comma-separated language codes such as 'hi,en' (bad: {bad})")
    return codes


# What makes a run the run it is: a resume whose checkpoint was trained with other values is
# refused unless RESUME_CHANGES names them (checkpoints.check_resume_settings).
RUN_DEFINING_SETTINGS = (
    "INIT_MODEL",
    "TOKENIZER_DIR",
    "MODEL_CONFIG",
    "TRAIN_MANIFEST_PATH",
    "WANDB_RUN_NAME",
)


def run_defining_settings(raw: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip().upper() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in RUN_DEFINING_SETTINGS]
    if unknown:
        raise ValueError(
            f"expected comma-separated names of {', '.join(RUN_DEFINING_SETTINGS)} (not {unknown})"
        )
    return names


def sources(raw: str) -> tuple[str, ...]:
    return tuple(text(part) for part in raw.split(";") if part.strip())


def boundaries(raw: str) -> tuple[float, ...] | str:
    raw = raw.strip()
    if raw.startswith("auto:"):
        k = raw[5:]
        if not k.isdigit() or int(k) < 2:
            raise ValueError(
                "expected 'auto:K' with an integer K >= 2, or increasing seconds like '3,5,8'"
            )
        return raw
    try:
        values = tuple(float(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise ValueError("expected increasing seconds like '3,5,8,12,16', or 'auto:K'") from None
    if not values or any(v <= 0 or v != v for v in values):
        raise ValueError("expected positive seconds like '3,5,8,12,16', or 'auto:K'")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError("expected strictly increasing seconds like '3,5,8,12,16', or 'auto:K'")
    return values


def speed_factors(raw: str) -> tuple[float, ...]:
    low, high = SPEED_FACTOR_RANGE
    expected = (
        f"expected comma-separated speed factors between {low:g} and {high:g} such as "
        f"'0.9,1.0,1.1' (at most {SPEED_FACTORS_MOST}), or 1 for none"
    )
    try:
        values = tuple(float(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise ValueError(expected) from None
    if len(values) > SPEED_FACTORS_MOST or any(not low <= v <= high for v in values):
        raise ValueError(expected)
    return values if any(v != 1.0 for v in values) else ()


def decibel_range(raw: str) -> tuple[float, float]:
    expected = "expected 'low,high' in dB such as '10,20', or one number for a fixed value"
    try:
        values = [number(v) for v in raw.split(",")]
    except ValueError:
        raise ValueError(expected) from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(expected)
    return (values[0], values[1])


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value

    return parse


def positive(v: float) -> str | None:
    return None if v > 0 else "expected a value > 0"


def non_negative(v: float) -> str | None:
    return None if v >= 0 else "expected a value >= 0"


def zero_or_at_least_two(v: int) -> str | None:
    return None if v == 0 or v >= 2 else "expected 0 (off) or an integer >= 2"
