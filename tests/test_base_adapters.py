"""The frozen-base mode (BASE_ADAPTER_DIM, base_adapters.py), each from its definition on a tiny
English base carried onto its extension to Hindi and Tamil: the base's languages decode as the base
itself decodes them (the base restored from its own .nemo is the reference), given and named by
auto decoding, whatever the adapters and the new rows learned; training steps leave every weight
and statistic the base had as it was; the record and the adapters survive a checkpoint's
description and a .nemo that NeMo's own restore loads; the settings it cannot work with are refused.
The real two-process torchrun run: test_a_two_process_run_holds_the_base_and_exports_it."""

from __future__ import annotations

import pytest
import torch

import asr_model
import base_adapters
import config
import decoding
import model_languages
import training_step
from dataset import AsrBatch
from tests.test_finetune_levers import TINY, tokenizers  # noqa: F401 (a fixture)

REPO = TINY.parent.parent


@pytest.fixture(scope="module")
def base_nemo(tokenizers, tmp_path_factory):  # noqa: F811
    """A tiny English base (its tokenizer has the tag <|en|>) saved as a .nemo recording English."""
    root = tmp_path_factory.mktemp("adapter_base")
    torch.manual_seed(0)
    base = asr_model.build_model("", TINY, tokenizers["base"])
    model_languages.record_trained_languages(base, ("en",))
    base.save_to(str(root / "base.nemo"))
    return root / "base.nemo"


def restored(path):
    from nemo.collections.asr.models import ASRModel

    return ASRModel.restore_from(str(path), map_location="cpu").eval()


def adapted(base_nemo, tokenizers, dim: int = 8):  # noqa: F811
    return asr_model.build_model(str(base_nemo), TINY, tokenizers["extended"], adapter_dim=dim)


def learned(model, seed: int = 3, rows: bool = True, tags: bool = True) -> None:
    """Move every adapter weight and (``rows``) every new piece's row, as training would have;
    with ``tags``, the new languages' tags outscore every piece at the start."""
    gen = torch.Generator().manual_seed(seed)
    new = torch.tensor(model.new_piece_rows)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base_adapters.is_adapter_parameter(name):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        for p in asr_model.family(model).piece_rows(model) if rows else ():
            p[new] += 0.5 * torch.randn(p[new].shape, generator=gen)
        if rows and tags:  # the new languages' tags come first wherever the adapted model starts
            for tag in ("<|hi|>", "<|ta|>"):
                model.joint.joint_net[-1].bias[model.tokenizer.token_to_id(tag)] += 8.0


def audio(size: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([16000 - 2000 * b for b in range(size)])
    signal = torch.zeros(size, int(lengths.max()))
    for b, n in enumerate(lengths.tolist()):
        signal[b, :n] = 0.1 * torch.randn(n, generator=gen)
    return signal, lengths


def test_only_the_adapters_and_the_new_rows_train_and_the_model_records_the_base(
    base_nemo,
    tokenizers,  # noqa: F811
):
    model = adapted(base_nemo, tokenizers)
    assert base_adapters.record_of(model) == {"languages": ("en",), "pieces": 40, "scripts": {}}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    piece_rows = {
        name
        for name, p in model.named_parameters()
        if any(p is q for q in asr_model.family(model).piece_rows(model))
    }
    adapters = {name for name in trainable if base_adapters.is_adapter_parameter(name)}
    assert {"encoder", "decoder", "joint"} == {name.split(".")[0] for name in adapters}
    assert trainable == adapters | piece_rows
    # at the start the adapters add nothing: the encoder's output is the base's
    base = restored(base_nemo)
    model.eval()
    signal, lengths = audio()
    with torch.no_grad():
        ours, _ = model.forward(input_signal=signal, input_signal_length=lengths)
        theirs, _ = base.forward(input_signal=signal, input_signal_length=lengths)
    assert torch.equal(ours, theirs)


def test_the_base_languages_decode_as_the_base_whatever_the_adapters_learned(
    base_nemo,
    tokenizers,  # noqa: F811
):
    model = adapted(base_nemo, tokenizers)
    learned(model)
    model.eval()
    base = restored(base_nemo)
    signal, lengths = audio(4)
    langs = ["en", "hi", "en", "ta"]
    ours = decoding.decode_batch(model, signal, lengths, auto=False, languages=langs).given_texts
    theirs = decoding.decode_batch(base, signal, lengths, auto=False, languages=["en"] * 4)
    assert [ours[0], ours[2]] == [theirs.given_texts[0], theirs.given_texts[2]]
    # the new languages decode with the adapters on: the learned model's own search
    with_adapters = decoding.decode_encoded(
        model,
        *model.forward(input_signal=signal, input_signal_length=lengths),
        auto=False,
        languages=langs,
    ).given_texts
    assert [ours[1], ours[3]] == [with_adapters[1], with_adapters[3]]
    assert with_adapters[0] != ours[0]  # the adapters did change English: the base wrote it


def names_english_first(model) -> None:
    """Make the joint's adapter add a constant along <|en|>'s output row, so auto decoding with
    the adapters on names English (an adapter that learned to recognise it)."""
    module = model.joint.adapter_layer["new_languages_joint"].module
    norm, down, up = module[0], module[1], module[3]
    tag = model.tokenizer.token_to_id("<|en|>")
    row = model.joint.joint_net[-1].weight[tag].detach()
    with torch.no_grad():
        norm.weight.zero_()
        norm.bias.fill_(1.0)  # the adapter's input is the constant 1 whatever the audio
        down.weight.fill_(1.0 / down.weight.shape[1])
        up.weight.copy_(40.0 * row.clamp(min=0)[:, None].expand_as(up.weight) / up.weight.shape[1])


def test_an_utterance_auto_decoding_names_as_a_base_language_is_written_by_the_base(
    base_nemo,
    tokenizers,  # noqa: F811
):
    model = adapted(base_nemo, tokenizers)
    learned(model, rows=False)
    names_english_first(model)
    model.eval()
    signal, lengths = audio(3, seed=5)
    encoded = model.forward(input_signal=signal, input_signal_length=lengths)
    adapter_texts = decoding.decode_encoded(model, *encoded).texts
    assert all(text.startswith("<|en|>") for text in adapter_texts), adapter_texts
    base = restored(base_nemo)
    theirs = decoding.decode_batch(base, signal, lengths, auto=False, languages=["en"] * 3)
    ours = decoding.decode_batch(model, signal, lengths)
    assert ours.texts == theirs.given_texts
    assert ours.texts != adapter_texts


def test_scored_auto_weighs_the_base_languages_by_the_base_and_the_new_by_the_adapted_model(
    base_nemo,
    tokenizers,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setattr(config, "AUTO_LANGUAGE", "score")
    model = adapted(base_nemo, tokenizers)
    learned(model, tags=False)
    model.eval()
    base = restored(base_nemo)
    signal, lengths = audio(4, seed=7)
    # each language's transcript with its tag given, written and scored by the model that owns
    # it: English by the base itself (its own pieces), Hindi and Tamil by the adapted model
    candidates = {}
    for lang, who in (("en", base), ("hi", model), ("ta", model)):
        encoded = who.forward(input_signal=signal, input_signal_length=lengths)
        tag = who.tokenizer.token_to_id(f"<|{lang}|>")
        tags = decoding.vocabulary.language_tag_ids(who)
        texts, ids = decoding.started_decoding(who, *encoded, [tag] * 4, None, tag_ids=tags)
        candidates[lang] = (texts, decoding.sequence_log_likelihoods(who, *encoded, ids))
    expected = [max(candidates.values(), key=lambda c: float(c[1][b]))[0][b] for b in range(4)]
    ours = decoding.decode_batch(model, signal, lengths, languages=["en", "hi", None, "ta"])
    assert ours.texts == expected
    assert ours.given_texts[0] == candidates["en"][0][0]
    assert len({text[:6] for text in ours.texts}) > 1, ours.texts  # more than one language chosen


def batch_of(model, langs, seed: int = 0) -> AsrBatch:
    gen = torch.Generator().manual_seed(seed)
    signal, lengths = audio(len(langs), seed)
    vocab = int(model.tokenizer.vocab_size)
    token_len = torch.tensor([5, 4, 6, 3][: len(langs)])
    tokens = torch.randint(0, vocab, (len(langs), int(token_len.max())), generator=gen)
    return AsrBatch(signal, lengths, tokens, token_len, list(langs), [1.0] * len(langs), {})


def test_training_steps_leave_every_weight_and_statistic_of_the_base_as_it_was(
    base_nemo,
    tokenizers,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setattr(config, "WARMUP_STEPS", 1)
    monkeypatch.setattr(config, "PHASE1_LR", 1e-2)
    monkeypatch.setattr(config, "PHASE2_LR", 1e-2)
    monkeypatch.setattr(config, "WEIGHT_DECAY", 0.1)  # decays every row a gradient reaches
    model = adapted(base_nemo, tokenizers)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module = training_step.TrainingModule(model)
    optimizer = module.configure_optimizers()["optimizer"]
    for step, phase in enumerate((1, 2, 2)):
        module.train()
        module.enter_phase(phase)
        optimizer.zero_grad()
        loss = asr_model.training_loss(
            model, batch_of(model, ["en", "hi", "ta"], seed=step), encoder_frozen=phase == 1
        )
        loss.backward()
        optimizer.step()
    after = model.state_dict()
    new = torch.tensor(model.new_piece_rows)
    rows = {id(p) for p in asr_model.family(model).piece_rows(model)}
    by_name = dict(model.named_parameters())
    moved = set()
    for name, value in before.items():
        if base_adapters.is_adapter_parameter(name):
            moved.add(name) if not torch.equal(value, after[name]) else None
            continue
        if name in by_name and id(by_name[name]) in rows:
            keep = torch.ones(value.shape[0], dtype=torch.bool)
            keep[new] = False
            assert torch.equal(value[keep], after[name][keep]), name
            assert not torch.equal(value[new], after[name][new]), name
            continue
        assert torch.equal(value, after[name]), name  # weights, BatchNorm statistics, counters
    assert {n.split(".")[0] for n in moved} == {"encoder", "decoder", "joint"}


def test_a_checkpoints_description_and_a_nemo_rebuild_the_adapters_and_the_record(
    base_nemo,
    tokenizers,  # noqa: F811
    tmp_path,
):
    model = adapted(base_nemo, tokenizers)
    learned(model)
    model.eval()
    signal, lengths = audio(2, seed=9)
    langs = ["en", "hi"]
    expected = decoding.decode_batch(model, signal, lengths, languages=langs)
    description = asr_model.portable_description(model, tokenizers["extended"])
    rebuilt = asr_model.model_from_description(description)
    rebuilt.load_state_dict(model.state_dict())
    model.save_to(str(tmp_path / "adapted.nemo"))
    for other in (rebuilt.eval(), restored(tmp_path / "adapted.nemo")):
        assert base_adapters.record_of(other) == base_adapters.record_of(model)
        assert other.get_enabled_adapters() == model.get_enabled_adapters()
        got = decoding.decode_batch(other, signal, lengths, languages=langs)
        assert (got.texts, got.given_texts) == (expected.texts, expected.given_texts)


def test_what_the_mode_cannot_work_with_is_refused_with_what_to_change(
    base_nemo,
    tokenizers,  # noqa: F811
    monkeypatch,
):
    from tests.tiny_training_data import make_extension_tokenizers

    with pytest.raises(config.ConfigError, match="INIT_MODEL is empty"):
        asr_model.build_model("", TINY, tokenizers["extended"], adapter_dim=8)
    replaced = make_extension_tokenizers(base_nemo.parent / "replaced", replaced=True)
    with pytest.raises(config.ConfigError, match="extend the base's tokenizer"):
        asr_model.build_model(str(base_nemo), TINY, replaced["replaced"], adapter_dim=8)
    model = adapted(base_nemo, tokenizers)
    model.save_to(str(base_nemo.parent / "adapted.nemo"))
    with pytest.raises(config.ConfigError, match="already has adapters"):
        adapted(base_nemo.parent / "adapted.nemo", tokenizers)
    with pytest.raises(config.ConfigError, match="is a frozen-base model"):
        adapted(base_nemo.parent / "adapted.nemo", tokenizers, dim=0)
    monkeypatch.setattr(config, "BASE_ADAPTER_DIM", 8)
    monkeypatch.setattr(config, "DISTILL_WEIGHT", 2.0)
    import base_anchor

    with pytest.raises(config.ConfigError, match="DISTILL_WEIGHT=2 keep a finetune near"):
        base_anchor.frozen_base(model)


@pytest.fixture(scope="module")
def adapter_run(base_nemo, tokenizers, tmp_path_factory):  # noqa: F811
    """torchrun train.py, 2 ranks with their DataLoader workers, BASE_ADAPTER_DIM=8 for 4 steps
    (the encoder's adapters unfrozen at step 2) with weight decay, checkpoints at steps 2 and 4
    and validation at steps 0, 2 and 4."""
    from tests.tiny_training_data import make_training_data, write_manifest
    from tests.torchrun_jobs import run_torchrun, tiny_train_env

    root = tmp_path_factory.mktemp("adapter_run")
    data = make_training_data(root, per_lang=8, langs=("hi", "en", "ta"), vocab_size=120)
    val = write_manifest(root / "val", 3, langs=("hi", "en", "ta"), seed=1, name="val.parquet")
    knobs = dict(
        INIT_MODEL=str(base_nemo),
        VAL_MANIFEST_PATH=str(val),
        GRAD_ACCUM="1",
        UNFREEZE_STEP="2",
        CHECKPOINT_EVERY="2",
        EVAL_EVERY_STEPS="2",
        BASE_ADAPTER_DIM="8",
        WEIGHT_DECAY="0.1",
        PHASE1_LR="1e-2",
        PHASE2_LR="1e-2",
    )
    data = {**data, "tokenizer": tokenizers["extended"]}
    env = tiny_train_env(data, MAX_STEPS="4", DATA_DIR=str(root / "run"), **knobs)
    result = run_torchrun(REPO / "train.py", env, REPO, 300, root / "train.log")
    assert result.returncode == 0, result.stdout[-3000:]
    return {"root": root, "data": data, "knobs": knobs, "out": result.stdout}


@pytest.mark.slow
def test_a_two_process_run_holds_the_base_and_exports_it(adapter_run, base_nemo, tokenizers):  # noqa: F811
    """Every weight and statistic of the base in the run's last checkpoint is the base's, English
    with the language given scores at every validation what the base scored, and the exported
    .nemo loads in NeMo's own restore with its adapters on and decodes English as the base, in
    Python and through transcribe.py."""
    import json

    out, root = adapter_run["out"], adapter_run["root"]
    assert "keeping the base: the base's weights held as they are; LinearAdapters of " in out
    assert "finetuning trade-off: the base's languages (en) kept exactly" in out
    checkpoints = root / "run" / "checkpoints"
    state = torch.load(checkpoints / "step_00000004.ckpt", weights_only=False)["state_dict"]
    reference = asr_model.build_model(str(base_nemo), TINY, tokenizers["extended"], adapter_dim=0)
    new = torch.tensor(reference.new_piece_rows)
    piece_rows = {
        name
        for name, p in reference.named_parameters()
        if any(p is q for q in asr_model.family(reference).piece_rows(reference))
    }
    trained = {k.removeprefix("model."): v for k, v in state.items()}
    for name, value in reference.state_dict().items():
        got = trained[name]
        if name in piece_rows:
            keep = torch.ones(value.shape[0], dtype=torch.bool)
            keep[new] = False
            assert torch.equal(got[keep], value[keep]), name
            assert not torch.equal(got[new], value[new]), name
        else:
            assert torch.equal(got, value), name
    assert any(base_adapters.is_adapter_parameter(k) for k in trained)
    metrics = next((root / "run" / "wandb_logs").glob("*/metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    given = {r["step"]: r["val/wer_given/en"] for r in rows if "val/wer_given/en" in r}
    assert set(given) == {0, 2, 4} and len(set(given.values())) == 1, given
    exported = restored(checkpoints / "step_00000004.nemo")
    assert base_adapters.record_of(exported) == {"languages": ("en",), "pieces": 40, "scripts": {}}
    assert sorted(exported.get_enabled_adapters()) == sorted(
        n.split(":")[1] for n in base_adapters.ADAPTER_NAMES
    )
    signal, lengths = audio(3, seed=2)
    ours = decoding.decode_batch(exported, signal, lengths, auto=False, languages=["en"] * 3)
    base = restored(base_nemo)
    theirs = decoding.decode_batch(base, signal, lengths, auto=False, languages=["en"] * 3)
    assert ours.given_texts == theirs.given_texts
    # transcribe.py, English given, on the validation manifest: the base's text for every file
    import subprocess
    import sys

    val = adapter_run["knobs"]["VAL_MANIFEST_PATH"]
    rows = {}
    for name, model_path in (("ours", checkpoints / "step_00000004.nemo"), ("base", base_nemo)):
        out_path = root / f"transcribed_{name}.jsonl"
        done = subprocess.run(
            [sys.executable, "scripts/transcribe.py", str(model_path), "--lang", "en"]
            + ["--manifest", val, "--out", str(out_path), "--device", "cpu"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        rows[name] = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert len(rows["ours"]) == 9
    assert [r["text"] for r in rows["ours"]] == [r["text"] for r in rows["base"]]


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_straight_runs_weights(adapter_run, tmp_path):
    """Resumed from its step-2 checkpoint (phase 1 done, the encoder's adapters about to unfreeze),
    the run ends at step 4 with every tensor the straight run ended with, adapters and held rows
    included."""
    import shutil

    from tests.torchrun_jobs import run_torchrun, tiny_train_env

    root = adapter_run["root"]
    run_dir = tmp_path / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    start = run_dir / "start.ckpt"
    shutil.copy(root / "run" / "checkpoints" / "step_00000002.ckpt", start)
    env = tiny_train_env(
        adapter_run["data"], MAX_STEPS="4", **{**adapter_run["knobs"], "DATA_DIR": str(run_dir)}
    )
    env["RESUME_FROM"] = str(start)
    result = run_torchrun(REPO / "train.py", env, REPO, 300, run_dir / "train.log")
    assert result.returncode == 0, result.stdout[-3000:]
    straight = torch.load(root / "run" / "checkpoints" / "step_00000004.ckpt", weights_only=False)
    resumed = torch.load(run_dir / "checkpoints" / "step_00000004.ckpt", weights_only=False)
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
