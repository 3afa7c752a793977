"""asr_model.use_tokenizer with DECODER_INIT=carry: a finetune keeps the base model's decoder and
joint through a vocabulary change, row by row, and decodes as the base does before any update."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

import asr_model
import config
import decoding
import model_card
import vocabulary
from tests.tiny_training_data import make_extension_tokenizers, make_training_data, write_manifest
from tests.torchrun_jobs import run_torchrun, tiny_train_env

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_tdt.yaml"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """An English base tokenizer, its extension to Hindi and Tamil, and a replacement for it."""
    return make_extension_tokenizers(tmp_path_factory.mktemp("vocab"), replaced=True)


def base_model(tokenizers):
    """A tiny base model with the English tokenizer, whose output favours some pieces (a random
    model would only ever decode blank)."""
    torch.manual_seed(0)
    model = asr_model.build_model("", TINY, tokenizers["base"])
    with torch.no_grad():
        model.joint.joint_net[-1].bias[5:15] += 3.0
    return model.eval()


def state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def carried(tokenizers):
    base = base_model(tokenizers)
    before = {"decoder": state(base.decoder), "joint": state(base.joint)}
    old_pieces = vocabulary.model_pieces(base)
    counts = asr_model.use_tokenizer(base, tokenizers["extended"], decoder_init="carry")
    return base, before, old_pieces, counts


def test_shape_independent_weights_are_the_base_models(carried):
    model, before, _, _ = carried
    for part in ("decoder", "joint"):
        now = getattr(model, part).state_dict()
        for name, tensor in before[part].items():
            if now[name].shape == tensor.shape:
                assert torch.equal(now[name], tensor), f"{part}.{name}"
    assert any("lstm" in name for name in before["decoder"])  # the prediction LSTM is among them


def test_shared_pieces_blank_and_durations_carry_their_rows(carried):
    model, before, old_pieces, counts = carried
    new_pieces = vocabulary.model_pieces(model)
    v_old, v_new = len(old_pieces), len(new_pieces)
    assert counts == {
        "carried": v_old,
        "new": v_new - v_old,
        "dropped": 0,
        "decoder_init": "carry",
        "heads": ["decoder", "joint"],
        "new_piece_prior": "equal",
    }
    embed, old_embed = (
        model.decoder.state_dict()["prediction.embed.weight"],
        before["decoder"]["prediction.embed.weight"],
    )
    out_w, out_b = model.joint.joint_net[-1].weight, model.joint.joint_net[-1].bias
    old_w, old_b = before["joint"]["joint_net.2.weight"], before["joint"]["joint_net.2.bias"]
    for i, piece in enumerate(old_pieces):
        j = new_pieces.index(piece)
        assert j == i  # an extension keeps every base id
        assert torch.equal(embed[j], old_embed[i]) and torch.equal(out_w[j], old_w[i])
        assert out_b[j] == old_b[i]
    durations = model.joint.num_extra_outputs
    assert torch.equal(out_w[v_new : v_new + 1 + durations], old_w[v_old : v_old + 1 + durations])
    assert torch.equal(out_b[v_new : v_new + 1 + durations], old_b[v_old : v_old + 1 + durations])
    assert torch.equal(embed[v_new], old_embed[v_old])  # blank


def log_shares(tokenizer_dir: Path, rows: list[int]) -> torch.Tensor:
    """The new pieces' log shares the carry should start their biases from: add-one smoothed
    counts of piece_counts.json, normalized over ``rows``."""
    import json

    counts = json.loads((tokenizer_dir / "piece_counts.json").read_text())["counts"]
    smoothed = torch.tensor([counts[i] + 1.0 for i in rows], dtype=torch.float64)
    return (smoothed / smoothed.sum()).log().float()


def test_new_pieces_start_as_the_average_base_piece_pushed_down_by_log_n(carried):
    model, before, old_pieces, counts = carried
    v_old, n_new = len(old_pieces), counts["new"]
    new_ids = list(range(v_old, v_old + n_new))
    embed = model.decoder.state_dict()["prediction.embed.weight"]
    mean = before["decoder"]["prediction.embed.weight"][:v_old].mean(dim=0)
    assert torch.allclose(embed[new_ids], mean.expand(n_new, -1))
    out = model.joint.joint_net[-1]
    old_w, old_b = before["joint"]["joint_net.2.weight"], before["joint"]["joint_net.2.bias"]
    assert torch.allclose(out.weight[new_ids], old_w[:v_old].mean(dim=0).expand(n_new, -1))
    expected = float(old_b[:v_old].mean()) - math.log(n_new)
    assert torch.allclose(out.bias[new_ids], torch.full((n_new,), expected))
    assert model.new_piece_rows == new_ids


def test_with_new_piece_bias_frequency_new_pieces_start_at_their_log_share_of_the_text(
    tokenizers, monkeypatch
):
    monkeypatch.setattr(config, "NEW_PIECE_BIAS", "frequency")
    model = base_model(tokenizers)
    old_b = model.joint.joint_net[-1].bias.detach().clone()
    v_old = len(vocabulary.model_pieces(model))
    counts = asr_model.use_tokenizer(model, tokenizers["extended"], decoder_init="carry")
    assert counts["new_piece_prior"] == "frequency"
    new_ids = list(range(v_old, v_old + counts["new"]))
    shares = log_shares(tokenizers["extended"], new_ids)
    bias = model.joint.joint_net[-1].bias[new_ids]
    assert torch.allclose(bias, float(old_b[:v_old].mean()) + shares, atol=1e-6)
    # the new script's common pieces start closer to play than its rare ones
    assert float(shares.max()) - float(shares.min()) > 1.0
    # and every one still below the mean base logit, all together at most 1/V of the base's mass
    torch.manual_seed(3)
    hidden = torch.relu(torch.randn(2000, model.joint.joint_net[-1].in_features) * 3)
    logits = model.joint.joint_net[-1](hidden)
    base, new = logits[:, :v_old], logits[:, v_old : v_old + len(new_ids)]
    assert bool((new.max(dim=1).values < base.max(dim=1).values).all())
    new_mass = torch.logsumexp(new, dim=1) - torch.logsumexp(base, dim=1)
    assert float(new_mass.max()) <= -math.log(v_old) + 1e-5


def test_new_piece_bias_frequency_without_piece_counts_warns_and_starts_at_equal_shares(
    tokenizers, tmp_path, caplog, monkeypatch
):
    import logging
    import shutil

    monkeypatch.setattr(config, "NEW_PIECE_BIAS", "frequency")
    bare = tmp_path / "extended_without_counts"
    shutil.copytree(tokenizers["extended"], bare, ignore=shutil.ignore_patterns("piece_counts*"))
    model = base_model(tokenizers)
    old_b = model.joint.joint_net[-1].bias.detach().clone()
    v_old = len(vocabulary.model_pieces(model))
    with caplog.at_level(logging.WARNING):
        counts = asr_model.use_tokenizer(model, bare, decoder_init="carry")
    n_new = counts["new"]
    assert counts["new_piece_prior"] == "equal"
    assert any("holds no piece counts" in r.getMessage() for r in caplog.records)
    expected = float(old_b[:v_old].mean()) - math.log(n_new)
    bias = model.joint.joint_net[-1].bias[v_old : v_old + n_new]
    assert torch.allclose(bias, torch.full((n_new,), expected))


def test_piece_counts_of_another_tokenizer_are_ignored_with_a_warning(
    tokenizers, tmp_path, caplog, monkeypatch
):
    import logging
    import shutil

    monkeypatch.setattr(config, "NEW_PIECE_BIAS", "frequency")
    mixed = tmp_path / "extended_with_foreign_counts"
    shutil.copytree(tokenizers["extended"], mixed)
    shutil.copy(tokenizers["replaced"] / "piece_counts.json", mixed / "piece_counts.json")
    model = base_model(tokenizers)
    with caplog.at_level(logging.WARNING):
        counts = asr_model.use_tokenizer(model, mixed, decoder_init="carry")
    assert counts["new_piece_prior"] == "equal"
    assert any("counted for another tokenizer.model" in r.getMessage() for r in caplog.records)


def test_no_new_piece_outvotes_the_base_and_all_hold_at_most_1_over_v_of_its_mass(carried):
    model, _, old_pieces, counts = carried
    v_old, n_new = len(old_pieces), counts["new"]
    torch.manual_seed(3)
    hidden = torch.relu(torch.randn(2000, model.joint.joint_net[-1].in_features) * 3)
    logits = model.joint.joint_net[-1](hidden)
    base, new = logits[:, :v_old], logits[:, v_old : v_old + n_new]
    assert bool((new.max(dim=1).values < base.max(dim=1).values).all())
    new_mass = torch.logsumexp(new, dim=1) - torch.logsumexp(base, dim=1)
    assert float(new_mass.max()) <= -math.log(v_old) + 1e-5


def test_the_extended_model_decodes_as_the_base_before_any_update(tokenizers, carried):
    model = carried[0].eval()
    base = base_model(tokenizers)
    torch.manual_seed(1)
    signal_ = 0.1 * torch.randn(3, 32000)
    lengths = torch.tensor([32000, 24000, 16000])
    before = decoding.greedy_texts(base, signal_, lengths)
    assert any(before), "the base must emit something for this test to mean anything"
    assert decoding.greedy_texts(model, signal_, lengths) == before


def test_a_replaced_tokenizer_carries_the_pieces_it_shares_by_their_string(tokenizers):
    base = base_model(tokenizers)
    old_pieces = vocabulary.model_pieces(base)
    old_embed = base.decoder.state_dict()["prediction.embed.weight"].clone()
    counts = asr_model.use_tokenizer(base, tokenizers["replaced"], decoder_init="carry")
    new_pieces = vocabulary.model_pieces(base)
    shared = [p for p in new_pieces if p in old_pieces]
    assert counts["carried"] == len(shared) > 0
    assert counts["dropped"] == len(old_pieces) - len(shared)
    embed = base.decoder.state_dict()["prediction.embed.weight"]
    moved = [p for p in shared if new_pieces.index(p) != old_pieces.index(p)]
    assert moved, "the replacement must move some shared pieces for this test to mean anything"
    for p in shared:
        assert torch.equal(embed[new_pieces.index(p)], old_embed[old_pieces.index(p)])


def test_decoder_init_fresh_keeps_nemos_new_decoder_and_joint(tokenizers):
    base = base_model(tokenizers)
    lstm = base.decoder.state_dict()["prediction.dec_rnn.lstm.weight_hh_l0"].clone()
    counts = asr_model.use_tokenizer(base, tokenizers["extended"], decoder_init="fresh")
    assert counts["carried"] == 0 and counts["decoder_init"] == "fresh"
    assert not torch.equal(base.decoder.state_dict()["prediction.dec_rnn.lstm.weight_hh_l0"], lstm)


def test_the_model_card_names_the_tokenizer_mode_and_the_carried_rows(
    carried, tokenizers, monkeypatch
):
    import training_step

    monkeypatch.setattr(config, "TOKENIZER_DIR", tokenizers["extended"])
    record = {
        "settings": {"INIT_MODEL": "base.nemo"},
        "tokenizer": training_step.tokenizer_summary(),
        "vocabulary_change": carried[3],
    }
    card = model_card.render(record, carried[0], "m.nemo")
    assert "- base model: `base.nemo` (fine-tuned)" in card
    assert "- tokenizer mode: extend (40 base pieces kept with their ids" in card
    assert (
        f"- decoder and joint: the base model's, 40 piece rows carried, {carried[3]['new']} new, 0 dropped"
        in card
    )


PROBE = textwrap.dedent('''
    """train.main() that saves each rank's decoder and joint when training starts."""
    import os, sys
    import lightning.pytorch as pl
    import torch
    import train

    class Dump(pl.Callback):
        def on_train_start(self, trainer, module):
            parts = {"decoder": module.model.decoder.state_dict(), "joint": module.model.joint.state_dict()}
            torch.save({p: {k: v.clone() for k, v in s.items()} for p, s in parts.items()},
                       os.path.join(os.environ["PROBE_OUT"], f"rank{trainer.global_rank}.pt"))
    callbacks = train.build_callbacks
    train.build_callbacks = lambda: callbacks() + [Dump()]
    sys.exit(train.main([]))
''')


@pytest.mark.slow
def test_every_rank_starts_from_the_same_carried_weights_under_torchrun(tokenizers, tmp_path):
    data = make_training_data(tmp_path, per_lang=8, langs=("hi", "en", "ta"), vocab_size=120)
    base = base_model(tokenizers)
    base.save_to(str(tmp_path / "base.nemo"))
    expected = base_model(tokenizers)
    asr_model.use_tokenizer(expected, tokenizers["extended"], decoder_init="carry")
    (tmp_path / "probe.py").write_text(PROBE)
    env = tiny_train_env(
        {**data, "tokenizer": tokenizers["extended"]},
        DATA_DIR=str(tmp_path / "run"),
        INIT_MODEL=str(tmp_path / "base.nemo"),
        BASE_LANGUAGES="en",  # a base saved without this project's record of its languages
        PROBE_OUT=str(tmp_path),
        MAX_STEPS="1",
        EVAL_EVERY_STEPS="0",
    )
    result = run_torchrun(tmp_path / "probe.py", env, REPO, 240)
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    assert "piece rows carried" in out
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for part in ("decoder", "joint"):
        want = getattr(expected, part).state_dict()
        for name, tensor in want.items():
            assert torch.equal(ranks[0][part][name], ranks[1][part][name]), f"{part}.{name}"
            assert torch.equal(ranks[0][part][name], tensor), f"{part}.{name} is not the transfer"


HYBRID = REPO / "configs" / "tiny_hybrid_tdt_ctc.yaml"


def hybrid_base_model(tokenizers):
    """A tiny hybrid TDT-CTC base with the English tokenizer, whose CTC head favours some pieces."""
    torch.manual_seed(0)
    model = asr_model.build_model("", HYBRID, tokenizers["base"])
    with torch.no_grad():
        model.ctc_decoder.decoder_layers[-1].bias[5:15] += 3.0
    return model.eval()


@pytest.fixture(scope="module")
def hybrid_carried(tokenizers):
    base = hybrid_base_model(tokenizers)
    before = state(base.ctc_decoder)
    old_pieces = vocabulary.model_pieces(base)
    counts = asr_model.use_tokenizer(base, tokenizers["extended"], decoder_init="carry")
    return base, before, old_pieces, counts


def test_the_hybrid_ctc_decoder_carries_shared_piece_rows_and_moves_blank(
    hybrid_carried, tokenizers
):
    model, before, old_pieces, _ = hybrid_carried
    new_pieces = vocabulary.model_pieces(model)
    v_old, v_new = len(old_pieces), len(new_pieces)
    out = model.ctc_decoder.decoder_layers[-1]
    old_w, old_b = before["decoder_layers.0.weight"], before["decoder_layers.0.bias"]
    assert out.weight.shape[0] == v_new + 1
    for i, piece in enumerate(old_pieces):
        j = new_pieces.index(piece)
        assert torch.equal(out.weight[j], old_w[i]) and out.bias[j] == old_b[i], piece
    assert torch.equal(out.weight[v_new], old_w[v_old]) and out.bias[v_new] == old_b[v_old]
    n_new = v_new - v_old
    assert torch.allclose(out.weight[v_old:v_new], old_w[:v_old].mean(dim=0).expand(n_new, -1, -1))
    expected = float(old_b[:v_old].mean()) - math.log(n_new)
    assert torch.allclose(out.bias[v_old:v_new], torch.full((n_new,), expected))


def test_the_extended_hybrid_ctc_head_decodes_as_the_base_before_any_update(
    tokenizers, hybrid_carried
):
    model = hybrid_carried[0].eval()
    base = hybrid_base_model(tokenizers)
    torch.manual_seed(1)
    signal_ = 0.1 * torch.randn(2, 32000)
    lengths = torch.tensor([32000, 24000])

    def ctc_pieces(m) -> list[list[str]]:
        encoded, _ = m.forward(input_signal=signal_, input_signal_length=lengths)
        ids = m.ctc_decoder(encoder_output=encoded).argmax(dim=-1)
        blank = m.ctc_decoder.num_classes_with_blank - 1
        pieces = vocabulary.model_pieces(m)
        return [["<blank>" if i == blank else pieces[i] for i in row.tolist()] for row in ids]

    with torch.no_grad():
        before = ctc_pieces(base)
        assert any(p != "<blank>" for row in before for p in row), "the base must emit pieces"
        assert ctc_pieces(model) == before


def test_the_hybrid_model_card_says_the_ctc_decoder_was_carried(hybrid_carried):
    counts = hybrid_carried[3]
    card = model_card.render({"vocabulary_change": counts}, hybrid_carried[0], "m.nemo")
    assert (
        f"- decoder, joint and CTC decoder: the base model's, 40 piece rows carried, "
        f"{counts['new']} new, 0 dropped" in card
    )


def aggregate_base(root: Path):
    """A tiny TDT base with NeMo's aggregate tokenizer (one SentencePiece model per language, as
    multilingual bases have): no pieces of its own; and the English tokenizer directory."""
    en = make_training_data(root / "en", per_lang=4, langs=("en",), vocab_size=30)
    hi = make_training_data(root / "hi", per_lang=4, langs=("hi",), vocab_size=40)
    cfg = OmegaConf.load(TINY).model
    with open_dict(cfg):
        cfg.tokenizer = {
            "type": "agg",
            "langs": {
                "en": {"dir": str(en["tokenizer"]), "type": "bpe"},
                "hi": {"dir": str(hi["tokenizer"]), "type": "bpe"},
            },
        }
    return asr_model.TDT().new_model(cfg), en["tokenizer"]


def test_carry_from_a_base_without_sentencepiece_pieces_is_refused_naming_decoder_init(tmp_path):
    model, tokenizer_dir = aggregate_base(tmp_path)
    with pytest.raises(config.ConfigError, match="AggregateTokenizer.*set DECODER_INIT=fresh"):
        asr_model.use_tokenizer(model, tokenizer_dir, decoder_init="carry")


def test_decoder_init_fresh_gives_an_aggregate_tokenizer_base_the_new_vocabulary(tmp_path):
    model, tokenizer_dir = aggregate_base(tmp_path)
    counts = asr_model.use_tokenizer(model, tokenizer_dir, decoder_init="fresh")
    assert counts["decoder_init"] == "fresh" and counts["carried"] == 0
    assert vocabulary.tokenizer_matches(model, tokenizer_dir)
    assert model.joint.joint_net[-1].out_features == 30 + 1 + model.joint.num_extra_outputs


def validated_run(tmp_path: Path, data: dict, **knobs: str) -> tuple[str, list[int]]:
    """A 2-process tiny run of two optimizer steps validated at step 2 (and ``knobs``): its output
    and the steps its metrics.jsonl holds a validation of."""
    import json

    val = write_manifest(tmp_path / "val", 3, langs=("hi", "en"), seed=1, name="val.parquet")
    env = tiny_train_env(
        data,
        DATA_DIR=str(tmp_path / "run"),
        VAL_MANIFEST_PATH=str(val),
        MAX_STEPS="2",
        GRAD_ACCUM="1",
        EVAL_EVERY_STEPS="2",
        **knobs,
    )
    result = run_torchrun(REPO / "train.py", env, REPO, 300, tmp_path / "train.log")
    assert result.returncode == 0, result.stdout[-3000:]
    metrics = next((tmp_path / "run" / "wandb_logs").glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return result.stdout, [r["step"] for r in records if "val/wer/all" in r]


@pytest.mark.slow
def test_a_finetune_validates_the_base_at_step_0_and_states_base_vs_finetuned(tokenizers, tmp_path):
    data = make_training_data(tmp_path, per_lang=8, langs=("hi", "en"), vocab_size=120)
    base_model(tokenizers).save_to(str(tmp_path / "base.nemo"))
    out, validated = validated_run(
        tmp_path,
        {**data, "tokenizer": tokenizers["extended"]},
        INIT_MODEL=str(tmp_path / "base.nemo"),
        BASE_LANGUAGES="en",  # a base saved without this project's record of its languages
        UNFREEZE_STEP="1",
    )
    assert validated == [0, 2]
    assert "validation WER per language, base (step 0) -> step 2: " in out
    card = (tmp_path / "run" / "checkpoints" / "step_00000002.model-card.md").read_text()
    assert "| language | base WER | WER | change | base CER | CER |" in card
    assert "| en | " in card.split("Before and after", 1)[1]
    # at the defaults a finetune from the base says it puts the new languages first
    trade_off = "finetuning trade-off: the new languages' speed over keeping the base's (en): "
    assert trade_off in out and f"- {trade_off}" in card


@pytest.mark.slow
def test_a_run_from_scratch_does_not_validate_at_step_0(tmp_path):
    data = make_training_data(tmp_path, per_lang=8, langs=("hi", "en"), vocab_size=64)
    _, validated = validated_run(tmp_path, data)
    assert validated == [2]


@pytest.mark.parametrize(("tokenizer", "warned"), [("replaced", True), ("extended", False)])
def test_a_finetune_whose_tokenizer_does_not_extend_the_base_is_warned_with_the_fix(
    tokenizers, tmp_path, caplog, tokenizer, warned
):
    import logging

    base_model(tokenizers).save_to(str(tmp_path / "base.nemo"))
    with caplog.at_level(logging.WARNING, logger="asr_model"):
        asr_model.build_model(str(tmp_path / "base.nemo"), tokenizer_dir=tokenizers[tokenizer])
    lines = [r.getMessage() for r in caplog.records if "is not an extension" in r.getMessage()]
    assert bool(lines) == warned
    if warned:
        assert f"INIT_MODEL={tmp_path / 'base.nemo'} python scripts/train_tokenizer.py" in lines[0]
