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
