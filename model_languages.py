"""The languages a model was trained on, as this project records them, and the base languages that
the replay floor (BASE_LANGUAGE_SHARE) keeps in a finetune's mix.

A model train.py trains carries its languages in its config (``trained_languages``): those of its
training data and, for a finetune, those of its base. Its step checkpoints (their portable
description) and every .nemo exported from it carry that config, so a later finetune starting from
either reads them back (``recorded_languages``). A base from elsewhere (a pretrained name, another
project's .nemo) records none, and a finetune of it that keeps a floor needs BASE_LANGUAGES: its
languages are never guessed (a new language written in the base's script needs no new pieces of
the tokenizer, yet the base never learned it).

Usage::

    languages = base_languages()          # BASE_LANGUAGES, else INIT_MODEL's record; None: unknown
    check_base_languages(languages, data_languages, share)   # BaseLanguagesUnknown when needed
    record_trained_languages(model, trained_languages(languages, data_languages))
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterable
from pathlib import Path

import config
from process_control import UserError

# The key of a model's config (and so of its .nemo's model_config.yaml) that lists its languages.
CONFIG_KEY = "trained_languages"


class BaseLanguagesUnknown(UserError, ValueError):
    """The replay floor is on and the base's languages are neither recorded nor set."""


def base_languages(init_model: str | None = None) -> tuple[str, ...] | None:
    """The languages the base model (``init_model``, default INIT_MODEL) was trained on: BASE_LANGUAGES
    when set; () for a model trained from scratch (no INIT_MODEL: no base); else what the base
    records (``recorded_languages``); None when that is unknown."""
    init_model = config.INIT_MODEL if init_model is None else init_model
    if config.BASE_LANGUAGES:
        return tuple(config.BASE_LANGUAGES)
    if not init_model:
        return ()
    return recorded_languages(init_model)


def recorded_languages(model_path: str) -> tuple[str, ...] | None:
    """The languages a model this project trained records: a .nemo's (or unpacked .nemo
    directory's) model_config.yaml ``trained_languages``; a step checkpoint's model config the same,
    or, written before they were recorded, the training languages of a run from scratch (its run
    record: such a run has no base). None for anything else: a pretrained name, a model from
    elsewhere, an unreadable file."""
    path = Path(model_path)
    try:
        if path.suffix == ".ckpt":
            return _checkpoint_languages(path)
        if path.is_dir():
            return _config_languages((path / "model_config.yaml").read_text(encoding="utf-8"))
        if path.is_file():
            with tarfile.open(path, "r:*") as archive:
                for member in archive:
                    if Path(member.name).name == "model_config.yaml":
                        text = archive.extractfile(member).read().decode("utf-8")
                        return _config_languages(text)
    except (OSError, tarfile.TarError, UnicodeDecodeError, ValueError):
        return None
    return None


def _config_languages(text: str) -> tuple[str, ...] | None:
    import yaml

    languages = (yaml.safe_load(text) or {}).get(CONFIG_KEY)
    return tuple(str(lang) for lang in languages) if isinstance(languages, list) else None


def _checkpoint_languages(path: Path) -> tuple[str, ...] | None:
    import checkpoints

    checkpoint = checkpoints.read_checkpoint(path, mmap=True)
    model_config = (checkpoint.get(checkpoints.PORTABLE_KEY) or {}).get("config") or {}
    languages = model_config.get(CONFIG_KEY)
    if isinstance(languages, list):
        return tuple(str(lang) for lang in languages)
    record = checkpoint.get(checkpoints.RUN_RECORD_KEY) or {}
    settings = record.get("settings") or {}
    if (
        record.get("training_hours")
        and not record.get("base_model")
        and not settings.get("INIT_MODEL")
    ):
        return tuple(sorted(record["training_hours"]))
    return None


def check_base_languages(
    base: tuple[str, ...] | None, data_languages: Iterable[str], share: float
) -> None:
    """BaseLanguagesUnknown when the replay floor could act (``share`` > 0, data of two or more
    languages) and the base's languages ``base`` are unknown (None)."""
    data = sorted(set(data_languages))
    if base is None and share > 0 and len(data) > 1:
        raise BaseLanguagesUnknown(unknown_message(share, data))


def unknown_message(share: float, data_languages: Iterable[str]) -> str:
    """What to set when the floor is on and the base's languages are unknown (one line)."""
    return (
        f"BASE_LANGUAGE_SHARE={share:g} keeps the base model's languages in the mix, but "
        f"INIT_MODEL={config.INIT_MODEL} records none (a model this project did not train): set "
        f"BASE_LANGUAGES to the languages it was trained on, comma-separated (the data has "
        f"{', '.join(sorted(set(data_languages)))}), or BASE_LANGUAGE_SHARE=0 for no floor"
    )


def trained_languages(
    base: tuple[str, ...] | None, data_languages: Iterable[str], init_model: str | None = None
) -> tuple[str, ...] | None:
    """The languages a model trained on ``data_languages`` knows: those alone from scratch (no
    ``init_model``, default INIT_MODEL), with its base's ``base`` for a finetune; None when the
    base's are unknown."""
    init_model = config.INIT_MODEL if init_model is None else init_model
    if not init_model:
        return tuple(sorted(set(data_languages)))
    if base is None:
        return None
    return tuple(sorted(set(base) | set(data_languages)))


def record_trained_languages(model, languages: tuple[str, ...] | None) -> None:
    """Write ``languages`` into ``model``'s config (``CONFIG_KEY``), which its checkpoints and
    .nemo exports carry; None removes what its base's config said (unknown is not the base's)."""
    from omegaconf import open_dict

    with open_dict(model.cfg):
        if languages is None:
            model.cfg.pop(CONFIG_KEY, None)
        else:
            model.cfg[CONFIG_KEY] = list(languages)


# In a tokenizer directory (scripts/train_tokenizer.py writes it): per language, how many letters
# of each script (script_languages.letter_script) a sample of its training texts holds.
LANGUAGE_SCRIPTS_FILE = "language_scripts.json"
# The key of a model's config that lists, per language, the scripts it is written in.
SCRIPTS_KEY = "language_scripts"
# A script counts as one a language is written in from this share of its letters on: code-mixed
# English words in Hindi transcripts are in, a stray character of another script is out.
SCRIPT_MIN_SHARE = 0.01


def write_language_scripts(tokenizer_dir: Path, letters: dict[str, dict[str, int]]) -> None:
    """``LANGUAGE_SCRIPTS_FILE`` in ``tokenizer_dir``: ``letters[lang][script]``, letters counted."""
    record = {lang: dict(sorted(counts.items())) for lang, counts in sorted(letters.items())}
    (Path(tokenizer_dir) / LANGUAGE_SCRIPTS_FILE).write_text(
        json.dumps(record, indent=1, ensure_ascii=False), encoding="utf-8"
    )


def read_language_scripts(tokenizer_dir: Path) -> dict[str, dict[str, int]] | None:
    """What ``write_language_scripts`` stored in ``tokenizer_dir``; None when there is none (a
    tokenizer directory from elsewhere) or it is not such a record."""
    try:
        record = json.loads((Path(tokenizer_dir) / LANGUAGE_SCRIPTS_FILE).read_text("utf-8"))
        return {
            str(lang): {str(script): int(n) for script, n in counts.items()}
            for lang, counts in record.items()
        }
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def scripts_written_in(letters: dict[str, int]) -> list[str]:
    """The scripts holding at least SCRIPT_MIN_SHARE of ``letters`` (script -> count), sorted."""
    total = sum(letters.values())
    return sorted(s for s, n in letters.items() if n > 0 and n >= SCRIPT_MIN_SHARE * total)


def record_language_scripts(model, tokenizer_dir: Path) -> dict[str, list[str]]:
    """Write into ``model``'s config (``SCRIPTS_KEY``), which its checkpoints and .nemo exports
    carry, the scripts each language is written in: those of ``tokenizer_dir``'s record for the
    languages it counted, the base's record (the config ``model`` starts from) for the others.
    Returns what was written ({} and nothing written when neither records any)."""
    from omegaconf import open_dict

    scripts = dict(language_scripts(model))
    counted = read_language_scripts(tokenizer_dir) or {}
    scripts.update({lang: scripts_written_in(letters) for lang, letters in counted.items()})
    out = {lang: sorted(scripts[lang]) for lang in sorted(scripts)}
    if out:
        with open_dict(model.cfg):
            model.cfg[SCRIPTS_KEY] = out
    return out


def language_scripts(model) -> dict[str, frozenset[str]]:
    """Per language, the scripts ``model``'s config records it written in; {} when it records none
    (a model this project did not train, or trained before it recorded them)."""
    recorded = (getattr(model, "cfg", None) or {}).get(SCRIPTS_KEY) or {}
    try:
        return {str(lang): frozenset(str(s) for s in scripts) for lang, scripts in recorded.items()}
    except (AttributeError, TypeError):
        return {}
