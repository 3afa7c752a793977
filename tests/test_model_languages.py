"""The base's languages that the replay floor (BASE_LANGUAGE_SHARE) keeps are those the base was
trained on: recorded by this project in what it trains and exports (model_languages.py), else named
in BASE_LANGUAGES, never guessed from the tokenizer."""

from __future__ import annotations

import io
import json
import logging
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest

import config
import model_languages
import vocabulary
from sampler import BatchingSettings, DurationBucketBatchSampler

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_tdt.yaml"


def nemo_file(path: Path, model_config: dict) -> Path:
    """A .nemo as NeMo writes one (an uncompressed tar with ./model_config.yaml first), reduced to
    its config."""
    import yaml

    data = yaml.safe_dump(model_config).encode()
    with tarfile.open(path, "w:") as archive:
        info = tarfile.TarInfo("./model_config.yaml")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
        weights = tarfile.TarInfo("./model_weights.ckpt")
        weights.size = 4
        archive.addfile(weights, io.BytesIO(b"\0" * 4))
    return path


@pytest.fixture
def english_base(tmp_path, monkeypatch):
    """INIT_MODEL: an English base this project trained (its .nemo records en); TOKENIZER_DIR: its
    tokenizer extended for Swahili, which needed no new pieces (0 appended, as English); the floor
    at its default, natural shares."""
    summary = {
        "mode": "extend",
        "extension": {"base_pieces": 1024},
        "per_language": {
            "en": {"appended_piece_share": 0.0},
            "sw": {"appended_piece_share": 0.0},
        },
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    monkeypatch.setattr(config, "TOKENIZER_DIR", tmp_path)
    base = nemo_file(tmp_path / "english.nemo", {"trained_languages": ["en"], "sample_rate": 16000})
    monkeypatch.setattr(config, "INIT_MODEL", str(base))
    monkeypatch.setattr(config, "BASE_LANGUAGES", ())
    monkeypatch.setattr(config, "BASE_LANGUAGE_SHARE", 0.25)
    monkeypatch.setattr(config, "TEMPERATURE", 1.0)
    return base


def swahili_data(english_share: float = 0.012, n: int = 5_000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    durations = rng.uniform(2.0, 12.0, n)
    languages = np.where(np.arange(n) < round(english_share * n), "en", "sw")
    return durations, languages


def log_levers(settings, data_languages, caplog) -> str:
    import train

    with caplog.at_level(logging.INFO, logger=train.log.name):
        train.log_finetuning_levers(types.SimpleNamespace(), settings, data_languages)
    return caplog.text


def test_swahili_onto_an_english_base_keeps_english_at_base_language_share(english_base, caplog):
    settings = BatchingSettings.from_config()
    assert settings.base_languages == ("en",)
    durations, languages = swahili_data()
    sampler = DurationBucketBatchSampler(durations, languages, settings)
    assert sampler.epoch_stats()["target_share"]["en"] == pytest.approx(0.25)
    assert sampler.base_languages == ["en"]
    text = log_levers(settings, ["en", "sw"], caplog)
    assert (
        "the base's languages (en, from INIT_MODEL's record) keep at least "
        "BASE_LANGUAGE_SHARE=0.25 of the mix" in text
    )


@pytest.mark.parametrize("kind", ["pretrained name", "another project's .nemo"])
def test_a_base_that_records_no_languages_stops_a_run_with_the_floor_naming_base_languages(
    english_base, monkeypatch, tmp_path, kind
):
    foreign = (
        "nvidia/parakeet-tdt-0.6b-v2"
        if kind == "pretrained name"
        else str(nemo_file(tmp_path / "theirs.nemo", {"sample_rate": 16000}))
    )
    monkeypatch.setattr(config, "INIT_MODEL", foreign)
    settings = BatchingSettings.from_config()
    assert settings.base_languages is None
    durations, languages = swahili_data()
    with pytest.raises(model_languages.BaseLanguagesUnknown) as caught:
        DurationBucketBatchSampler(durations, languages, settings)
    message = str(caught.value)
    assert "\n" not in message
    assert f"INIT_MODEL={foreign} records none" in message
    assert "set BASE_LANGUAGES to the languages it was trained on" in message
    assert "(the data has en, sw)" in message and "BASE_LANGUAGE_SHARE=0" in message


def test_without_the_floor_or_with_one_language_the_base_languages_are_not_needed(
    english_base, monkeypatch
):
    monkeypatch.setattr(config, "INIT_MODEL", "nvidia/parakeet-tdt-0.6b-v2")
    durations, languages = swahili_data()
    off = BatchingSettings.from_config(base_share=0.0)
    assert DurationBucketBatchSampler(durations, languages, off).epoch_stats()["target_share"][
        "en"
    ] == pytest.approx(0.012)
    one = BatchingSettings.from_config()
    DurationBucketBatchSampler(durations, np.full(len(durations), "sw"), one)


def test_base_languages_overrides_the_record_and_one_missing_from_the_data_keeps_nothing(
    english_base, monkeypatch, caplog
):
    monkeypatch.setattr(config, "BASE_LANGUAGES", ("fr",))
    settings = BatchingSettings.from_config()
    assert settings.base_languages == ("fr",)
    durations, languages = swahili_data()
    sampler = DurationBucketBatchSampler(durations, languages, settings)
    assert sampler.epoch_stats()["target_share"]["en"] == pytest.approx(0.012)
    text = log_levers(settings, ["en", "sw"], caplog)
    assert (
        "BASE_LANGUAGE_SHARE=0.25 keeps nothing: the base's languages (fr, from BASE_LANGUAGES) "
        "are not in the training data (en, sw)" in text
    )
    assert "keep at least" not in text


def test_a_model_from_scratch_has_no_base_and_knows_only_its_data(monkeypatch):
    monkeypatch.setattr(config, "INIT_MODEL", "")
    monkeypatch.setattr(config, "BASE_LANGUAGES", ())
    assert model_languages.base_languages() == ()
    assert model_languages.trained_languages((), ["sw", "en"]) == ("en", "sw")


def test_a_finetune_knows_its_bases_languages_and_its_datas_or_nothing_when_they_are_unknown(
    monkeypatch,
):
    monkeypatch.setattr(config, "INIT_MODEL", "base.nemo")
    assert model_languages.trained_languages(("en",), ["sw", "en"]) == ("en", "sw")
    assert model_languages.trained_languages(None, ["sw", "en"]) is None


def test_a_model_trained_here_carries_its_languages_into_its_nemo_and_back(tmp_path):
    from nemo.collections.asr.models import ASRModel

    import asr_model
    from tests.tiny_training_data import make_training_data

    data = make_training_data(tmp_path, per_lang=4, langs=("hi", "en"), vocab_size=64)
    model = asr_model.build_model("", TINY, data["tokenizer"])
    model_languages.record_trained_languages(model, ("en", "sw"))
    model.save_to(str(tmp_path / "trained.nemo"))
    assert model_languages.recorded_languages(str(tmp_path / "trained.nemo")) == ("en", "sw")
    restored = ASRModel.restore_from(str(tmp_path / "trained.nemo"), map_location="cpu")
    # A finetune of it whose base's languages are unknown must not pass the old ones on.
    model_languages.record_trained_languages(restored, None)
    restored.save_to(str(tmp_path / "finetuned.nemo"))
    assert model_languages.recorded_languages(str(tmp_path / "finetuned.nemo")) is None


def test_a_step_checkpoint_records_its_models_languages_and_an_older_run_from_scratch_its_data(
    tmp_path,
):
    import torch

    import asr_model
    import training_step

    ckpt = tmp_path / "step_00000004.ckpt"
    torch.save({asr_model.PORTABLE_KEY: {"config": {"trained_languages": ["en", "hi"]}}}, ckpt)
    assert model_languages.recorded_languages(str(ckpt)) == ("en", "hi")
    older = {
        training_step.RUN_RECORD_KEY: {
            "base_model": None,
            "settings": {"INIT_MODEL": ""},
            "training_hours": {"ta": 1.0, "hi": 2.0},
        }
    }
    torch.save(older, ckpt)
    assert model_languages.recorded_languages(str(ckpt)) == ("hi", "ta")
    older[training_step.RUN_RECORD_KEY]["settings"]["INIT_MODEL"] = "nvidia/parakeet-tdt-0.6b-v2"
    torch.save(older, ckpt)
    assert model_languages.recorded_languages(str(ckpt)) is None  # its base's are unknown


def test_the_scripts_of_each_language_travel_in_the_model_and_a_finetune_adds_its_own(tmp_path):
    """train.py records, per language, the scripts its tokenizer's sampled texts are written in
    (a script from 1% of the letters on); a model restored from its .nemo reads them back, and
    a finetune of it keeps the base's record for the languages its own tokenizer did not count."""
    from nemo.collections.asr.models import ASRModel

    import asr_model
    from tests.tiny_training_data import make_training_data

    data = make_training_data(tmp_path, per_lang=4, langs=("hi", "en"), vocab_size=64)
    model = asr_model.build_model("", TINY, data["tokenizer"])
    assert vocabulary.language_scripts(model) == {}
    counts = {"hi": {"Devanagari": 950, "Latin": 50}, "te": {"Telugu": 995, "Latin": 5}}
    vocabulary.write_language_scripts(data["tokenizer"], counts)
    assert vocabulary.read_language_scripts(data["tokenizer"]) == counts
    written = vocabulary.record_language_scripts(model, data["tokenizer"])
    assert written == {"hi": ["Devanagari", "Latin"], "te": ["Telugu"]}
    model.save_to(str(tmp_path / "base.nemo"))
    restored = ASRModel.restore_from(str(tmp_path / "base.nemo"), map_location="cpu")
    assert vocabulary.language_scripts(restored)["te"] == frozenset({"Telugu"})
    finetune_tokenizer = tmp_path / "finetune-tokenizer"
    finetune_tokenizer.mkdir()
    vocabulary.write_language_scripts(finetune_tokenizer, {"hi": {"Devanagari": 10}})
    again = vocabulary.record_language_scripts(restored, finetune_tokenizer)
    assert again == {"hi": ["Devanagari"], "te": ["Telugu"]}
    # a tokenizer directory without the record, or with a broken one: the base's stands
    (finetune_tokenizer / vocabulary.LANGUAGE_SCRIPTS_FILE).write_text("[1, 2]")
    assert vocabulary.read_language_scripts(finetune_tokenizer) is None
    assert vocabulary.record_language_scripts(restored, tmp_path) == again
