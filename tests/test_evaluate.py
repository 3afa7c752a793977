"""scripts/evaluate.py, scripts/export_nemo.py and PerLanguageWERCallback on a tiny real model.

The model is configs/tiny_tdt.yaml with a tokenizer trained on the test's manifest (untrained
weights: the hypotheses are garbage, which is fine for checking plumbing and agreement). The callback's
gathering is checked with a fake model whose "decoding" returns each utterance's reference, over two
simulated ranks.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import callbacks
import checkpoints
import config
import evaluation
import model_card
import run_logging
import training_step
from scripts import evaluate, export_nemo
from tests.tiny_training_data import make_training_data

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_model_files(tmp_path_factory)


def tiny_model_files(tmp_path_factory):
    """A manifest, its tokenizer, the tiny model as .nemo and as a train.py-style .ckpt, config pointed at them."""
    import asr_model

    root = tmp_path_factory.mktemp("evaluate")
    data = make_training_data(root, per_lang=6, vocab_size=64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "INIT_MODEL", "")
        mp.setattr(config, "MODEL_CONFIG", REPO / "configs" / "tiny_tdt.yaml")
        mp.setattr(config, "TOKENIZER_DIR", data["tokenizer"])
        mp.setattr(config, "CHECKPOINT_DIR", root / "checkpoints")
        torch.manual_seed(0)
        model = asr_model.build_model()
        weights = {f"model.{k}": v for k, v in model.state_dict().items()}
        # a checkpoint as train.py writes it: weights, the model's description and the run record
        ckpt = root / "checkpoints" / "step_00000010.ckpt"
        ckpt.parent.mkdir()
        torch.save(
            {
                "global_step": 10,
                "state_dict": weights,
                asr_model.PORTABLE_KEY: asr_model.portable_description(model),
                training_step.RUN_RECORD_KEY: RUN_RECORD,
            },
            ckpt,
        )
        bare = root / "bare" / "step_00000010.ckpt"  # weights only: rebuilt from the settings
        bare.parent.mkdir()
        torch.save({"global_step": 10, "state_dict": weights}, bare)
        nemo = model_card.export_nemo(model, root / "tiny.nemo", RUN_RECORD)
        yield SimpleNamespace(
            root=root,
            manifest=data["manifest"],
            tokenizer=data["tokenizer"],
            ckpt=ckpt,
            bare=bare,
            nemo=nemo,
            model=model,
        )


RUN_RECORD = {
    "settings": {"INIT_MODEL": "", "MODEL_CONFIG": "configs/tiny_tdt.yaml", "PHASE2_LR": 3e-4},
    "training_hours": {"hi": 1.5, "en": 0.25},
    "step": 10,
    "world_size": 8,
    "evaluation": {
        "step": 10,
        "loss": 1.25,
        "results": {
            "hi": {
                "utterances": 4,
                "words": 10,
                "word_edits": 3,
                "substitutions": 1,
                "deletions": 1,
                "insertions": 1,
                "chars": 40,
                "char_edits": 4,
            },
        },
    },
}


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_evaluate_prints_a_per_language_table_and_writes_the_csv(tiny, capsys):
    out = tiny.root / "nemo.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(tiny.manifest), "--out", str(out)]) == 0
    rows = read_csv(out)
    assert [r["lang"] for r in rows] == ["en", "hi", "all"]
    assert list(rows[0]) == list(evaluate.CSV_COLUMNS)
    assert int(rows[2]["utterances"]) == int(rows[0]["utterances"]) + int(rows[1]["utterances"]) > 0
    for r in rows:  # corpus-level: the rate is the ratio of the summed counts
        assert float(r["wer"]) == pytest.approx(int(r["word_edits"]) / int(r["words"]), abs=1e-6)
        assert float(r["cer"]) == pytest.approx(int(r["char_edits"]) / int(r["chars"]), abs=1e-6)
    printed = capsys.readouterr().out
    assert "WER" in printed and "CER" in printed and f"wrote {out}" in printed
    assert [
        p.name for p in out.parent.iterdir() if p.name.startswith(".nemo.csv")
    ] == []  # no temporary left


def test_a_training_jobs_noise_settings_do_not_stop_an_evaluation(tiny, monkeypatch, capsys):
    """A shell that still exports the training job's NOISE_* on a machine without its NOISE_DIR:
    evaluation never augments, so it scores; the training dataset still refuses that NOISE_DIR."""
    from dataset import NoiseDirError

    missing = tiny.root / "not_mounted_noise"
    monkeypatch.setattr(config, "NOISE_PROB", 0.5)
    monkeypatch.setattr(config, "NOISE_DIR", missing)
    out = tiny.root / "noise_knobs.csv"
    assert evaluate.main([str(tiny.ckpt), "--manifest", str(tiny.manifest), "--out", str(out)]) == 0
    assert [r["lang"] for r in read_csv(out)] == ["en", "hi", "all"]
    monkeypatch.setattr(config, "TRAIN_MANIFEST_PATH", tiny.manifest)
    with pytest.raises(NoiseDirError, match=f"NOISE_DIR={missing} is not a directory"):
        training_step.build_dataset(tiny.model.tokenizer, progress=False)


def test_a_checkpoint_and_its_nemo_export_get_the_same_rates(tiny):
    a, b, c = tiny.root / "a.csv", tiny.root / "b.csv", tiny.root / "c.csv"
    evaluate.main([str(tiny.nemo), "--manifest", str(tiny.manifest), "--out", str(a)])
    evaluate.main([str(tiny.ckpt), "--manifest", str(tiny.manifest), "--out", str(b)])
    evaluate.main([str(tiny.bare), "--manifest", str(tiny.manifest), "--out", str(c)])
    assert read_csv(a) == read_csv(b) == read_csv(c)


def test_a_checkpoint_rebuilds_its_model_without_the_training_settings(tiny, monkeypatch):
    gone = tiny.root / "moved-away"
    monkeypatch.setattr(config, "MODEL_CONFIG", gone / "tiny_tdt.yaml")
    monkeypatch.setattr(config, "TOKENIZER_DIR", gone / "tokenizer")
    monkeypatch.setattr(config, "INIT_MODEL", "")
    a, b = tiny.root / "alone-nemo.csv", tiny.root / "alone-ckpt.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(tiny.manifest), "--out", str(a)]) == 0
    assert evaluate.main([str(tiny.ckpt), "--manifest", str(tiny.manifest), "--out", str(b)]) == 0
    assert read_csv(a) == read_csv(b)
    out = tiny.root / "alone.nemo"
    assert export_nemo.main([str(tiny.ckpt), "--out", str(out)]) == 0
    # a checkpoint without a description still needs them, and says so
    with pytest.raises(FileNotFoundError, match="TOKENIZER_DIR"):
        evaluate.main([str(tiny.bare), "--manifest", str(tiny.manifest)])


def test_per_lang_limits_the_utterances_of_each_language(tiny):
    out = tiny.root / "limited.csv"
    evaluate.main(
        [str(tiny.nemo), "--manifest", str(tiny.manifest), "--out", str(out), "--per-lang", "2"]
    )
    rows = {r["lang"]: r for r in read_csv(out)}
    assert rows["en"]["utterances"] == rows["hi"]["utterances"] == "2"


def test_last_resolves_to_the_newest_step_checkpoint(tiny):
    assert checkpoints.resolve_model_path("last") == tiny.ckpt


def test_a_model_that_is_neither_nemo_nor_ckpt_is_refused(tiny):
    other = tiny.root / "model.pt"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="expected a .nemo file or a .ckpt"):
        checkpoints.resolve_model_path(str(other))


def test_export_nemo_script_writes_a_restorable_nemo_with_the_checkpoints_weights(tiny):
    from nemo.collections.asr.models import ASRModel

    out = tiny.root / "exported.nemo"
    assert export_nemo.main([str(tiny.ckpt), "--out", str(out)]) == 0
    restored = ASRModel.restore_from(str(out), map_location="cpu")
    expected = tiny.model.state_dict()
    for key, value in restored.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_model_card_is_written_beside_the_nemo_from_the_run_record(tiny):
    card = (tiny.root / "tiny.model-card.md").read_text(encoding="utf-8")
    assert "trained from scratch (`configs/tiny_tdt.yaml`)" in card
    assert "| hi | 1.50 |" in card and "| en | 0.25 |" in card and "| all | 1.75 |" in card
    assert "| `PHASE2_LR` | `0.0003` |" in card
    assert "validation loss 1.2500" in card
    assert "| hi | 4 | 10 | 0.3000 | 0.1000 | 0.1000 | 0.1000 | 0.1000 |" in card
    assert "<|hi|>" in card and "<|en|>" in card  # the tokenizer's language tags


def _step_checkpoint(tiny, directory: Path, step: int, shift: float) -> Path:
    """A step checkpoint of the tiny model with every float weight moved by ``shift``."""
    import asr_model

    weights = {
        f"model.{k}": v + shift if v.is_floating_point() else v + step
        for k, v in tiny.model.state_dict().items()
    }
    path = directory / checkpoints.checkpoint_name(step)
    torch.save(
        {
            "global_step": step,
            "state_dict": weights,
            asr_model.PORTABLE_KEY: asr_model.portable_description(tiny.model),
            training_step.RUN_RECORD_KEY: {**RUN_RECORD, "step": step},
        },
        path,
    )
    return path


def test_export_average_3_writes_the_mean_of_the_newest_three(tiny, monkeypatch, capsys):
    from nemo.collections.asr.models import ASRModel

    directory = tiny.root / "averaging"
    directory.mkdir()
    for step, shift in ((100, 5.0), (200, 1.0), (300, 2.0), (400, 6.0)):
        _step_checkpoint(tiny, directory, step, shift)
    monkeypatch.setattr(config, "CHECKPOINT_DIR", directory)
    assert export_nemo.main(["last", "--average", "3"]) == 0
    out = directory / "step_00000400.avg3.nemo"
    assert str(out) in capsys.readouterr().out
    restored = ASRModel.restore_from(str(out), map_location="cpu").state_dict()
    for key, value in tiny.model.state_dict().items():
        if value.is_floating_point():  # the mean of +1, +2 and +6
            torch.testing.assert_close(restored[key], value + 3.0, rtol=0, atol=1e-5)
        else:  # integer buffers: the newest checkpoint's
            assert torch.equal(restored[key], value + 400), key
    card = (directory / "step_00000400.avg3.model-card.md").read_text(encoding="utf-8")
    assert "the mean of 3 step checkpoints (step_00000200.ckpt, step_00000300.ckpt, " in card
    # a list of checkpoints is averaged as given
    listed = [str(directory / checkpoints.checkpoint_name(s)) for s in (100, 200)]
    assert export_nemo.main([*listed, "--out", str(directory / "two.nemo")]) == 0
    restored = ASRModel.restore_from(str(directory / "two.nemo"), map_location="cpu").state_dict()
    key = next(k for k, v in tiny.model.state_dict().items() if v.is_floating_point())
    torch.testing.assert_close(restored[key], tiny.model.state_dict()[key] + 3.0, rtol=0, atol=1e-5)


def test_export_best_takes_the_lowest_wer_checkpoints_and_its_card_says_so(tiny, monkeypatch):
    from nemo.collections.asr.models import ASRModel

    directory = tiny.root / "best"
    directory.mkdir()
    wer = {100: 0.30, 200: 0.10, 300: 0.20, 400: 0.50}
    for step, shift in ((100, 5.0), (200, 1.0), (300, 2.0), (400, 6.0)):
        _step_checkpoint(tiny, directory, step, shift)
    (directory / "run.json").write_text(
        json.dumps(
            {
                "name": "r",
                "wandb_id": "x",
                "validation": {str(k): {"wer": v} for k, v in wer.items()},
            }
        )
    )
    monkeypatch.setattr(config, "CHECKPOINT_DIR", directory)
    assert export_nemo.main(["best"]) == 0
    card = (directory / "step_00000200.model-card.md").read_text(encoding="utf-8")
    assert "chosen as: the step checkpoint with the lowest validation WER of the run" in card
    assert "step_00000200.ckpt: 0.1000" in card
    assert export_nemo.main(["best", "--average", "2"]) == 0  # the 2 best: steps 200 and 300
    restored = ASRModel.restore_from(
        str(directory / "step_00000300.avg2.nemo"), map_location="cpu"
    ).state_dict()
    key = next(k for k, v in tiny.model.state_dict().items() if v.is_floating_point())
    torch.testing.assert_close(restored[key], tiny.model.state_dict()[key] + 1.5, rtol=0, atol=1e-5)
    card = (directory / "step_00000300.avg2.model-card.md").read_text(encoding="utf-8")
    assert "the 2 step checkpoints with the lowest validation WER" in card


def test_averaging_more_checkpoints_than_there_are_is_one_line(tiny, monkeypatch, capsys):
    directory = tiny.root / "too-few"
    directory.mkdir()
    _step_checkpoint(tiny, directory, 100, 0.0)
    monkeypatch.setattr(config, "CHECKPOINT_DIR", directory)
    assert export_nemo.main(["last", "--average", "3"]) == 2
    assert "only 1 step checkpoint(s) up to step_00000100.ckpt" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["ckpt", "nemo"])
def test_a_truncated_checkpoint_or_nemo_is_named_in_one_line(tiny, capsys, kind):
    good = tiny.ckpt if kind == "ckpt" else tiny.nemo
    cut = tiny.root / f"cut.{kind}"
    data = good.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    assert evaluate.main([str(cut), "--manifest", str(tiny.manifest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evaluate: error: cannot load") and str(cut) in err
    assert len(err.strip().splitlines()) == 1
    if kind == "ckpt":
        assert export_nemo.main([str(cut)]) == 2
        assert str(cut) in capsys.readouterr().err


def test_an_evaluation_with_no_usable_utterance_is_an_error_and_writes_no_csv(tiny, capsys):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(tiny.manifest)
    audio = "audio_filepath"
    moved = pc.replace_substring(table[audio], str(tiny.manifest.parent), "/nonexistent")
    manifest = tiny.root / "moved.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index(audio), audio, moved), manifest)
    out = tiny.root / "none.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(manifest), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no utterance of" in err and "could be scored" in err and "bad audio" in err
    assert not out.exists()


def test_help_explains_usage_with_an_example():
    for script in ("evaluate.py", "export_nemo.py"):
        out = subprocess.run(
            [sys.executable, str(REPO / "scripts" / script), "--help"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert out.returncode == 0 and f"python scripts/{script}" in out.stdout


# ---------------------------------------------------------------------------------------------------
# PerLanguageWERCallback
# ---------------------------------------------------------------------------------------------------


class EncDecRNNTBPEModel(torch.nn.Module):
    """Named as NeMo's TDT model class: asr_model.family takes a model by its class names."""


class EchoModel(EncDecRNNTBPEModel):
    """'Decodes' each utterance to its manifest text (tag included), recognised by its signal."""

    def __init__(self, tokenizer, texts_by_signal: dict, given_texts_by_signal: dict | None = None):
        super().__init__()
        self.tokenizer = tokenizer
        self.layer = torch.nn.Linear(1, 1)
        self.texts_by_signal = texts_by_signal
        self.given_texts_by_signal = given_texts_by_signal or {}
        self.decoding = SimpleNamespace(rnnt_decoder_predictions_tensor=self.decode)
        self.decoded = 0

    @staticmethod
    def fingerprint(signal: torch.Tensor) -> float:
        return round(float(signal[:400].abs().sum()), 3)

    def forward(self, input_signal, input_signal_length):
        return input_signal, input_signal_length

    def decode(self, encoder_output, encoded_lengths, partial_hypotheses=None):
        """The text of each signal; where ``partial_hypotheses`` (``let_echo_models_start_from_a_
        piece``) starts an utterance from a piece, that piece and the signal's words in
        ``given_texts_by_signal`` (else its text's), as decoding from the piece would."""
        from manifest_schema import strip_lang_tag

        self.decoded += len(encoded_lengths)
        starts = partial_hypotheses or [None] * len(encoded_lengths)
        out = []
        for signal, start in zip(encoder_output, starts):
            key = self.fingerprint(signal)
            text = self.texts_by_signal[key]
            if start is not None:
                words = strip_lang_tag(self.given_texts_by_signal.get(key, text))
                text = f"{self.tokenizer.ids_to_tokens([start.piece])[0]} {words}"
            out.append(SimpleNamespace(text=text))
        return out


@pytest.fixture(autouse=True)
def echo_models_start_from_a_piece(monkeypatch):
    let_echo_models_start_from_a_piece(monkeypatch)


def let_echo_models_start_from_a_piece(monkeypatch) -> None:
    """An EchoModel has no prediction network to start from a piece: decoding from one hands
    ``EchoModel.decode`` the piece of each utterance (None: auto)."""
    import decoding

    real = decoding.started_texts

    def started(model, encoded, encoded_len, pieces, kept=None, **tags):
        if isinstance(model, EchoModel):
            starts = [None if p is None else SimpleNamespace(piece=p) for p in pieces]
            return [h.text for h in model.decode(encoded, encoded_len, starts)]
        return real(model, encoded, encoded_len, pieces, kept, **tags)

    monkeypatch.setattr(decoding, "started_texts", started)


class GraphRecordingModel(EchoModel):
    """EchoModel with NeMo's CUDA-graph switches, recording every call in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[str] = []

    def maybe_enable_cuda_graphs(self, force_reinit=False):
        self.calls.append(f"enable(force_reinit={force_reinit})")

    def disable_cuda_graphs(self):
        self.calls.append("disable")

    def decode(self, encoder_output, encoded_lengths, partial_hypotheses=None):
        self.calls.append("decode")
        return super().decode(encoder_output, encoded_lengths, partial_hypotheses)


def test_validation_rebuilds_the_decoding_graphs_before_and_releases_them_after(tiny):
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    from dataset import LocalShardDataset

    tokenizer = SentencePieceTokenizer(str(tiny.tokenizer / "tokenizer.model"))
    ds = LocalShardDataset(tiny.manifest, tokenizer, progress=False)
    texts = evaluation.manifest_texts(ds)
    model = GraphRecordingModel(
        tokenizer, {EchoModel.fingerprint(ds[i]["signal"]): texts[i] for i in range(len(ds))}
    )
    evaluation.decode(model, ds, list(range(4)), max_batch_seconds=4.0)
    assert model.calls[0] == "enable(force_reinit=True)" and model.calls[-1] == "disable"
    assert model.calls.count("decode") >= 2 and model.calls.count("disable") == 1
    # an error inside decoding still releases them
    model.calls.clear()
    model.texts_by_signal = {}
    with pytest.raises(KeyError):
        evaluation.decode(model, ds, list(range(2)))
    assert model.calls[-1] == "disable"


def test_training_starts_without_decoding_graphs(monkeypatch):
    import process_control
    import training_step

    class Model(torch.nn.Module):
        released = 0

        def disable_cuda_graphs(self):
            self.released += 1

    for name in ("install_stop_handlers", "set_training"):
        monkeypatch.setattr(process_control, name, lambda *args: None)
    monkeypatch.setattr(training_step, "apply_current_lr_schedule", lambda trainer: None)
    monkeypatch.setattr(training_step.TrainingModule, "trainer", property(lambda self: None))
    module = training_step.TrainingModule(Model())
    module.on_train_start()
    assert module.model.released == 1


def fake_trainer(rank: int, loggers: list) -> SimpleNamespace:
    import contextlib

    return SimpleNamespace(
        global_rank=rank,
        world_size=2,
        is_global_zero=rank == 0,
        global_step=20,
        loggers=loggers,
        precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext),
    )


def test_wer_callback_splits_utterances_across_ranks_and_gathers_them_on_rank_zero(
    tiny, monkeypatch
):
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    from dataset import LocalShardDataset

    tokenizer = SentencePieceTokenizer(str(tiny.tokenizer / "tokenizer.model"))
    ds = LocalShardDataset(tiny.manifest, tokenizer, progress=False)
    texts = evaluation.manifest_texts(ds)
    lookup = {EchoModel.fingerprint(ds[i]["signal"]): texts[i] for i in range(len(ds))}
    assert len(lookup) == len(ds)
    logger = run_logging.JsonlMetricsLogger(tiny.root / "wer" / "metrics.jsonl")
    shares = {}
    results = {}
    for rank in (1, 0):  # rank 1 first, so its share exists when rank 0 "gathers"
        model = EchoModel(tokenizer, lookup)
        module = SimpleNamespace(model=model, device=torch.device("cpu"))
        cb = callbacks.PerLanguageWERCallback(
            every_n_steps=10, samples_per_lang=3, manifest_path=tiny.manifest, with_loss=False
        )
        trainer = fake_trainer(rank, [logger])
        cb.on_train_start(trainer, module)

        def gather(obj, rank=rank):
            shares[rank] = obj
            return [shares.get(r, ({}, 0.0, 0, False, {})) for r in (0, 1)]

        monkeypatch.setattr(callbacks, "all_gather_objects", gather)
        results[rank] = cb.evaluate(trainer, module)
        # half of 3 per language x 2 languages, decoded auto and with the language given
        assert model.decoded == 3 + 3
        assert shares[rank][4].keys() == shares[rank][0].keys()
    texts = {r: shares[r][0] for r in (0, 1)}
    assert set(texts[0]).isdisjoint(texts[1]) and len(texts[0]) + len(texts[1]) == 6
    assert results[0]["all"].utterances == 6 and results[0]["all"].wer == 0.0
    lines = [json.loads(l) for l in (tiny.root / "wer" / "metrics.jsonl").read_text().splitlines()]
    scalars = [l for l in lines if "val/wer/all" in l]
    assert len(scalars) == 1 and scalars[0]["step"] == 20 and scalars[0]["val/utterances"] == 6
    assert scalars[0]["val/wer/en"] == scalars[0]["val/cer/hi"] == 0.0
    table = [l for l in lines if l.get("table") == "val/examples"][0]
    assert table["columns"] == ["lang", "reference", "hypothesis"] and len(table["rows"]) == 6
    assert all(
        not row[1].startswith("<|") for row in table["rows"]
    )  # tags stripped for display too


def test_wer_callback_fails_at_train_start_when_the_val_manifest_is_missing(tiny):
    cb = callbacks.PerLanguageWERCallback(
        every_n_steps=5, manifest_path=tiny.root / "missing.parquet"
    )
    with pytest.raises(training_step.ValidationError, match="VAL_MANIFEST_PATH=.*missing.parquet"):
        cb.on_train_start(
            fake_trainer(0, []), SimpleNamespace(model=tiny.model, device=torch.device("cpu"))
        )


def test_wer_callback_fails_at_train_start_when_the_val_manifest_has_nothing_to_score(tiny):
    import pyarrow.parquet as pq

    table = pq.read_table(tiny.manifest)
    empty = tiny.root / "empty_val.parquet"
    pq.write_table(table.slice(0, 0), empty)
    # every row longer in tokens than the audio has encoder frames: read, then all dropped
    unscorable = tiny.root / "unscorable_val.parquet"
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("duration"), "duration", [[0.01] * table.num_rows]
        ),
        unscorable,
    )
    module = SimpleNamespace(model=tiny.model, device=torch.device("cpu"))
    for manifest, said in ((empty, "0 rows read"), (unscorable, f"{table.num_rows} rows read")):
        cb = callbacks.PerLanguageWERCallback(every_n_steps=5, manifest_path=manifest)
        with pytest.raises(training_step.ValidationError) as raised:
            cb.on_train_start(fake_trainer(0, []), module)
        line = str(raised.value)
        assert "\n" not in line and f"VAL_MANIFEST_PATH={manifest}" in line and said in line
        assert "EVAL_EVERY_STEPS=0" in line


class DefineMetricRecorder:
    """A logger whose experiment records W&B's define_metric calls."""

    def __init__(self):
        self.defined = []
        self.experiment = SimpleNamespace(
            define_metric=lambda name, **kw: self.defined.append((name, kw))
        )

    def log_metrics(self, metrics, step):
        pass


def test_validation_scores_the_whole_manifest_with_its_loss_by_default(tiny, monkeypatch):
    """One process, the real tiny model: every utterance decoded, the loss the training loss's
    reduction averaged over utterances, W&B told to keep the lowest, the result on the module."""
    import asr_model
    from dataset import LocalShardDataset, collate_asr_batch

    monkeypatch.setattr(callbacks, "all_gather_objects", lambda obj: [obj])
    recorder = DefineMetricRecorder()
    jsonl = run_logging.JsonlMetricsLogger(tiny.root / "val-loss" / "metrics.jsonl")
    module = SimpleNamespace(model=tiny.model, device=torch.device("cpu"), last_evaluation=None)
    cb = callbacks.PerLanguageWERCallback(every_n_steps=5, manifest_path=tiny.manifest)
    trainer = fake_trainer(0, [recorder, jsonl])
    trainer.world_size = 1
    cb.on_train_start(trainer, module)
    results = cb.evaluate(trainer, module)
    ds = LocalShardDataset(tiny.manifest, tiny.model.tokenizer, progress=False)
    assert results["all"].utterances == len(ds) == len(cb.indices)  # all of it
    assert ("val/wer/*", {"summary": "min"}) in recorder.defined
    assert ("val/loss", {"summary": "min"}) in recorder.defined
    # the same loss computed directly, batch by batch, weighted by the batches' utterances
    total = count = 0.0
    for batch_indices in evaluation.pack_by_duration(
        evaluation.rank_share(cb.indices, ds.durations, 0, 1), ds.durations, cb.max_batch_seconds
    ):
        batch = collate_asr_batch([ds[i] for i in batch_indices])
        with torch.no_grad():
            tiny.model.eval()
            loss = float(asr_model.training_loss(tiny.model, batch, encoder_frozen=True))
        total, count = total + loss * batch.batch_size, count + batch.batch_size
    assert module.last_evaluation["loss"] == pytest.approx(total / count, rel=1e-5)
    assert module.last_evaluation["step"] == 20
    assert module.last_evaluation["results"]["all"]["utterances"] == len(ds)
    line = json.loads((tiny.root / "val-loss" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["val/loss"] == pytest.approx(total / count, rel=1e-5)
    assert {"val/wer_sub/all", "val/wer_del/hi", "val/wer_ins/en"} <= line.keys()


def test_greedy_decoding_restores_each_modules_train_or_eval_mode(tiny):
    from dataset import LocalShardDataset

    model = tiny.model
    model.train()
    model.encoder.eval()  # as during phase 1: a frozen encoder stays in eval mode
    ds = LocalShardDataset(tiny.manifest, model.tokenizer, progress=False)
    hyps = evaluation.greedy_transcribe(model, ds, [0, 1, 2], max_batch_seconds=5.0)
    assert sorted(hyps) == [0, 1, 2] and all(isinstance(h, str) for h in hyps.values())
    assert model.training and model.decoder.training and not model.encoder.training


# ---------------------------------------------------------------------------------------------------
# NeMo JSON manifests and transcription
# ---------------------------------------------------------------------------------------------------


def write_nemo_json(tiny, path: Path, *, with_lang: bool = True) -> Path:
    """The tiny manifest as a NeMo JSON manifest (audio paths relative to it when possible)."""
    import polars as pl

    from manifest_schema import nemo_json_frame

    frame = nemo_json_frame(pl.read_parquet(tiny.manifest))
    if not with_lang:
        frame = frame.drop("lang")
    frame.write_ndjson(path)
    return path


def test_evaluate_scores_a_nemo_json_manifest_like_its_parquet(tiny):
    json_manifest = write_nemo_json(tiny, tiny.root / "test.json")
    a, b = tiny.root / "parquet.csv", tiny.root / "json.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(tiny.manifest), "--out", str(a)]) == 0
    assert evaluate.main([str(tiny.nemo), "--manifest", str(json_manifest), "--out", str(b)]) == 0
    from_parquet = {r["lang"]: r for r in read_csv(a)}
    from_json = {r["lang"]: r for r in read_csv(b)}
    assert from_json["all"]["utterances"] == "12"  # every row: the JSON is scored as listed
    # the same audio gives the same hypotheses: a language the training cache kept whole agrees
    # (the cache drops rows with more tokens than encoder frames, which the JSON path keeps)
    whole = [lang for lang in ("hi", "en") if from_parquet[lang]["utterances"] == "6"]
    assert whole and all(from_parquet[lang] == from_json[lang] for lang in whole)


def test_a_nemo_json_manifest_without_lang_is_scored_under_the_given_language(tiny):
    json_manifest = write_nemo_json(tiny, tiny.root / "nolang.json", with_lang=False)
    out = tiny.root / "nolang.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(json_manifest), "--out", str(out)]) == 0
    assert [r["lang"] for r in read_csv(out)] == ["und", "all"]
    args = [str(tiny.nemo), "--manifest", str(json_manifest), "--out", str(out), "--lang", "hi"]
    assert evaluate.main(args) == 0
    rows = read_csv(out)
    assert [r["lang"] for r in rows] == ["hi", "all"] and rows[0]["utterances"] == "12"


def test_a_nemo_json_row_that_is_not_json_is_named_with_its_line(tiny, capsys):
    bad = tiny.root / "bad.json"
    bad.write_text('{"audio_filepath": "a.flac", "text": "x"}\nnot json\n', encoding="utf-8")
    assert evaluate.main([str(tiny.nemo), "--manifest", str(bad)]) == 2
    assert f"{bad}:2: not JSON" in capsys.readouterr().err


def test_transcribe_writes_the_language_and_the_text_without_the_tag(tiny, monkeypatch):
    import polars as pl

    import decoding
    from manifest_schema import nemo_json_frame
    from scripts import transcribe

    paths = nemo_json_frame(pl.read_parquet(tiny.manifest)).get_column("audio_filepath")
    files = [paths[0], paths[1], str(tiny.root / "missing.flac")]
    hi_tag = tiny.model.tokenizer.token_to_id("<|hi|>")
    monkeypatch.setattr(
        decoding,
        "decode_batch",
        lambda model, signal, lens, **asked: decoding.BatchDecoding(
            texts=["<|hi|> नमस्ते  दुनिया", "no tag"][: len(lens)],
            first_tokens=[(hi_tag, 0.875), None][: len(lens)],
        ),
    )
    rows = transcribe.transcribe(tiny.model, files, batch_seconds=1.0)  # one file per batch
    assert [r["audio_filepath"] for r in rows] == files  # input order
    assert rows[0]["lang"] == rows[1]["lang"] == "hi" and rows[0]["text"] == "नमस्ते दुनिया"
    assert rows[0]["lang_prob"] == rows[1]["lang_prob"] == 0.875
    assert rows[2] == {"audio_filepath": files[2], "error": "file not found"}


def test_transcribe_gives_no_language_probability_when_the_first_piece_is_no_tag(tiny, monkeypatch):
    import polars as pl

    import decoding
    from manifest_schema import nemo_json_frame
    from scripts import transcribe

    paths = nemo_json_frame(pl.read_parquet(tiny.manifest)).get_column("audio_filepath")
    monkeypatch.setattr(
        decoding,
        "decode_batch",
        lambda model, signal, lens, **asked: decoding.BatchDecoding(
            texts=["words first"] * len(lens), first_tokens=[(3, 0.5)] * len(lens)
        ),
    )
    rows = transcribe.transcribe(tiny.model, [paths[0]])
    assert rows[0]["lang"] is None and rows[0]["lang_prob"] is None
    assert rows[0]["text"] == "words first"


def test_transcribe_script_runs_a_model_over_a_manifest_into_jsonl(tiny, capsys):
    from scripts import transcribe

    json_manifest = write_nemo_json(tiny, tiny.root / "to-transcribe.json")
    out = tiny.root / "hyps.jsonl"
    assert (
        transcribe.main([str(tiny.ckpt), "--manifest", str(json_manifest), "--out", str(out)]) == 0
    )
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 12 and all(
        {"audio_filepath", "lang", "text", "duration"} <= r.keys() for r in rows
    )
    assert all("<|" not in r["text"] for r in rows)
    assert transcribe.main([str(tiny.nemo), str(tiny.root / "nope.flac")]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.fixture(scope="module")
def transcribe_run(tiny):
    """scripts/transcribe.py run as a user runs it on the tiny .nemo: two audio files of the
    manifest and a missing one, stdout piped; (the files, the finished process)."""
    import polars as pl

    from manifest_schema import nemo_json_frame

    paths = nemo_json_frame(pl.read_parquet(tiny.manifest)).get_column("audio_filepath")
    files = [paths[0], paths[1], str(tiny.root / "missing.flac")]
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/transcribe.py"), str(tiny.nemo), *files],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return files, result


def test_transcribe_stdout_piped_to_a_file_is_valid_jsonl_and_the_logs_go_to_stderr(
    transcribe_run,
):
    files, result = transcribe_run
    assert result.returncode == 1  # one file failed
    rows = [json.loads(line) for line in result.stdout.splitlines()]  # every line is JSON
    assert [r["audio_filepath"] for r in rows] == files
    assert rows[2]["error"] == "file not found"
    assert f"cannot read {files[2]}: file not found" in result.stderr
    assert "[NeMo" not in result.stdout


# What NeMo's OneLogger telemetry (off in this app) prints when NeMo is imported, and what
# SentencePiece prints for a deprecated trainer option.
LIBRARY_NOTES = (
    "No exporters were provided",
    "OneLogger: Setting error_handling_strategy",
    "is deprecated and ignored",
)


def test_a_command_that_loads_a_nemo_model_prints_none_of_the_librarys_notes(transcribe_run):
    _, result = transcribe_run
    assert "was successfully restored" in result.stderr  # NeMo was imported and loaded the model
    for note in LIBRARY_NOTES:
        assert note not in result.stdout + result.stderr, note


@pytest.mark.parametrize(
    ("step", "stop_agreed", "validated"),
    [(7, False, True), (10, False, False), (7, True, False)],
)
def test_a_run_ending_between_validations_is_validated_once_more(step, stop_agreed, validated):
    cb = callbacks.PerLanguageWERCallback(every_n_steps=5, manifest_path="unused.parquet")
    cb.dataset = object()  # on_train_start ran
    calls = []
    cb.evaluate = lambda trainer, module: calls.append(trainer.global_step)
    trainer = fake_trainer(0, [])
    trainer.global_step = step
    cb.on_train_end(trainer, SimpleNamespace(stop_agreed=stop_agreed))
    assert calls == ([step] if validated else [])


def test_a_missing_validation_manifest_warns_at_its_default_path_and_fails_when_asked_for(
    tmp_path, monkeypatch
):
    import dataclasses

    missing = tmp_path / "val_manifest_v2.parquet"
    monkeypatch.setattr(config, "VAL_MANIFEST_PATH", missing)
    monkeypatch.setattr(config, "EVAL_EVERY_STEPS", 100)
    monkeypatch.delenv("RANK", raising=False)
    warned = []
    monkeypatch.setattr(
        training_step, "log", SimpleNamespace(warning=lambda msg, *a: warned.append(msg % a))
    )
    assert training_step.validation_manifest() is None
    assert training_step.validation_manifest() is None
    assert (
        len(warned) == 1 and "no validation in this run" in warned[0] and str(missing) in warned[0]
    )
    knob = config.KNOBS["VAL_MANIFEST_PATH"]
    monkeypatch.setitem(config.KNOBS, "VAL_MANIFEST_PATH", dataclasses.replace(knob, source="env"))
    with pytest.raises(training_step.ValidationError, match=r"set: VAL_MANIFEST_PATH"):
        training_step.validation_manifest()
    monkeypatch.setattr(config, "EVAL_EVERY_STEPS", 0)
    assert training_step.validation_manifest() is None  # off: nothing to check


def test_transcribe_reads_the_audio_of_a_parquet_manifest_like_its_nemo_json(tiny):
    from scripts import transcribe

    json_manifest = write_nemo_json(tiny, tiny.root / "same-audio.json")
    from_parquet = transcribe.inputs_of([], tiny.manifest)
    assert from_parquet == transcribe.inputs_of([], json_manifest)
    paths, languages = from_parquet
    assert len(paths) == 12 and all(Path(p).is_file() for p in paths) and languages is None
    # --lang manifest: each row's language, from either kind of manifest
    given = transcribe.inputs_of([], tiny.manifest, "manifest")
    assert given == transcribe.inputs_of([], json_manifest, "manifest")
    assert sorted(set(given[1])) == ["en", "hi"] and given[0] == paths
    assert transcribe.inputs_of([], json_manifest, "ta")[1] == ["ta"] * 12
    # a manifest written before the audio column (its tar path and member): the same files
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from manifest_schema import AUDIO_COLUMN, LEGACY_AUDIO_COLUMNS, ManifestError

    table = pq.read_table(tiny.manifest)
    audio = table.column(AUDIO_COLUMN)
    tar_path, member = LEGACY_AUDIO_COLUMNS
    legacy = table.drop_columns([AUDIO_COLUMN]).append_column(
        tar_path, pc.replace_substring_regex(audio, r"/[^/]*$", "/shard.tar")
    )
    legacy = legacy.append_column(member, pc.replace_substring_regex(audio, r"^.*/", ""))
    pq.write_table(legacy, tiny.root / "legacy.parquet")
    assert transcribe.inputs_of([], tiny.root / "legacy.parquet") == (paths, None)
    (tiny.root / "not-a-manifest.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ManifestError, match="not NeMo JSON nor parquet"):
        transcribe.inputs_of([], tiny.root / "not-a-manifest.parquet")
    # pyarrow alone reads it: a training node's install has no polars
    code = (
        "import sys; from pathlib import Path; sys.modules['polars'] = None; "
        "from scripts import transcribe; "
        f"print(len(transcribe.inputs_of([], Path({str(tiny.manifest)!r}))[0]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "12", done.stderr[-2000:]


def _averaging_run(tiny, name: str) -> Path:
    """Three step checkpoints of one run (weights shifted apart) with their validation WERs."""
    directory = tiny.root / name
    directory.mkdir()
    for step, shift in ((100, 0.0), (200, 0.02), (300, 0.04)):
        _step_checkpoint(tiny, directory, step, shift)
    (directory / "run.json").write_text(
        json.dumps(
            {
                "name": "r",
                "wandb_id": "x",
                "validation": {"100": {"wer": 0.5}, "200": {"wer": 0.3}, "300": {"wer": 0.4}},
            }
        )
    )
    return directory


@pytest.mark.parametrize(("average_wins", "kept"), [(True, "avg3"), (False, "single")])
def test_an_average_is_kept_only_when_it_beats_the_best_single_checkpoint(
    tiny, monkeypatch, capsys, average_wins, kept
):
    directory = _averaging_run(tiny, f"compare-{kept}")
    monkeypatch.setattr(config, "CHECKPOINT_DIR", directory)
    scored = []

    def fake_score(model, manifest, settings, device):
        scored.append(manifest)
        # the average is scored first, then the best single checkpoint
        wer = (0.2 if average_wins else 0.35) if len(scored) == 1 else 0.3
        counts = {"words": 100, "word_edits": round(100 * wer)}
        return {"loss": None, "results": {"all": counts}, "scored_at_export": True}

    monkeypatch.setattr(export_nemo, "score_weights", fake_score)
    assert export_nemo.main(["last", "--average", "3", "--manifest", str(tiny.manifest)]) == 0
    out = capsys.readouterr().out
    assert scored == [tiny.manifest, tiny.manifest]
    assert "the best single checkpoint step_00000200.ckpt WER 0.3000" in out
    if average_wins:
        card = (directory / "step_00000300.avg3.model-card.md").read_text()
        assert "kept over the best single checkpoint" in card
        assert not (directory / "step_00000200.nemo").exists()
    else:
        assert "keeping step_00000200.ckpt: the average of 3 does not beat it" in out
        card = (directory / "step_00000200.model-card.md").read_text()
        assert "step_00000200.ckpt, the best single checkpoint, kept over the mean of 3" in card
        assert not (directory / "step_00000300.avg3.nemo").exists()


def test_averaging_scores_both_models_on_the_validation_manifest(tiny, monkeypatch, capsys):
    directory = _averaging_run(tiny, "compare-real")
    monkeypatch.setattr(config, "CHECKPOINT_DIR", directory)
    assert export_nemo.main(["best", "--average", "2", "--manifest", str(tiny.manifest)]) == 0
    out = capsys.readouterr().out
    scored = re.search(
        r"the mean of 2 WER ([\d.]+), the best single checkpoint (\S+) WER ([\d.]+)", out
    )
    assert scored and scored.group(2) == "step_00000200.ckpt"
    average, single = float(scored.group(1)), float(scored.group(3))
    kept_average = (directory / "step_00000300.avg2.nemo").exists()
    assert kept_average == (average < single)
    assert (directory / "step_00000200.nemo").exists() == (not kept_average)


def test_without_a_validation_manifest_the_average_is_exported_unscored_with_a_warning(
    tiny, monkeypatch, capsys
):
    directory = _averaging_run(tiny, "compare-none")
    monkeypatch.setattr(config, "CHECKPOINT_DIR", directory)
    monkeypatch.setattr(config, "VAL_MANIFEST_PATH", tiny.root / "no-val.parquet")
    assert export_nemo.main(["last", "--average", "3"]) == 0
    assert "the average is exported unscored" in capsys.readouterr().err
    assert (directory / "step_00000300.avg3.nemo").exists()


def with_infeasible_rows(manifest: Path, out: Path, rows: list[int]) -> list[str]:
    """A copy of ``manifest`` whose ``rows`` claim 0.05 s (one encoder frame: fewer frames than their
    tokens), so they cannot be scored; their segment_ids."""
    import polars as pl

    frame = pl.read_parquet(manifest).with_row_index("i")
    frame = frame.with_columns(
        pl.when(pl.col("i").is_in(rows)).then(0.05).otherwise(pl.col("duration")).alias("duration")
    ).drop("i")
    frame.write_parquet(out)
    return [frame.get_column("segment_id")[r] for r in rows]


def test_rows_evaluate_cannot_score_are_counted_per_language_and_named(tiny, capsys):
    manifest = tiny.root / "with-infeasible.parquet"
    ids = with_infeasible_rows(tiny.manifest, manifest, [0, 1])
    out = tiny.root / "with-infeasible.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(manifest), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {r["lang"]: r for r in read_csv(out)}
    assert rows["hi"]["excluded"] == "2"  # rows 0 and 1 are Hindi
    assert int(rows["all"]["excluded"]) == sum(
        int(r["excluded"]) for k, r in rows.items() if k != "all"
    )
    assert "excl" in next(line for line in printed.splitlines() if line.startswith("lang "))
    assert f"hi 2 (more tokens than encoder frames: {ids[0]}, {ids[1]})" in printed


# ---- scoring after one normalization, whatever the manifest's origin ---------------------------

# A test split as a corpus writes it: punctuation, capitals, dandas, quotes, extra spaces, and a
# nukta written as its own sign.
RAW_TEST_TEXTS = {
    "en": [
        '  "Hello,  World!" she said.  ',
        "Don\u2019t open the DOOR?",
        "It's 5 o'clock... (really)",
    ],
    "hi": [
        "नमस्ते,  दुनिया।",
        "\u201cक्या आप ठीक हैं?\u201d \u0965",
        "दरवाज\u093c\u093e खोलो \u2014 अभी!",
    ],
}


@pytest.fixture(scope="module")
def raw_test_split(tiny):
    """RAW_TEST_TEXTS as a raw NeMo JSON manifest (WAVs beside it) and the same imported by
    build_manifest (its text cleaned as training targets are: ``imported`` plain,
    ``imported_punctuated`` in the punctuated style)."""
    import build_manifest
    from tests import byod_factory as byod

    root = tiny.root / "raw-test-split"
    utts = [
        {"id": f"{lang}{i}", "lang": lang, "text": text, "seconds": 3.0, "speaker": lang, "k": k}
        for k, (lang, i, text) in enumerate(
            (lang, i, text)
            for lang, texts in RAW_TEST_TEXTS.items()
            for i, text in enumerate(texts)
        )
    ]
    raw = byod.write_nemo_json(root, utts)
    imported = root / "test.parquet"
    imported_punctuated = root / "test-punctuated.parquet"
    for out, style in ((imported, "plain"), (imported_punctuated, "punctuated")):
        build_manifest.build_manifest(
            None,
            out,
            sources=[f"nemo:{raw}"],
            audio_dir=root / "imported",
            languages=(),
            min_duration=0.1,
            max_duration=30.0,
            min_quality=0.0,
            workers=1,
            style=style,
            progress=False,
        )
    return SimpleNamespace(raw=raw, imported=imported, imported_punctuated=imported_punctuated)


def echo_model(manifest: Path, tokenizer, write) -> EchoModel:
    """An EchoModel that 'decodes' each utterance of ``manifest`` to ``write(its reference)``, the
    reference as ``evaluate.scoring_set`` reads it."""
    dataset, texts, _, _ = evaluate.scoring_set(manifest, tokenizer, progress=False)
    return EchoModel(
        tokenizer,
        {EchoModel.fingerprint(dataset[i]["signal"]): write(texts[i]) for i in range(len(dataset))},
    )


def spm_tokenizer(tiny):
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    return SentencePieceTokenizer(str(tiny.tokenizer / "tokenizer.model"))


@pytest.mark.parametrize("origin", ["raw", "imported"])
def test_the_references_own_cleaned_text_scores_zero_on_a_raw_and_on_an_imported_manifest(
    tiny, raw_test_split, origin
):
    from transcript_cleaning import clean_text

    manifest = getattr(raw_test_split, origin)
    tokenizer = spm_tokenizer(tiny)
    model = echo_model(manifest, tokenizer, clean_text)
    results, bad, excluded, *_ = evaluate.evaluate(model, manifest, device="cpu", progress=False)
    assert results["all"].utterances == 6 and bad["all"] == 0 and not excluded  # every row scored
    for lang in ("en", "hi", "all"):
        assert results[lang].wer == results[lang].cer == 0.0, lang


def test_evaluate_states_the_normalization_and_keeps_the_as_written_score(
    tiny, raw_test_split, monkeypatch, capsys
):
    import asr_model
    from transcript_cleaning import clean_text

    model = echo_model(raw_test_split.raw, spm_tokenizer(tiny), clean_text)
    monkeypatch.setattr(asr_model, "load_trained_model", lambda path, device: model)
    out = tiny.root / "raw-test-split.csv"
    args = [str(tiny.nemo), "--manifest", str(raw_test_split.raw), "--out", str(out)]
    assert evaluate.main(args) == 0
    rows = {r["lang"]: r for r in read_csv(out)}
    assert float(rows["all"]["wer"]) == float(rows["all"]["cer"]) == 0.0
    # as written, the references' punctuation, capitals and dandas are errors of a plain transcript
    assert float(rows["en"]["raw_wer"]) > 0 and float(rows["hi"]["raw_cer"]) > 0
    printed = capsys.readouterr().out
    assert f"normalized before scoring: {evaluation.SCORING_NORMALIZATION}" in printed
    assert "raw WER" in printed


def test_evaluate_reports_language_identification_per_language(
    tiny, raw_test_split, monkeypatch, capsys
):
    import asr_model

    model = echo_model(raw_test_split.raw, spm_tokenizer(tiny), lambda ref: f"<|en|> {ref}")
    monkeypatch.setattr(asr_model, "load_trained_model", lambda path, device: model)
    out = tiny.root / "lid.csv"
    assert (
        evaluate.main([str(tiny.nemo), "--manifest", str(raw_test_split.raw), "--out", str(out)])
        == 0
    )
    rows = {r["lang"]: r for r in read_csv(out)}
    n_en, n_hi = len(RAW_TEST_TEXTS["en"]), len(RAW_TEST_TEXTS["hi"])
    assert float(rows["en"]["lid_acc"]) == 1.0 and float(rows["hi"]["lid_acc"]) == 0.0
    assert float(rows["all"]["lid_acc"]) == pytest.approx(n_en / (n_en + n_hi))
    assert " LID" in capsys.readouterr().out


def test_rows_of_unknown_language_have_no_language_identification():
    texts, hyps, langs = (
        ["<|hi|> क", "ख", "ग"],
        {0: "<|hi|> क", 1: "<|hi|> ख", 2: "ग"},
        ["hi", "und", "und"],
    )
    lid = evaluate.score(texts, hyps, langs)[4]
    assert lid == {"hi": 1.0, "all": 1.0}  # the und rows are neither right nor wrong
    rows = evaluate.result_rows(evaluate.score(texts, hyps, langs)[0], {}, lid=lid)
    assert [r["lang"] for r in rows] == ["hi", "und", "all"]
    assert rows[1]["lid_acc"] != rows[1]["lid_acc"]  # nan


def test_evaluate_scores_punctuation_and_case_against_the_references_as_written(
    tiny, raw_test_split, monkeypatch, capsys
):
    import asr_model
    from transcript_cleaning import clean_text

    def run(transcribe, name):
        model = echo_model(raw_test_split.raw, spm_tokenizer(tiny), transcribe)
        monkeypatch.setattr(asr_model, "load_trained_model", lambda path, device: model)
        out = tiny.root / f"{name}.csv"
        args = [str(tiny.nemo), "--manifest", str(raw_test_split.raw), "--out", str(out)]
        assert evaluate.main(args) == 0
        return {r["lang"]: r for r in read_csv(out)}

    as_written = run(lambda ref: ref, "as-written")
    assert float(as_written["all"]["punct_f1"]) == 1.0 and float(as_written["en"]["case_err"]) == 0
    plain = run(clean_text, "plain")  # every mark gone, so none of the references' is found
    assert float(plain["all"]["punct_f1"]) == 0.0 and float(plain["all"]["wer"]) == 0.0
    assert (
        "punctuation F1 / case errors, against the references' marks and case: "
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("origin", ["raw", "imported_punctuated"])
def test_the_references_punctuated_target_scores_punctuation_f1_one_on_a_raw_and_on_an_imported_manifest(
    tiny, raw_test_split, monkeypatch, origin
):
    import asr_model
    from transcript_cleaning import clean_text

    # what a punctuated model is trained to write for each reference: a perfect transcript
    manifest = getattr(raw_test_split, origin)
    model = echo_model(manifest, spm_tokenizer(tiny), lambda ref: clean_text(ref, "punctuated"))
    monkeypatch.setattr(asr_model, "load_trained_model", lambda path, device: model)
    out = tiny.root / f"punctuated-target-{origin}.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(manifest), "--out", str(out)]) == 0
    rows = {r["lang"]: r for r in read_csv(out)}
    for lang in ("en", "hi", "all"):
        assert float(rows[lang]["wer"]) == 0.0, lang
        assert float(rows[lang]["punct_f1"]) == 1.0, lang
    assert float(rows["en"]["case_err"]) == 0.0


def hyps_run(tiny, manifest: Path, monkeypatch, name: str, *extra: str):
    """evaluate.py --hyps over ``manifest`` with a model whose auto hypothesis drops each
    reference's last word and whose hypothesis with the language given is the reference itself;
    (the CSV's rows by language, the JSON lines)."""
    import asr_model

    tokenizer = spm_tokenizer(tiny)
    dataset, texts, _, _ = evaluate.scoring_set(manifest, tokenizer, progress=False)
    items = [(dataset[i], texts[i]) for i in range(len(dataset))]
    signals = {EchoModel.fingerprint(item["signal"]): text for item, text in items if item}
    model = EchoModel(
        tokenizer,
        {key: " ".join(text.split()[:-1]) for key, text in signals.items()},
        dict(signals),
    )
    monkeypatch.setattr(asr_model, "load_trained_model", lambda path, device: model)
    out, hyps = tiny.root / f"{name}.csv", tiny.root / f"{name}.hyps.jsonl"
    args = [str(tiny.nemo), "--manifest", str(manifest), "--out", str(out), "--hyps", str(hyps)]
    assert evaluate.main(args + list(extra)) == 0
    lines = [json.loads(line) for line in hyps.read_text(encoding="utf-8").splitlines()]
    return {r["lang"]: r for r in read_csv(out)}, lines


def test_hyps_writes_each_utterance_with_both_hypotheses_and_its_word_errors(
    tiny, raw_test_split, monkeypatch
):
    import pyarrow.parquet as pq

    from evaluation import normalize_for_scoring

    manifest = raw_test_split.imported
    rows, lines = hyps_run(tiny, manifest, monkeypatch, "hyps-parquet")
    table = pq.read_table(manifest).to_pylist()
    assert len(lines) == len(table) == 6
    by_id = {r["segment_id"]: r for r in table}
    assert [line["id"] for line in lines] == [r["segment_id"] for r in table]
    for line in lines:
        row = by_id[line["id"]]
        assert line["lang"] == row["lang"] and line["reference"] == row["text"]
        assert line["hypothesis"] == " ".join(row["text"].split()[:-1])  # as decoded, tag first
        assert line["hypothesis_given"].split()[1:] == row["text"].split()[1:]
        # one word dropped auto, none with the language given, of the normalized reference's words
        assert line["words"] == len(normalize_for_scoring([row["text"]])[0].split())
        assert (line["word_errors"], line["word_errors_given"], line["bad_audio"]) == (1, 0, False)
    # summed per language and divided by its words: the WER the CSV reports
    for lang in ("en", "hi"):
        mine = [line for line in lines if line["lang"] == lang]
        wer = sum(line["word_errors"] for line in mine) / sum(line["words"] for line in mine)
        assert float(rows[lang]["wer"]) == pytest.approx(wer, abs=1e-6)
        assert float(rows[lang]["wer_given"]) == 0.0


def test_hyps_names_a_nemo_json_row_by_its_audio_and_marks_bad_audio(
    tiny, raw_test_split, monkeypatch, tmp_path
):
    rows = [json.loads(line) for line in raw_test_split.raw.read_text().splitlines()]
    missing = {**rows[0], "audio_filepath": str(tmp_path / "gone.wav")}
    manifest = tmp_path / "with-missing.json"
    for row in rows:  # the manifest moved: its relative audio paths resolve against the original
        path = Path(row["audio_filepath"])
        row["audio_filepath"] = str(
            path if path.is_absolute() else raw_test_split.raw.parent / path
        )
    manifest.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [*rows, missing]),
        encoding="utf-8",
    )
    _, lines = hyps_run(tiny, manifest, monkeypatch, "hyps-json", "--decode", "auto")
    assert [line["id"] for line in lines] == [r["audio_filepath"] for r in [*rows, missing]]
    assert all("hypothesis_given" not in line and "word_errors_given" not in line for line in lines)
    gone = lines[-1]
    assert gone["bad_audio"] and gone["hypothesis"] is None and gone["word_errors"] is None
    assert not any(line["bad_audio"] for line in lines[:-1])


def test_punctuation_and_case_scores_are_not_shown_where_neither_side_writes_any():
    """Plain lower-case English on both sides: no mark and no capital to get right, so neither
    score is shown (the F1 would read 1.0, the case errors 0.0). Hindi writes a danda on the
    reference side only: its F1 is shown (0), its case is not (no case in Devanagari)."""
    texts = ["<|en|> hello world", "<|en|> good day", "<|hi|> नमस्ते दुनिया।"]
    hyps = {0: "<|en|> hello world", 1: "<|en|> good day", 2: "<|hi|> नमस्ते दुनिया"}
    punctuation = evaluate.score(texts, hyps, ["en", "en", "hi"])[3]
    f1, case = punctuation["en"]
    assert math.isnan(f1) and math.isnan(case)
    f1, case = punctuation["hi"]
    assert f1 == 0.0 and math.isnan(case)
    assert punctuation["all"][0] == 0.0 and math.isnan(punctuation["all"][1])
    rows = evaluate.result_rows(evaluate.score(texts, hyps, ["en", "en", "hi"])[0], {},
                                punctuation=punctuation)  # fmt: skip
    assert [math.isnan(r["punct_f1"]) for r in rows] == [True, False, False]
    assert evaluate.punctuation_line(rows) == (
        "punctuation F1 / case errors, against the references' marks and case: "
        "en - / -, hi 0.000 / -, all 0.000 / -"
    )
    only_en = [r for r in rows if r["lang"] == "en"]
    assert "not scored" in evaluate.punctuation_line(only_en)


def test_a_capital_or_a_mark_on_either_side_makes_the_score_shown():
    texts = ["<|en|> hello world", "<|en|> Good day"]
    # the hypothesis writes a mark the reference lacks, and the second reference a capital
    hyps = {0: "<|en|> hello world.", 1: "<|en|> good day"}
    f1, case = evaluate.score(texts, hyps, ["en", "en"])[3]["en"]
    assert f1 == 0.0  # one hypothesis mark, none right
    assert case == pytest.approx(1 / 4)  # "good" for "Good", of the four recognized words


def test_validation_scores_a_punctuated_cased_hypothesis_against_plain_targets_as_perfect(
    tiny, raw_test_split, monkeypatch
):
    tokenizer = spm_tokenizer(tiny)
    manifest = raw_test_split.imported
    model = echo_model(manifest, tokenizer, lambda ref: f"{ref.upper()}?")
    monkeypatch.setattr(callbacks, "all_gather_objects", lambda obj: [obj])
    module = SimpleNamespace(model=model, device=torch.device("cpu"), last_evaluation=None)
    cb = callbacks.PerLanguageWERCallback(
        every_n_steps=5, manifest_path=manifest, with_loss=False, at_start=False
    )
    trainer = fake_trainer(0, [])
    trainer.world_size = 1
    cb.on_train_start(trainer, module)
    results = cb.evaluate(trainer, module)
    assert results["all"].utterances == 6 and results["all"].wer == results["all"].cer == 0.0
    assert module.last_evaluation["scoring"] == evaluation.NORMALIZED_SCORING


def test_validation_reports_language_identification_per_language_and_its_confusion(
    tiny, monkeypatch
):
    """Hypotheses starting with chosen tags: the first Hindi utterance starts with <|en|>, the
    second with no tag, the others with <|hi|>; the first English one with <|hi|>, the others
    with <|en|>."""
    from manifest_schema import strip_lang_tag

    tokenizer = spm_tokenizer(tiny)
    dataset, texts, _, _ = evaluate.scoring_set(tiny.manifest, tokenizer, progress=False)
    langs = [dataset.lang_names[dataset.lang_codes[i]] for i in range(len(dataset))]
    wrong = {"hi": ["en", None], "en": ["hi"]}
    seen = {"hi": 0, "en": 0}
    lookup = {}
    for i, lang in enumerate(langs):
        guess = wrong[lang][seen[lang]] if seen[lang] < len(wrong[lang]) else lang
        seen[lang] += 1
        words = strip_lang_tag(texts[i])
        lookup[EchoModel.fingerprint(dataset[i]["signal"])] = (
            f"<|{guess}|> {words}" if guess else words
        )
    n_hi, n_en = seen["hi"], seen["en"]
    assert n_hi >= 3 and n_en >= 2
    monkeypatch.setattr(callbacks, "all_gather_objects", lambda obj: [obj])
    jsonl = run_logging.JsonlMetricsLogger(tiny.root / "lid" / "metrics.jsonl")
    module = SimpleNamespace(
        model=EchoModel(tokenizer, lookup), device=torch.device("cpu"), last_evaluation=None
    )
    cb = callbacks.PerLanguageWERCallback(
        every_n_steps=5, manifest_path=tiny.manifest, with_loss=False
    )
    trainer = fake_trainer(0, [jsonl])
    trainer.world_size = 1
    cb.on_train_start(trainer, module)
    results = cb.evaluate(trainer, module)
    assert results["all"].wer == 0.0  # a wrong tag is no word error
    lines = [json.loads(line) for line in jsonl.path.read_text(encoding="utf-8").splitlines()]
    scalars = next(line for line in lines if "val/wer/all" in line)
    assert scalars["val/lid_acc/hi"] == pytest.approx((n_hi - 2) / n_hi)
    assert scalars["val/lid_acc/en"] == pytest.approx((n_en - 1) / n_en)
    assert scalars["val/lid_acc/all"] == pytest.approx((n_hi + n_en - 3) / (n_hi + n_en))
    table = next(line for line in lines if line.get("table") == "val/lid_confusion")
    assert table["step"] == 20 and table["columns"] == ["true", "guessed", "utterances"]
    assert sorted(map(tuple, table["rows"])) == [
        ("en", "en", n_en - 1),
        ("en", "hi", 1),
        ("hi", "en", 1),
        ("hi", "hi", n_hi - 2),
        ("hi", "none", 1),
    ]


def test_language_confusion_takes_only_the_leading_tag_as_the_guess():
    confusion = evaluation.language_confusion(
        ["hi", "hi", "en", "en"],
        ["<|hi|> नमस्ते", "नमस्ते <|hi|>", "", "<|ur|> خ <|en|>"],
    )
    assert confusion == {"en": {"none": 1, "ur": 1}, "hi": {"hi": 1, "none": 1}}
    assert evaluation.language_id_accuracy(confusion) == {"en": 0.0, "hi": 0.5, "all": 0.25}


def test_scoring_normalization_folds_case_punctuation_and_tags_only():
    assert evaluation.normalize_for_scoring(
        ["<|en|>  \u201cDon\u2019t,\u201d she SAID\u2026 [noise] (twice)!", "नमस्ते।  दुनिया॥"]
    ) == ["don't she said twice", "नमस्ते दुनिया"]


def test_scoring_normalization_keeps_every_indic_sign():
    # virama, nukta (precomposed and as its own sign: one spelling after NFC), vowel signs,
    # anusvara, a Malayalam chillu (NA + VIRAMA + ZWJ)
    texts = ["क्षत्रिय", "\u095bरूर", "ज\u093cरूर", "हिंदी", "பூனை", "അവന\u0d4d\u200d"]
    normalized = evaluation.normalize_for_scoring(texts)
    assert normalized[:3] == ["क्षत्रिय", "ज\u093cरूर", "ज\u093cरूर"]
    assert normalized[3:] == texts[3:]
    # so a missing sign is still an error
    counts = evaluation.corpus_error_rates(["क्षत्रिय"], ["कषत्रिय"], ["hi"])["hi"]
    assert counts.word_edits == 1 and counts.char_edits == 1


def test_the_as_written_score_counts_punctuation_and_case():
    refs, hyps = ["Hello, World!"], ["hello world"]
    assert evaluation.corpus_error_rates(refs, hyps, ["en"])["en"].wer == 0.0
    as_written = evaluation.corpus_error_rates(refs, hyps, ["en"], as_written=True)["en"]
    assert as_written.word_edits == 2 and as_written.char_edits == 4


def test_the_model_card_says_how_its_scores_compared_the_texts(tiny):
    normalized = {**RUN_RECORD["evaluation"], "scoring": evaluation.NORMALIZED_SCORING}
    card = model_card.render({**RUN_RECORD, "evaluation": normalized}, tiny.model, "tiny.nemo")
    assert "hypothesis and reference normalized alike" in card
    # a record written before normalized scoring: its counts compared the texts as written
    older = model_card.render(RUN_RECORD, tiny.model, "tiny.nemo")
    assert "language tags stripped from both sides" in older and "normalized alike" not in older


def test_the_model_card_shows_the_error_rates_with_the_language_given_beside_auto(tiny):
    given = {"hi": {"utterances": 4, "words": 10, "word_edits": 1, "chars": 40, "char_edits": 2}}
    record = {**RUN_RECORD, "evaluation": {**RUN_RECORD["evaluation"], "results_given": given}}
    card = model_card.render(record, tiny.model, "tiny.nemo")
    assert "| language | WER | WER given | CER | CER given |" in card
    assert "| hi | 0.3000 | 0.1000 | 0.1000 | 0.0500 |" in card
    assert "then only pieces of its scripts" in card and "--lang hi" in card
    off = {**record, "settings": {**record["settings"], "LANGUAGE_GIVEN_SCRIPTS": "0"}}
    assert "then any piece" in model_card.render(off, tiny.model, "tiny.nemo")
    assert "WER given" not in model_card.render(RUN_RECORD, tiny.model, "tiny.nemo")


def test_the_model_card_lists_the_finetuning_levers_with_their_values_marking_the_changed(tiny):
    defaults = config.run_settings(config.read_config({}))
    settings = {
        **defaults,
        "ENCODER_LR_SCALE": 0.5,
        "NEW_PIECE_WARMUP": 200,
        "BASE_LANGUAGES": ["en", "hi"],
        "SPEED_PERTURB": [0.9, 1.0, 1.1],
        "NOISE_PROB": 0.3,
        "NOISE_DIR": "/data/musan/noise",
    }
    card = model_card.render({**RUN_RECORD, "settings": settings}, tiny.model, "tiny.nemo")
    levers = card.split("## Finetuning levers", 1)[1].split("\n## ", 1)[0]
    scale, warmup = defaults["ENCODER_LR_SCALE"], defaults["NEW_PIECE_WARMUP"]
    assert f"| `ENCODER_LR_SCALE` | `0.5` | **changed** (default `{scale}`) |" in levers
    assert f"| `NEW_PIECE_WARMUP` | `200` | **changed** (default `{warmup}`) |" in levers
    assert "| `BASE_LANGUAGES` | `en,hi` | **changed** (default empty) |" in levers
    assert "| `SPEED_PERTURB` | `0.9,1.0,1.1` | **changed** (default empty) |" in levers
    assert "| `NOISE_PROB` | `0.3` | **changed** (default `0.0`) |" in levers
    assert "| `NOISE_DIR` | `/data/musan/noise` | **changed** (default empty) |" in levers
    for name in ("NEW_PIECE_LR_SCALE", "UNFREEZE_STEP", "BASE_LANGUAGE_SHARE", "VOCAB_SIZE"):
        assert f"| `{name}` | `{defaults[name]}` | default |" in levers
    for name in model_card.FINETUNING_LEVERS:
        if settings[name] is not None:
            assert f"| `{name}` |" in levers, name
    # train_tokenizer's knobs, as train.py's environment had them, are said to be that
    assert "`TOKENIZER_MODE`, `VOCAB_SIZE`: knobs of train_tokenizer, not of training" in levers


def test_a_setting_of_a_lever_family_is_listed_by_its_prefix_without_being_named(tiny):
    settings = {"ENCODER_LR_SCALE": 1.0, "PHASE1_LR": 3e-4, "DISTILL_TEMPERATURE": 2.0}
    settings.update(L2SP_ALPHA=0.01, AUTO_LANGUAGE_TOP=3)
    card = model_card.render({**RUN_RECORD, "settings": settings}, tiny.model, "tiny.nemo")
    levers = card.split("## Finetuning levers", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", levers, flags=re.M)
    assert listed == ["ENCODER_LR_SCALE", "DISTILL_TEMPERATURE", "L2SP_ALPHA", "AUTO_LANGUAGE_TOP"]
    assert "| `DISTILL_TEMPERATURE` | `2.0` | no default in this version of config.py |" in levers


def test_a_record_without_settings_has_no_levers_section(tiny):
    card = model_card.render({"step": 1}, tiny.model, "tiny.nemo")
    assert "## Finetuning levers" not in card


def test_the_test_manifest_of_a_kept_split_evaluates(tiny, tmp_path, capsys):
    """A master whose rows carry their source's split: make_train_val writes the test rows to the
    test manifest, which evaluate.py scores as it is."""
    import polars as pl

    from scripts import make_train_val

    frame = pl.read_parquet(tiny.manifest).with_row_index("i")
    master = tmp_path / "master.parquet"
    frame.with_columns(
        pl.col("segment_id").alias("speaker_id"),
        pl.when(pl.col("i") % 4 == 3)
        .then(pl.lit("test"))
        .when(pl.col("i") % 4 == 2)
        .then(pl.lit("dev"))
        .otherwise(pl.lit("train"))
        .alias("split"),
    ).drop("i").write_parquet(master)
    test = tmp_path / "test.parquet"
    summary = make_train_val.make_train_val(
        master, tmp_path / "train.parquet", tmp_path / "val.parquet", test_path=test, languages=()
    )
    out = tmp_path / "test.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(test), "--out", str(out)]) == 0
    rows = read_csv(out)
    assert int(rows[-1]["utterances"]) == summary["test_rows"] == frame.height // 4


def test_scoring_on_a_node_without_polars_normalizes_alike(monkeypatch):
    texts = [
        "<|en|>  \u201cDon\u2019t,\u201d she SAID\u2026 [noise] (twice)!",
        "नमस्ते।  दुनिया॥",
        "x\u200d y",
    ]
    with_polars = evaluation.normalize_for_scoring(texts)
    monkeypatch.setitem(sys.modules, "polars", None)  # import polars raises ImportError
    assert evaluation.normalize_for_scoring(texts) == with_polars
