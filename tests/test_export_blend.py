"""scripts/export_nemo.py's blends and averages on a real finetune: the base blended with is the one
the run recorded when it loaded it (path, weights hash, the settings it was built with), never the
shell's INIT_MODEL or NEW_PIECE_BIAS; another model only when named with --base-model, and only with
the recorded weights; and a card's numbers are those of the weights in its .nemo."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import asr_model
import config
import training_step
from tests.tiny_training_data import make_extension_tokenizers, make_training_data, write_manifest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_tdt.yaml"

# ---- what a run records of its base -------------------------------------------------------------


class Loaded(torch.nn.Module):
    """A model as this job's build_model left it: ``base_model`` is the base this job loaded."""

    def __init__(self, base_model: dict | None):
        super().__init__()
        self.base_model = base_model


def resumed_base(loaded: dict | None, recorded: dict | None) -> dict | None:
    """The base a resumed run records: this job loaded ``loaded``, its checkpoint recorded
    ``recorded``."""
    module = training_step.TrainingModule(Loaded(loaded))
    record = {} if recorded is None else {"base_model": recorded}
    module.on_load_checkpoint({training_step.RUN_RECORD_KEY: record})
    return module.run_record()["base_model"]


FIRST = {
    "path": "/cluster-a/models/base.nemo",
    "weights_sha256": "a1" * 32,
    "DECODER_INIT": "carry",
    "NEW_PIECE_BIAS": "frequency",
}


def test_a_resume_records_the_base_where_this_job_found_the_same_weights():
    here = {**FIRST, "path": "/cluster-b/base.nemo", "NEW_PIECE_BIAS": "equal"}
    # the settings the run built its base with stay the first job's
    assert resumed_base(here, FIRST) == {**FIRST, "path": "/cluster-b/base.nemo"}


def test_a_resume_from_another_base_keeps_the_base_the_run_started_from():
    other = {**FIRST, "path": "/cluster-b/base.nemo", "weights_sha256": "b2" * 32}
    assert resumed_base(other, FIRST) == FIRST


def test_a_resume_of_a_checkpoint_from_before_bases_were_recorded_records_none():
    """The base this job loaded is not known to be the run's: nothing is guessed."""
    assert resumed_base(FIRST, None) is None


# ---- a real finetune and its exports --------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An English base .nemo finetuned for 4 steps by torchrun train.py on Hindi, Tamil and English
    with the extended tokenizer and NEW_PIECE_BIAS=frequency (checkpoints at steps 2 and 4, validated
    at steps 0 and 4), and a colleague's English finetune: the base's tokenizer, other weights."""
    from tests.torchrun_jobs import run_torchrun, tiny_train_env

    root = tmp_path_factory.mktemp("export_blend")
    tokenizers = make_extension_tokenizers(root / "tokenizers")
    torch.manual_seed(0)
    base = asr_model.build_model("", TINY, tokenizers["base"])
    base.save_to(str(root / "base.nemo"))
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    base.save_to(str(root / "colleague.nemo"))
    data = make_training_data(root, per_lang=8, langs=("hi", "en", "ta"), vocab_size=120)
    val = write_manifest(root / "val", 3, langs=("hi", "en", "ta"), seed=1, name="val.parquet")
    env = tiny_train_env(
        {**data, "tokenizer": tokenizers["extended"]},
        MAX_STEPS="4",
        DATA_DIR=str(root / "run"),
        INIT_MODEL=str(root / "base.nemo"),
        NEW_PIECE_BIAS="frequency",
        BASE_LANGUAGES="en",
        VAL_MANIFEST_PATH=str(val),
        GRAD_ACCUM="1",
        CHECKPOINT_EVERY="2",
        EVAL_EVERY_STEPS="4",
        PHASE1_LR="1e-2",
        PHASE2_LR="1e-2",
    )
    result = run_torchrun(REPO / "train.py", env, REPO, 300, root / "train.log")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "from their share of the tokenizer's sampled text" in result.stdout
    checkpoints = root / "run" / "checkpoints"
    return {
        "root": root,
        "ckpt": checkpoints / "step_00000004.ckpt",
        "step2": checkpoints / "step_00000002.ckpt",
        "val": val,
        "tokenizers": tokenizers,
    }


@pytest.fixture(autouse=True)
def shell_without_training_settings(monkeypatch):
    """The export's shell as a fresh one: no INIT_MODEL, NEW_PIECE_BIAS at its default."""
    monkeypatch.setattr(config, "INIT_MODEL", "")
    monkeypatch.setattr(config, "NEW_PIECE_BIAS", "equal")


def weights_hash(nemo: Path) -> str:
    from nemo.collections.asr.models import ASRModel

    return asr_model.weights_sha256(ASRModel.restore_from(str(nemo), map_location="cpu"))


@pytest.fixture(scope="module")
def received(run):
    """The run's base through its vocabulary change, built as training built it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "NEW_PIECE_BIAS", "frequency")
        return asr_model.build_model(
            str(run["root"] / "base.nemo"),
            tokenizer_dir=run["tokenizers"]["extended"],
            decoder_init="carry",
        )


def assert_blend_of(nemo: Path, ckpt: Path, base, amount: float) -> None:
    """``nemo`` holds (1 - amount) x the checkpoint's weights + amount x ``base``'s."""
    blended = asr_model.load_trained_model(nemo).state_dict()
    finetuned = asr_model.load_trained_model(ckpt).state_dict()
    lstm = "decoder.prediction.dec_rnn.lstm.weight_hh_l0"
    expected = (1 - amount) * finetuned[lstm] + amount * base.state_dict()[lstm]
    assert torch.allclose(blended[lstm], expected, atol=1e-6)


def with_record(run, tmp_path: Path, change) -> Path:
    """A copy of the run's step-4 checkpoint whose run record ``change`` edited in place: what a
    run directory copied to another machine, or written by an older version, holds."""
    checkpoint = torch.load(run["ckpt"], weights_only=False, map_location="cpu")
    change(checkpoint[training_step.RUN_RECORD_KEY])
    out = tmp_path / "copied" / "step_00000004.ckpt"
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out)
    return out


@pytest.mark.slow
def test_the_run_records_its_base_path_weights_hash_and_build_settings(run):
    record = torch.load(run["ckpt"], weights_only=False, map_location="cpu")[
        training_step.RUN_RECORD_KEY
    ]
    assert record["base_model"] == {
        "path": str(run["root"] / "base.nemo"),
        "weights_sha256": weights_hash(run["root"] / "base.nemo"),
        "DECODER_INIT": "carry",
        "NEW_PIECE_BIAS": "frequency",
    }


@pytest.mark.slow
def test_blend_base_uses_the_recorded_base_not_the_init_model_the_shell_holds(
    run, received, tmp_path
):
    """The shell holds a colleague's English finetune (the base's tokenizer, other weights) as
    INIT_MODEL and the run's NEW_PIECE_BIAS: the blend is still with the run's own base, and the
    card names it by path and weights hash."""
    ckpt = tmp_path / "step_00000004.ckpt"
    shutil.copy(run["ckpt"], ckpt)
    env = {
        **os.environ,
        "INIT_MODEL": str(run["root"] / "colleague.nemo"),
        "NEW_PIECE_BIAS": "frequency",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "scripts/export_nemo.py", str(ckpt), "--blend-base", "0.25"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_blend_of(ckpt.with_name("step_00000004.blend0.25.nemo"), ckpt, received, 0.25)
    card = ckpt.with_name("step_00000004.blend0.25.model-card.md").read_text()
    digest = weights_hash(run["root"] / "base.nemo")
    assert (
        f"0.75 x finetuned + 0.25 x {run['root'] / 'base.nemo'} (weights sha256 {digest})" in card
    )
    assert "colleague" not in card


@pytest.mark.slow
def test_a_run_trained_with_frequency_biases_blends_with_its_base_the_shell_setting_nothing(
    run, received, tmp_path
):
    from scripts import export_nemo

    ckpt = tmp_path / "step_00000004.ckpt"
    shutil.copy(run["ckpt"], ckpt)
    assert export_nemo.main([str(ckpt), "--blend-base", "0.25"]) == 0
    assert_blend_of(ckpt.with_name("step_00000004.blend0.25.nemo"), ckpt, received, 0.25)


@pytest.mark.slow
def test_where_the_new_pieces_biases_started_is_not_compared(run, received, tmp_path):
    """A record from before bases were recorded, without NEW_PIECE_BIAS among its settings: its base
    is rebuilt with equal biases, which differs from the run's start only in rows a blend keeps
    finetuned."""
    from scripts import export_nemo

    def older(record):
        del record["base_model"]
        del record["settings"]["NEW_PIECE_BIAS"]

    ckpt = with_record(run, tmp_path, older)
    assert export_nemo.main([str(ckpt), "--blend-base", "0.25"]) == 0
    assert_blend_of(ckpt.with_name("step_00000004.blend0.25.nemo"), ckpt, received, 0.25)


@pytest.mark.slow
def test_a_base_missing_at_its_recorded_path_is_named_with_its_hash_and_how_to_give_it(
    run, received, tmp_path, capsys
):
    """The run directory copied to a machine where the base lives at another path."""
    from scripts import export_nemo

    recorded = tmp_path / "trainer-node" / "models" / "base.nemo"

    def elsewhere(record):
        record["base_model"]["path"] = str(recorded)

    ckpt = with_record(run, tmp_path, elsewhere)
    assert export_nemo.main([str(ckpt), "--blend-base", "0.25"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    digest = weights_hash(run["root"] / "base.nemo")
    assert str(recorded) in err[0] and digest in err[0] and "--base-model PATH" in err[0]
    assert not list(ckpt.parent.glob("*.blend*"))

    here = tmp_path / "shared" / "parakeet-base.nemo"
    here.parent.mkdir()
    shutil.copy(run["root"] / "base.nemo", here)
    code = export_nemo.main(
        [str(ckpt), "--blend-base", "0.25", "--no-score", "--base-model", str(here)]
    )
    assert code == 0
    assert_blend_of(ckpt.with_name("step_00000004.blend0.25.nemo"), ckpt, received, 0.25)
    card = ckpt.with_name("step_00000004.blend0.25.model-card.md").read_text()
    assert f"0.25 x {here} (weights sha256 {digest})" in card
    assert f"- base model: `{recorded}` (fine-tuned; weights sha256 {digest})" in card


@pytest.mark.slow
def test_a_named_model_with_other_weights_than_the_recorded_base_is_refused(run, tmp_path, capsys):
    from scripts import export_nemo

    colleague = run["root"] / "colleague.nemo"
    ckpt = tmp_path / "step_00000004.ckpt"
    shutil.copy(run["ckpt"], ckpt)
    code = export_nemo.main(
        [str(ckpt), "--blend-base", "0.25", "--no-score", "--base-model", str(colleague)]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"--base-model {colleague} is not the base the run started from" in err
    assert weights_hash(colleague) in err and weights_hash(run["root"] / "base.nemo") in err
    assert not list(tmp_path.glob("*.blend*"))


@pytest.mark.slow
def test_a_recorded_base_path_that_now_holds_other_weights_is_refused(run, tmp_path, capsys):
    """Someone replaced the file at the base's path after the run started."""
    from scripts import export_nemo

    replaced = tmp_path / "models" / "base.nemo"
    replaced.parent.mkdir()
    shutil.copy(run["root"] / "colleague.nemo", replaced)

    def replaced_base(record):
        record["base_model"]["path"] = str(replaced)

    ckpt = with_record(run, tmp_path, replaced_base)
    assert export_nemo.main([str(ckpt), "--blend-base", "0.25"]) == 2
    err = capsys.readouterr().err
    assert f"{replaced} is not the base the run started from: it holds other weights now" in err
    assert "--base-model PATH" in err


@pytest.mark.slow
def test_a_checkpoint_from_before_bases_were_recorded_blends_with_its_recorded_init_model(
    run, received, tmp_path, capsys, monkeypatch
):
    """No base identity in the record: the base is its settings' INIT_MODEL, never the shell's,
    blended after a warning that its weights cannot be checked."""
    from scripts import export_nemo

    monkeypatch.setattr(config, "INIT_MODEL", str(run["root"] / "colleague.nemo"))
    ckpt = with_record(run, tmp_path, lambda record: record.pop("base_model"))
    assert export_nemo.main([str(ckpt), "--blend-base", "0.25"]) == 0
    assert "records no weights hash of its base" in capsys.readouterr().err
    assert_blend_of(ckpt.with_name("step_00000004.blend0.25.nemo"), ckpt, received, 0.25)


@pytest.mark.slow
def test_a_checkpoint_without_a_run_record_needs_its_base_named(run, tmp_path, capsys):
    from scripts import export_nemo

    checkpoint = torch.load(run["ckpt"], weights_only=False, map_location="cpu")
    del checkpoint[training_step.RUN_RECORD_KEY]
    ckpt = tmp_path / "step_00000004.ckpt"
    torch.save(checkpoint, ckpt)
    assert export_nemo.main([str(ckpt), "--blend-base", "0.25"]) == 2
    assert "records no base model" in capsys.readouterr().err
    base = str(run["root"] / "base.nemo")
    args = [str(ckpt), "--blend-base", "0.25", "--no-score", "--base-model", base]
    assert export_nemo.main(args) == 0


# ---- the card's numbers are those of the exported weights ---------------------------------------


def card_loss(card: str) -> float:
    found = re.search(r"validation loss ([\d.]+)", card)
    assert found, card
    return float(found.group(1))


def measured_loss(nemo: Path, val: Path) -> float:
    """The validation loss of the weights in ``nemo``, over every utterance of ``val``, as the run's
    validation measures it (the training pipeline's dataset and decoding)."""
    import evaluation
    from dataset import LocalShardDataset

    model = asr_model.load_trained_model(nemo)
    asr_model.family(model).attach_loss(model)  # restore_from brings NeMo's CUDA-only TDT loss
    dataset = LocalShardDataset(val, model.tokenizer, progress=False)
    decoded = evaluation.decode(
        model, dataset, range(len(dataset)), max_batch_seconds=6.0, with_loss=True
    )
    return decoded.loss


def recorded_loss(ckpt: Path) -> float:
    record = torch.load(ckpt, weights_only=False, map_location="cpu")[training_step.RUN_RECORD_KEY]
    return record["evaluation"]["loss"]


@pytest.mark.slow
def test_the_card_of_a_blend_reports_the_blends_own_validation(run, tmp_path, monkeypatch):
    from scripts import export_nemo

    monkeypatch.setattr(config, "NEW_PIECE_BIAS", "frequency")  # as the run's shell had it
    ckpt = tmp_path / "step_00000004.ckpt"
    shutil.copy(run["ckpt"], ckpt)
    assert export_nemo.main([str(ckpt), "--blend-base", "0.5"]) == 0
    nemo = ckpt.with_name("step_00000004.blend0.5.nemo")
    card = nemo.with_name("step_00000004.blend0.5.model-card.md").read_text()
    loss = measured_loss(nemo, run["val"])
    assert abs(loss - recorded_loss(ckpt)) > 1e-3  # the blend is not the checkpoint
    assert card_loss(card) == pytest.approx(loss, abs=1e-4)
    assert "Greedy decoding of this file's weights, scored at export," in card
    assert "this model at step" not in card


@pytest.mark.slow
def test_the_card_of_an_average_reports_the_averages_own_validation(run, tmp_path):
    from scripts import export_nemo

    out = tmp_path / "mean.nemo"
    assert (
        export_nemo.main([str(run["step2"]), str(run["ckpt"]), "--out", str(out), "--no-compare"])
        == 0
    )
    card = out.with_name("mean.model-card.md").read_text()
    loss = measured_loss(out, run["val"])
    assert abs(loss - recorded_loss(run["ckpt"])) > 1e-3
    assert card_loss(card) == pytest.approx(loss, abs=1e-4)


@pytest.mark.slow
def test_an_unscored_blend_says_its_numbers_are_the_checkpoints(run, tmp_path):
    from scripts import export_nemo

    ckpt = tmp_path / "step_00000004.ckpt"
    shutil.copy(run["ckpt"], ckpt)
    assert export_nemo.main([str(ckpt), "--blend-base", "0.5", "--no-score"]) == 0
    card = ckpt.with_name("step_00000004.blend0.5.model-card.md").read_text()
    assert (
        "Not this file's weights: the numbers below are those of step_00000004.ckpt alone, "
        "before blending, validated at step 4" in card
    )
