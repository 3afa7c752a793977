"""The finetuning levers of training_step: NEW_PIECE_LR_SCALE (larger steps for the rows of pieces
the base lacked) on its own schedule (NEW_PIECE_WARMUP, NEW_PIECE_DECAY), ENCODER_LR_SCALE (the
encoder's own LR), and a checkpoint of the one-group optimizer layout resuming under today's
groups; a real 2-process finetune with every lever on (DISTILL_WEIGHT, L2SP_WEIGHT and
AUTO_LANGUAGE=score among them), its resume and its export."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import asr_model
import config
import model_card
import model_languages
import training_step
from tests.tiny_training_data import make_extension_tokenizers, write_manifest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_tdt.yaml"


@pytest.fixture(autouse=True)
def visible_steps(monkeypatch):
    """An LR whose first step moves float32 weights visibly (the default warmup starts at 6e-8)."""
    monkeypatch.setattr(config, "WARMUP_STEPS", 1)
    monkeypatch.setattr(config, "PHASE1_LR", 1e-2)
    monkeypatch.setattr(config, "PHASE2_LR", 1e-2)
    monkeypatch.setattr(config, "UNFREEZE_STEP", 10)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """An English base tokenizer and its extension to Hindi and Tamil."""
    return make_extension_tokenizers(tmp_path_factory.mktemp("levers"))


def carried_model(tokenizers):
    """A tiny English base model carried onto the extended tokenizer, as train.py builds it (the
    same weights at every call)."""
    torch.manual_seed(0)
    model = asr_model.build_model("", TINY, tokenizers["base"])
    asr_model.use_tokenizer(model, tokenizers["extended"], decoder_init="carry")
    return model


@pytest.fixture
def finetune(tokenizers):
    return carried_model(tokenizers)


def one_step(tokenizers, scale: float, monkeypatch, grads: dict[str, torch.Tensor] | None):
    """The carried model after one AdamW step of TrainingModule's optimizer with
    NEW_PIECE_LR_SCALE ``scale`` and the given gradients (None: a skipped step, no gradient)."""
    monkeypatch.setattr(config, "NEW_PIECE_LR_SCALE", scale)
    model = carried_model(tokenizers)
    module = training_step.TrainingModule(model)
    optimizer = module.configure_optimizers()["optimizer"]
    for name, p in model.named_parameters():
        p.grad = None if grads is None else grads[name].clone()
    optimizer.step()
    return model


def test_new_piece_rows_take_steps_new_piece_lr_scale_times_adamws_and_no_other_row_does(
    finetune, tokenizers, monkeypatch
):
    torch.manual_seed(1)
    grads = {name: torch.randn_like(p) for name, p in finetune.named_parameters()}
    before = {name: p.detach().clone() for name, p in finetune.named_parameters()}
    plain = dict(one_step(tokenizers, 1.0, monkeypatch, grads).named_parameters())
    fast = dict(one_step(tokenizers, 10.0, monkeypatch, grads).named_parameters())
    rows = torch.tensor(finetune.new_piece_rows)
    names = {id(p): n for n, p in finetune.named_parameters()}
    scaled = {names[id(p)] for p, _ in asr_model.new_piece_parameters(finetune)}
    assert scaled == {
        "decoder.prediction.embed.weight",
        "joint.joint_net.2.weight",
        "joint.joint_net.2.bias",
    }
    for name, p in fast.items():
        step_fast, step_plain = p.detach() - before[name], plain[name].detach() - before[name]
        if name in scaled:
            assert torch.allclose(step_fast[rows], 10 * step_plain[rows], rtol=1e-4, atol=1e-7)
            others = torch.ones(len(p), dtype=torch.bool)
            others[rows] = False
            assert torch.equal(step_fast[others], step_plain[others]), name
            assert step_plain[rows].abs().max() > 0
        else:
            assert torch.equal(step_fast, step_plain), name


def test_a_skipped_step_moves_no_new_piece_row(finetune, tokenizers, monkeypatch):
    before = {name: p.detach().clone() for name, p in finetune.named_parameters()}
    after = one_step(tokenizers, 10.0, monkeypatch, grads=None)
    for name, p in after.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_a_model_built_fresh_has_no_new_piece_rows_to_scale(tokenizers):
    model = asr_model.build_model("", TINY, tokenizers["extended"])
    assert asr_model.new_piece_parameters(model) == []


def test_the_new_piece_factor_ramps_in_over_its_warmup_then_falls_back_to_one_by_cosine():
    # NEW_PIECE_LR_SCALE 10, NEW_PIECE_WARMUP 3: step s < 3 gets 1 + 9 (s + 1) / 3; then
    # NEW_PIECE_DECAY 4: 1 + 9 (1 + cos(pi p)) / 2 at p = (s - 3) / 4, 1 from step 7 on.
    expected = [4, 7, 10, 10, 1 + 4.5 * (1 + math.sqrt(0.5)), 5.5, 1 + 4.5 * (1 - math.sqrt(0.5))]
    expected += [1, 1, 1]
    got = [training_step.new_piece_scale_at_step(s, scale=10, warmup=3, decay=4) for s in range(10)]
    assert got == pytest.approx(expected)


def test_without_warmup_or_decay_the_new_pieces_take_the_whole_factor_at_every_step():
    for step in (0, 1, 50, 10**6):
        assert training_step.new_piece_scale_at_step(step, scale=2.7, warmup=0, decay=0) == 2.7
    # a decay alone starts from the full factor at step 0
    assert training_step.new_piece_scale_at_step(0, scale=10, warmup=0, decay=4) == 10
    assert training_step.new_piece_scale_at_step(4, scale=10, warmup=0, decay=4) == 1


def optimizer_and_schedule(model):
    configured = training_step.TrainingModule(model).configure_optimizers()
    return configured["optimizer"], configured["lr_scheduler"]["scheduler"]


def test_new_piece_rows_step_their_own_schedule_at_every_step_and_after_a_resume(
    tokenizers, monkeypatch
):
    """Each optimizer step, the new rows' change is the stated factor of that step times what AdamW
    does to them without the lever (the same gradients, no weight decay, so AdamW's own step is
    the same in both models), the other rows' change exactly AdamW's; a scheduler restored at
    step 5 (a resumed run) gives step 5's factor."""
    monkeypatch.setattr(config, "WEIGHT_DECAY", 0.0)
    monkeypatch.setattr(config, "NEW_PIECE_WARMUP", 3)
    monkeypatch.setattr(config, "NEW_PIECE_DECAY", 4)
    expected = [4, 7, 10, 10, 1 + 4.5 * (1 + math.sqrt(0.5)), 5.5, 1 + 4.5 * (1 - math.sqrt(0.5))]
    expected += [1, 1]
    models = {}
    for scale in (1.0, 10.0):
        monkeypatch.setattr(config, "NEW_PIECE_LR_SCALE", scale)
        model = carried_model(tokenizers)
        models[scale] = (model, *optimizer_and_schedule(model))
    rows = torch.tensor(models[1.0][0].new_piece_rows)
    torch.manual_seed(2)
    for step, factor in enumerate(expected):
        grads = {n: torch.randn_like(p) for n, p in models[1.0][0].named_parameters()}
        moved = {}
        for scale, (model, optimizer, scheduler) in models.items():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            optimizer.step()
            scheduler.step()
            moved[scale] = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        for name in ("decoder.prediction.embed.weight", "joint.joint_net.2.bias"):
            plain, fast = moved[1.0][name], moved[10.0][name]
            assert torch.allclose(fast[rows], factor * plain[rows], rtol=1e-3, atol=1e-6), step
            others = torch.ones(len(plain), dtype=torch.bool)
            others[rows] = False
            assert torch.equal(fast[others], plain[others]), (step, name)

    monkeypatch.setattr(config, "NEW_PIECE_LR_SCALE", 10.0)
    resumed = carried_model(tokenizers)
    optimizer, scheduler = optimizer_and_schedule(resumed)
    scheduler.last_epoch = 4
    scheduler.step()  # as Lightning leaves a scheduler restored after step 4
    plain_model = carried_model(tokenizers)
    monkeypatch.setattr(config, "NEW_PIECE_LR_SCALE", 1.0)
    plain_optimizer, plain_scheduler = optimizer_and_schedule(plain_model)
    plain_scheduler.last_epoch = 4
    plain_scheduler.step()
    before = resumed.decoder.prediction.embed.weight.detach().clone()
    for model, opt in ((resumed, optimizer), (plain_model, plain_optimizer)):
        for n, p in model.named_parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    fast = resumed.decoder.prediction.embed.weight.detach() - before
    plain = plain_model.decoder.prediction.embed.weight.detach() - before
    assert torch.allclose(fast[rows], 5.5 * plain[rows], rtol=1e-3, atol=1e-6)


def test_the_start_up_line_states_the_new_pieces_schedule(monkeypatch):
    monkeypatch.setattr(config, "NEW_PIECE_LR_SCALE", 10.0)
    monkeypatch.setattr(config, "NEW_PIECE_WARMUP", 0)
    monkeypatch.setattr(config, "NEW_PIECE_DECAY", 0)
    assert training_step.describe_new_piece_schedule() == "NEW_PIECE_LR_SCALE=10 x the LR"
    monkeypatch.setattr(config, "NEW_PIECE_WARMUP", 100)
    monkeypatch.setattr(config, "NEW_PIECE_DECAY", 300)
    assert training_step.describe_new_piece_schedule() == (
        "NEW_PIECE_LR_SCALE=10 x the LR, ramped in from 1x over NEW_PIECE_WARMUP=100 steps, then "
        "back to 1x by cosine over NEW_PIECE_DECAY=300 steps"
    )


CARRIED = {"carried": 256, "new": 64, "dropped": 0, "decoder_init": "carry"}


def trade_off(
    change=CARRIED,
    base=("en",),
    data=("en", "hi"),
    encoder=1.0,
    warn=5.0,
    anchored=None,
    adapters=0,
    auto="first",
):
    import train

    return train.finetuning_trade_off(
        change, base, list(data), encoder, warn, anchored, adapters, auto
    )


def test_a_finetune_from_the_base_with_the_defaults_says_it_puts_the_new_languages_first():
    line = trade_off()
    assert line.startswith("the new languages' speed over keeping the base's (en): step 0 ")
    assert "may drift past FORGETTING_WARN_POINTS=5 from step 0" in line
    assert "ENCODER_LR_SCALE=0.3" in line and "BASE_LANGUAGE_SHARE" in line
    assert "decode them with the language given" in line
    # the other side as measured: the settings that held the base in every cell, and their cost
    assert "take the other side with BASE_ADAPTER_DIM=32 AUTO_LANGUAGE=score" in line
    assert "kept the base's languages at the base's WER at every validation" in line
    assert "DISTILL_WEIGHT=10 L2SP_WEIGHT=100 AUTO_LANGUAGE=score" in line
    assert "within 0.054 WER of the base in every cell" in line and "up to 0.21 behind" in line
    # the base's own vocabulary (tags mode needing nothing, or the same tokenizer) starts as the base
    assert trade_off(change=None).startswith("the new languages' speed over keeping")
    assert "by several WER points" in trade_off(warn=0.0)


def test_a_frozen_base_run_says_it_keeps_the_base_exactly_and_where_auto_can_still_drift():
    scored = trade_off(adapters=32, auto="score")
    assert scored.startswith("the base's languages (en) kept exactly over the new languages' speed")
    assert "BASE_ADAPTER_DIM=32 holds every weight of the base" in scored
    assert "given and auto (AUTO_LANGUAGE=score" in scored and "up to 0.24 behind" in scored
    first = trade_off(adapters=32)
    assert "is written by the adapted model (AUTO_LANGUAGE=score lets the base speak" in first


def test_a_slower_encoder_says_it_keeps_the_base_languages_first():
    line = trade_off(encoder=0.3)
    assert line.startswith("the base's languages (en) over the new languages' speed")
    assert "ENCODER_LR_SCALE=0.3 x the LR" in line


def test_a_run_kept_near_its_base_says_it_keeps_the_base_languages_first_and_what_it_costs():
    line = trade_off(anchored={"DISTILL_WEIGHT": 10.0, "L2SP_WEIGHT": 100.0})
    assert line.startswith("the base's languages (en) over the new languages' speed")
    assert "DISTILL_WEIGHT=10 L2SP_WEIGHT=100 keep the finetune near it" in line
    assert "up to 0.21 behind a fresh tokenizer's" in line


def test_a_run_that_does_not_start_as_the_base_says_what_it_gives_up():
    dropped = trade_off(change={**CARRIED, "dropped": 40}, encoder=0.3)
    assert dropped.startswith("a new vocabulary over the base's languages (en): 40 of the ")
    assert "step 0 does not decode as the base" in dropped
    fresh = trade_off(change={"carried": 0, "new": 320, "dropped": 256, "decoder_init": "fresh"})
    assert "its decoder and joint start fresh (DECODER_INIT=fresh)" in fresh


def test_no_trade_off_without_a_new_language_to_learn():
    assert trade_off(data=("en",)) is None
    # the base's languages unknown: new pieces are what says there is something new
    assert trade_off(base=None, data=("en", "hi")).startswith(
        "the new languages' speed over keeping the base's (BASE_LANGUAGES unknown)"
    )
    assert trade_off(change=None, base=None) is None


def test_the_encoder_learns_at_encoder_lr_scale_times_the_schedule(finetune, monkeypatch):
    monkeypatch.setattr(config, "ENCODER_LR_SCALE", 0.25)
    module = training_step.TrainingModule(finetune)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    rest, enc = optimizer.param_groups
    assert {id(p) for p in enc["params"]} == {id(p) for p in finetune.encoder.parameters()}
    assert len(rest["params"]) + len(enc["params"]) == len(list(finetune.parameters()))
    schedule = training_step.lr_schedule_from_config()
    for step in (0, config.UNFREEZE_STEP + 3):
        scheduler.last_epoch = step - 1
        scheduler.step()
        assert rest["lr"] == pytest.approx(schedule(step))
        assert enc["lr"] == pytest.approx(0.25 * schedule(step))


def test_apply_current_lr_schedule_gives_each_group_its_scale(finetune, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(config, "ENCODER_LR_SCALE", 0.5)
    optimizer = training_step.TrainingModule(finetune).configure_optimizers()["optimizer"]
    for group in optimizer.param_groups:
        group["lr"] = 123.0  # as a resumed checkpoint's job left it
    training_step.apply_current_lr_schedule(SimpleNamespace(optimizers=[optimizer], global_step=7))
    lr = training_step.lr_schedule_from_config()(7)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr, 0.5 * lr])


def test_a_one_group_checkpoint_gets_todays_groups_with_each_parameters_moments(finetune):
    # The optimizer as this app built it before the groups: every parameter, one group.
    old = torch.optim.AdamW(finetune.parameters(), lr=1.0, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(old, lambda s: 1e-3)
    for p in finetune.parameters():
        p.grad = torch.randn_like(p)
    old.step()
    scheduler.step()
    moments = {id(p): old.state[p]["exp_avg"].clone() for p in finetune.parameters()}
    checkpoint = {
        "optimizer_states": [old.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
    }
    assert training_step.regroup_single_group_state(checkpoint, finetune)
    new = torch.optim.AdamW(training_step.parameter_groups(finetune), lr=1.0, betas=(0.9, 0.98))
    new.load_state_dict(checkpoint["optimizer_states"][0])
    for group in new.param_groups:
        for p in group["params"]:
            assert torch.equal(new.state[p]["exp_avg"], moments[id(p)])
    new_scheduler = torch.optim.lr_scheduler.LambdaLR(new, [lambda s: 1e-3, lambda s: 1e-3])
    new_scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
    assert new_scheduler.base_lrs == [1.0, 1.0]
    # today's layout is left as it is
    assert not training_step.regroup_single_group_state(
        {"optimizer_states": [new.state_dict()]}, finetune
    )


# ---- a real finetune: 2-process torchrun with every lever, its resume and its export ----------


@pytest.fixture(scope="module")
def finetune_run(tokenizers, tmp_path_factory):
    """A base .nemo (English tokenizer; trained here, so it records English) finetuned for 4 steps
    by torchrun train.py on Hindi, Tamil and English with the extended tokenizer and every lever on;
    checkpoints at steps 2 and 4."""
    from tests.tiny_training_data import make_training_data
    from tests.torchrun_jobs import run_torchrun, tiny_train_env

    root = tmp_path_factory.mktemp("finetune_run")
    torch.manual_seed(0)
    base = asr_model.build_model("", TINY, tokenizers["base"])
    model_languages.record_trained_languages(base, ("en",))
    base.save_to(str(root / "base.nemo"))
    data = make_training_data(root, per_lang=8, langs=("hi", "en", "ta"), vocab_size=120)
    val = write_manifest(root / "val", 3, langs=("hi", "en", "ta"), seed=1, name="val.parquet")
    knobs = dict(
        DATA_DIR=str(root / "run"),
        INIT_MODEL=str(root / "base.nemo"),
        VAL_MANIFEST_PATH=str(val),
        GRAD_ACCUM="1",
        UNFREEZE_STEP="2",
        CHECKPOINT_EVERY="2",
        EVAL_EVERY_STEPS="4",
        NEW_PIECE_LR_SCALE="10",
        NEW_PIECE_WARMUP="2",
        NEW_PIECE_DECAY="2",
        ENCODER_LR_SCALE="0.5",
        BASE_LANGUAGE_SHARE="0.6",
        DISTILL_WEIGHT="2",
        L2SP_WEIGHT="3",
        AUTO_LANGUAGE="score",
        PHASE1_LR="1e-2",
        PHASE2_LR="1e-2",
    )
    env = tiny_train_env({**data, "tokenizer": tokenizers["extended"]}, MAX_STEPS="4", **knobs)
    result = run_torchrun(REPO / "train.py", env, REPO, 300, root / "train.log")
    assert result.returncode == 0, result.stdout[-3000:]
    return {"root": root, "data": data, "knobs": knobs, "out": result.stdout}


@pytest.mark.slow
def test_a_finetune_names_its_levers_and_keeps_the_base_languages_at_their_floor(finetune_run):
    import json

    out = finetune_run["out"]
    assert "finetuning: the " in out and (
        "new pieces' rows step NEW_PIECE_LR_SCALE=10 x the LR, ramped in from 1x over "
        "NEW_PIECE_WARMUP=2 steps, then back to 1x by cosine over NEW_PIECE_DECAY=2 steps" in out
    )
    assert "the encoder's LR is ENCODER_LR_SCALE=0.5 x the LR" in out
    assert "finetuning trade-off: the base's languages (en) over the new languages' speed" in out
    assert (
        "the base's languages (en, from INIT_MODEL's record) keep at least "
        "BASE_LANGUAGE_SHARE=0.6 of the mix" in out
    )
    assert (
        "keeping the base: the encoder's output on the base's languages distilled from a frozen "
        "copy of the base at DISTILL_WEIGHT=2; the base's weights pulled toward the base at "
        "L2SP_WEIGHT=3 x the LR per step (the copy: " in out
    )
    metrics = next((finetune_run["root"] / "run" / "wandb_logs").glob("*/metrics.jsonl"))
    targets = [json.loads(line) for line in metrics.read_text().splitlines()]
    en = [r["lang_target/en"] for r in targets if "lang_target/en" in r]
    assert en and en[0] == pytest.approx(0.6)
    # distilled only once the encoder trains (optimizer steps 3 and 4, after UNFREEZE_STEP=2)
    distilled = {r["step"]: r["train/distill"] for r in targets if "train/distill" in r}
    assert set(distilled) >= {1, 2, 3, 4}, distilled
    assert any(v is not None and v > 0 for step, v in distilled.items() if step > 2), distilled
    assert all(v is None or v != v for step, v in distilled.items() if step <= 2), distilled
    # the trade-off goes where the run is read later: its W&B settings and its model card
    settings = json.loads(metrics.with_name("hparams.json").read_text())
    assert settings["finetuning_trade_off"].startswith("the base's languages (en) over the new")
    card = model_card.card_path(finetune_run["root"] / "run" / "checkpoints" / "step_00000004.nemo")
    assert "- finetuning trade-off: the base's languages (en) over the new" in card.read_text()


@pytest.mark.slow
def test_a_finetunes_checkpoints_and_exports_record_the_languages_it_was_trained_on(
    finetune_run, tmp_path
):
    # Its base's (en, from base.nemo's record) and its data's: what a finetune of it will keep.
    run = finetune_run["root"] / "run" / "checkpoints"
    exported = tmp_path / "exported.nemo"
    asr_model.load_trained_model(run / "step_00000004.ckpt").save_to(str(exported))
    for path in (run / "step_00000004.ckpt", run / "step_00000004.nemo", exported):
        assert model_languages.recorded_languages(str(path)) == ("en", "hi", "ta"), path


@pytest.mark.slow
def test_a_resumed_finetune_goes_on_with_the_new_pieces_schedule_where_it_stopped(
    finetune_run, tokenizers, tmp_path
):
    """Resumed from its step-2 checkpoint (the new rows' factor 10 there, 5.5 at step 3, not the
    first steps' 5.5 and 10 again), the run ends with the weights of the run that went straight on."""
    import shutil

    from tests.torchrun_jobs import run_torchrun, tiny_train_env

    root = finetune_run["root"]
    run_dir = tmp_path / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    start = run_dir / "start.ckpt"
    shutil.copy(root / "run" / "checkpoints" / "step_00000002.ckpt", start)
    data = {**finetune_run["data"], "tokenizer": tokenizers["extended"]}
    env = tiny_train_env(data, MAX_STEPS="4", **{**finetune_run["knobs"], "DATA_DIR": str(run_dir)})
    env["RESUME_FROM"] = str(start)
    result = run_torchrun(REPO / "train.py", env, REPO, 300, run_dir / "train.log")
    assert result.returncode == 0, result.stdout[-3000:]
    straight = torch.load(root / "run" / "checkpoints" / "step_00000004.ckpt", weights_only=False)
    resumed = torch.load(run_dir / "checkpoints" / "step_00000004.ckpt", weights_only=False)
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key


def one_group_copy(checkpoint_path: Path, model, out: Path) -> None:
    """``checkpoint_path`` rewritten as this app wrote checkpoints before the parameter groups: one
    AdamW group holding every parameter in ``model.parameters()`` order."""
    ckpt = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    (opt,) = ckpt["optimizer_states"]
    groups = training_step.parameter_groups(model)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    position = [index[id(p)] for g in groups for p in g["params"]]  # today's index -> old index
    opt["state"] = {position[new]: moments for new, moments in opt["state"].items()}
    opt["param_groups"] = [{**opt["param_groups"][0], "params": list(range(len(position)))}]
    for scheduler in ckpt["lr_schedulers"]:
        scheduler["base_lrs"] = scheduler["base_lrs"][:1]
        scheduler["_last_lr"] = scheduler["_last_lr"][:1]
        scheduler["lr_lambdas"] = scheduler["lr_lambdas"][:1]
    torch.save(ckpt, out)


@pytest.mark.slow
def test_a_checkpoint_of_the_one_group_layout_resumes_to_the_same_weights(
    finetune_run, tokenizers, tmp_path
):
    import shutil

    from tests.torchrun_jobs import run_torchrun, tiny_train_env

    root = finetune_run["root"]
    step2 = root / "run" / "checkpoints" / "step_00000002.ckpt"
    model = asr_model.build_model(str(root / "base.nemo"), tokenizer_dir=tokenizers["extended"])
    weights = {}
    for layout in ("today", "one_group"):
        run_dir = tmp_path / layout
        (run_dir / "checkpoints").mkdir(parents=True)
        start = run_dir / "start.ckpt"
        if layout == "today":
            shutil.copy(step2, start)
        else:
            one_group_copy(step2, model, start)
        knobs = {
            **finetune_run["knobs"],
            "DATA_DIR": str(run_dir),
            "EVAL_EVERY_STEPS": "0",
            "CHECKPOINT_EVERY": "1",
        }
        data = {**finetune_run["data"], "tokenizer": tokenizers["extended"]}
        env = tiny_train_env(data, MAX_STEPS="3", **knobs)
        env["RESUME_FROM"] = str(start)  # tiny_train_env leaves the caller's RESUME_ out
        result = run_torchrun(REPO / "train.py", env, REPO, 300, run_dir / "train.log")
        assert result.returncode == 0, result.stdout[-3000:]
        if layout == "one_group":
            assert "the checkpoint's optimizer had one parameter group" in result.stdout
        ckpt = torch.load(run_dir / "checkpoints" / "step_00000003.ckpt", weights_only=False)
        weights[layout] = ckpt["state_dict"]
    for key, value in weights["today"].items():
        assert torch.equal(value, weights["one_group"][key]), key


@pytest.mark.slow
def test_blend_sweep_scores_each_blend_per_language_with_the_base_languages_apart(
    finetune_run, tmp_path, capsys, monkeypatch
):
    import json

    from scripts import export_nemo

    root = finetune_run["root"]
    monkeypatch.setattr(config, "INIT_MODEL", "")  # the run's own record names its base
    scores = tmp_path / "sweep.json"
    code = export_nemo.main(
        [
            str(root / "run" / "checkpoints" / "step_00000004.ckpt"),
            "--blend-sweep",
            "0,0.5",
            "--manifest",
            finetune_run["knobs"]["VAL_MANIFEST_PATH"],
            "--sweep-json",
            str(scores),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(WER; base languages en, new hi, ta):" in out
    rows = json.loads(scores.read_text())
    assert [r["blend"] for r in rows] == [0.0, 0.5]
    assert set(rows[0]["wer"]) == {"en", "hi", "ta", "all"}
    assert not list((root / "run" / "checkpoints").glob("*.blend*"))  # a sweep exports nothing


@pytest.mark.slow
def test_blend_base_exports_the_mix_of_finetune_and_base_keeping_new_piece_rows(
    finetune_run, tokenizers, monkeypatch
):
    from scripts import export_nemo

    root = finetune_run["root"]
    monkeypatch.setattr(config, "INIT_MODEL", "")
    ckpt = root / "run" / "checkpoints" / "step_00000004.ckpt"
    assert export_nemo.main([str(ckpt), "--blend-base", "0.25"]) == 0
    blended = asr_model.load_trained_model(ckpt.with_name("step_00000004.blend0.25.nemo"))
    finetuned = asr_model.load_trained_model(ckpt)
    base = asr_model.build_model(str(root / "base.nemo"), tokenizer_dir=tokenizers["extended"])
    b, f, mix = base.state_dict(), finetuned.state_dict(), blended.state_dict()
    lstm = "decoder.prediction.dec_rnn.lstm.weight_hh_l0"
    assert not torch.equal(f[lstm], b[lstm])
    assert torch.allclose(mix[lstm], 0.75 * f[lstm] + 0.25 * b[lstm], atol=1e-6)
    new = base.new_piece_rows
    out = "joint.joint_net.2.weight"
    assert torch.equal(mix[out][new], f[out][new])  # the base had no rows of its own for them
    shared = [i for i in range(len(mix[out])) if i not in set(new)]
    assert torch.allclose(
        mix[out][shared], 0.75 * f[out][shared] + 0.25 * b[out][shared], atol=1e-6
    )
    card = ckpt.with_name("step_00000004.blend0.25.model-card.md").read_text()
    assert "blended with its base: 0.75 x finetuned + 0.25 x" in card


@pytest.mark.slow
def test_a_base_that_needs_no_vocabulary_change_is_not_the_runs_base(finetune_run, tmp_path):
    """The finetune's own export fits the checkpoint tensor for tensor, yet blending with it would
    blend the finetune with itself: refused by the vocabulary change the run recorded, even for a
    record from before bases were hashed, which names its base by its INIT_MODEL alone."""
    from scripts import export_nemo

    ckpt = finetune_run["root"] / "run" / "checkpoints" / "step_00000004.ckpt"
    own_export = tmp_path / "finetuned.nemo"
    assert export_nemo.main([str(ckpt), "--out", str(own_export)]) == 0
    checkpoint = torch.load(ckpt, weights_only=False, map_location="cpu")
    record = checkpoint[training_step.RUN_RECORD_KEY]
    assert record["vocabulary_change"] is not None
    del record["base_model"]
    record["settings"]["INIT_MODEL"] = str(own_export)
    with pytest.raises(export_nemo.BlendError, match="is not the base the run started from"):
        export_nemo.base_as_received(record, checkpoint[asr_model.PORTABLE_KEY])


def test_a_run_from_scratch_has_no_base_to_blend_with():
    from scripts import export_nemo

    with pytest.raises(export_nemo.BlendError, match="trained from scratch"):
        export_nemo.base_as_received({"settings": {"INIT_MODEL": ""}}, None)
    with pytest.raises(export_nemo.BlendError, match="DECODER_INIT=fresh"):
        export_nemo.base_as_received(
            {"settings": {"INIT_MODEL": "b.nemo", "DECODER_INIT": "fresh"}}, None
        )
