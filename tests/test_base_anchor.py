"""What keeps a finetune near its base (base_anchor.py), each from its definition on the tiny
model carried onto an extended tokenizer: the frozen copy, the distillation of the encoder's
output on the base's languages only (DISTILL_WEIGHT), the pull of the base's weights toward the
base (L2SP_WEIGHT) leaving the new pieces' rows free, and the reduced-precision copy computing
what autocast computes. The real torchrun finetune with both on, its resume and its metrics:
test_finetune_levers.py."""

from __future__ import annotations

import pytest
import torch

import asr_model
import base_anchor
import config
import training_step
from dataset import AsrBatch
from tests.test_finetune_levers import TINY, carried_model, tokenizers  # noqa: F401 (a fixture)


def batch_of(model, langs: list[str], seed: int = 0) -> AsrBatch:
    """Random audio of 0.5 to 1 s per utterance with random pieces as targets."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(8000 + 8000 * torch.rand((), generator=gen)) for _ in langs]
    signal = torch.zeros(len(langs), max(lengths))
    for b, n in enumerate(lengths):
        signal[b, :n] = 0.1 * torch.randn(n, generator=gen)
    vocab = int(model.tokenizer.vocab_size)
    token_len = torch.tensor([4, 6, 5, 3, 4, 6][: len(langs)])
    tokens = torch.randint(0, vocab, (len(langs), int(token_len.max())), generator=gen)
    return AsrBatch(
        signal,
        torch.tensor(lengths),
        tokens,
        token_len,
        list(langs),
        [n / 16000 for n in lengths],
        {},
    )


def perturbed(model, scale: float = 0.05, seed: int = 1) -> None:
    """Move every encoder weight by noise, as training would have moved it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in asr_model.encoder(model).parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def eval_mode(model) -> None:
    """No SpecAugment or dropout: the features and the forward are the same at every call."""
    model.eval()


def test_the_copy_holds_every_part_with_weights_by_the_models_names_frozen_and_apart(tokenizers):  # noqa: F811
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    names = dict(model.named_parameters())
    assert set(base.weights) == set(names)
    for name, p in names.items():
        assert torch.equal(base.weights[name], p.detach()) and not base.weights[name].requires_grad
        assert base.weights[name].data_ptr() != p.data_ptr()
    with torch.no_grad():
        next(iter(names.values())).add_(1.0)  # the model moves, the copy does not
    first = next(iter(names))
    assert not torch.equal(base.weights[first], names[first])
    # the module that trains the model does not hold the copy as a child: DDP and the checkpoints
    # see the model's parameters alone
    module = training_step.TrainingModule(model, base=base)
    assert sum(1 for _ in module.parameters()) == len(names)
    assert all(not k.startswith("frozen_base") for k in module.state_dict())


def test_distillation_adds_the_encoders_squared_distance_from_the_base_on_base_rows_only(
    tokenizers,  # noqa: F811
):
    """loss = training loss + w x (sum over the base-language utterances of the mean over valid
    frames and channels of (encoder output - the base's encoder output)^2) / B; utterances of
    other languages add nothing, however far their output is from the base's."""
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    perturbed(model)
    eval_mode(model)
    batch = batch_of(model, ["en", "hi", "en", "ta"])
    weight = 3.0
    loss, term = base_anchor.distilled_loss(
        model, batch, base, ("en",), weight, encoder_frozen=False
    )
    plain = asr_model.training_loss(model, batch, encoder_frozen=False)
    with torch.no_grad():
        feats, feat_len = model.preprocessor(input_signal=batch.signal, length=batch.signal_len)
        expected = 0.0
        for b in (0, 2):
            one, n = feats[b : b + 1, :, : int(feat_len[b])], feat_len[b : b + 1]
            s, s_len = model.encoder(audio_signal=one, length=n)
            t, _ = base.encoder(audio_signal=one, length=n)
            frames = int(s_len[0])
            expected += float(((s - t)[0, :, :frames] ** 2).mean())
        expected /= 4
    assert float(term) == pytest.approx(weight * expected, rel=1e-3)
    assert float(loss.detach()) == pytest.approx(float(plain) + float(term), rel=1e-6)
    # only the base rows: changing the Hindi and Tamil audio leaves the term as it was
    other = batch._replace(signal=batch.signal.clone())
    other.signal[1] = 0.3 * torch.randn(other.signal.shape[1])
    other.signal[3] = 0.0
    _, again = base_anchor.distilled_loss(model, other, base, ("en",), weight, encoder_frozen=False)
    assert float(again) == pytest.approx(float(term), rel=1e-4)


def test_nothing_is_distilled_with_a_frozen_encoder_no_base_row_or_weight_zero(tokenizers):  # noqa: F811
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    perturbed(model)
    eval_mode(model)
    batch = batch_of(model, ["hi", "ta"])
    for langs, frozen, weight in (
        (("en",), False, 1.0),
        (("hi",), True, 1.0),
        (("hi",), False, 0.0),
    ):
        loss, term = base_anchor.distilled_loss(
            model, batch, base, langs, weight, encoder_frozen=frozen
        )
        assert term is None
        plain = asr_model.training_loss(model, batch, encoder_frozen=frozen)
        assert float(loss) == pytest.approx(float(plain), rel=1e-6)
    # a model still equal to the base has nothing to distill
    model = carried_model(tokenizers)
    eval_mode(model)
    _, term = base_anchor.distilled_loss(
        model, batch, base_anchor.FrozenBase.of(model), ("hi",), 1.0, encoder_frozen=False
    )
    assert float(term) == 0.0


def test_a_gradient_step_on_the_distillation_brings_the_encoder_back_toward_the_base(
    tokenizers,  # noqa: F811
):
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    perturbed(model)
    eval_mode(model)
    batch = batch_of(model, ["en", "en"])
    params = list(asr_model.encoder(model).parameters())
    optimizer = torch.optim.SGD(params, lr=0.05)
    terms = []
    for _ in range(3):
        optimizer.zero_grad()
        _, term = base_anchor.distilled_loss(model, batch, base, ("en",), 1.0, encoder_frozen=False)
        terms.append(float(term))
        # the term alone, through its gradient: the training loss is the distilled loss less it
        base_anchor.encoder_distance(*encoder_outputs(model, base, batch), batch_size=2).backward()
        optimizer.step()
    assert terms[2] < terms[1] < terms[0]
    assert all(p.grad is not None for p in params)


def encoder_outputs(model, base, batch):
    with base_anchor.encoder_input(model) as seen:
        encoded, encoded_len = model.forward(
            input_signal=batch.signal, input_signal_length=batch.signal_len
        )
    with torch.no_grad():
        teacher, _ = base.encoder(audio_signal=seen["signal"], length=seen["length"])
    return encoded, teacher, encoded_len


def test_l2sp_pulls_each_base_weight_by_weight_times_lr_times_its_distance_new_rows_free(
    tokenizers,  # noqa: F811
):
    """After an optimizer step whose own update is zero (SGD on zero gradients), each weight the
    base had is w - lr x lambda x (w - w_base); the rows of the pieces the base lacked keep their
    value, and a parameter without a gradient (frozen) is not touched."""
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    frozen = next(asr_model.encoder(model).parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p is not frozen]
    lr, weight = 0.1, 2.0
    optimizer = torch.optim.SGD(params, lr=lr)
    new_rows = asr_model.new_piece_parameters(model)
    assert new_rows, "the extended tokenizer gives the carried model new rows"
    base_anchor.PullTowardBase(model.named_parameters(), base, weight, new_rows).attach(optimizer)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    rows_of = {id(p): rows for p, rows in new_rows}
    for name, p in model.named_parameters():
        if p is frozen:
            assert torch.equal(p, before[name])
            continue
        expected = before[name] - lr * weight * (before[name] - base.weights[name])
        rows = rows_of.get(id(p))
        if rows is not None:
            expected[rows] = before[name][rows]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6, msg=name)


def test_the_optimizer_of_a_run_with_l2sp_pulls_toward_the_base_it_was_given(
    tokenizers,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setattr(config, "L2SP_WEIGHT", 5.0)
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    module = training_step.TrainingModule(model, base=base)
    optimizer = module.configure_optimizers()["optimizer"]
    far = next(p for n, p in model.named_parameters() if n.startswith("joint."))
    name = next(n for n, p in model.named_parameters() if p is far)
    with torch.no_grad():
        far.add_(1.0)
    distance = float((far - base.weights[name]).abs().mean())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # AdamW on zero gradients moves nothing but its weight decay; the pull brings it closer
    assert float((far - base.weights[name]).abs().mean()) < distance


def test_a_bf16_copy_computes_under_autocast_what_the_float32_model_computes(tokenizers):  # noqa: F811
    model = carried_model(tokenizers)
    eval_mode(model)
    base = base_anchor.FrozenBase.of(model, torch.bfloat16)
    linear = [m for m in base.encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all(m.weight.dtype == torch.bfloat16 for m in linear)
    assert base.nbytes() < base_anchor.FrozenBase.of(model).nbytes()
    batch = batch_of(model, ["en", "hi"])
    with torch.no_grad():
        feats, feat_len = model.preprocessor(input_signal=batch.signal, length=batch.signal_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, _ = model.encoder(audio_signal=feats, length=feat_len)
            copy, _ = base.encoder(audio_signal=feats, length=feat_len)
    assert torch.equal(ours, copy)


def test_copy_dtype_follows_the_precision():
    assert base_anchor.copy_dtype("bf16-mixed") is torch.bfloat16
    assert base_anchor.copy_dtype("16-mixed") is torch.float16
    assert base_anchor.copy_dtype("32-true") is None


def test_the_knobs_without_a_base_are_one_line_naming_them(tokenizers, monkeypatch):  # noqa: F811
    torch.manual_seed(0)
    model = asr_model.build_model("", TINY, tokenizers["base"])
    monkeypatch.setattr(config, "DISTILL_WEIGHT", 1.0)
    with pytest.raises(config.ConfigError, match=r"DISTILL_WEIGHT=1 .*\(INIT_MODEL is empty\)"):
        base_anchor.frozen_base(model)
    monkeypatch.setattr(config, "DISTILL_WEIGHT", 0.0)
    assert base_anchor.frozen_base(model) is None


def test_the_run_builds_its_copy_exact_for_l2sp_and_in_the_training_dtype_otherwise(
    tokenizers,  # noqa: F811
    monkeypatch,
):
    model = carried_model(tokenizers)
    model.base_model = {"path": "base.nemo"}
    monkeypatch.setattr(config, "PRECISION", "bf16-mixed")
    monkeypatch.setattr(config, "DISTILL_WEIGHT", 1.0)
    monkeypatch.setattr(config, "L2SP_WEIGHT", 0.0)
    reduced = base_anchor.frozen_base(model)
    monkeypatch.setattr(config, "L2SP_WEIGHT", 1.0)
    exact = base_anchor.frozen_base(model)
    dtypes = lambda b: {p.dtype for p in b.weights.values()}  # noqa: E731
    assert torch.bfloat16 in dtypes(reduced) and dtypes(exact) == {torch.float32}
    line = base_anchor.describe({"DISTILL_WEIGHT": 1.0, "L2SP_WEIGHT": 1.0}, exact)
    assert "DISTILL_WEIGHT=1" in line and "L2SP_WEIGHT=1" in line and "MiB per rank" in line
    assert base_anchor.describe({"DISTILL_WEIGHT": 0.0, "L2SP_WEIGHT": 0.0}, None) is None


def lattice_logits(model, joint, decoder, encoded, frames: int, ids: list[int]) -> torch.Tensor:
    """[T, U+1, V+1+D] logits of one utterance, from the definition: the prediction network reads
    the start symbol, then each piece; the joint scores every frame against each of its outputs."""
    out, state = decoder.predict(None, None, add_sos=False, batch_size=1)
    outs = [out]
    for piece in ids:
        out, state = decoder.predict(torch.tensor([[piece]]), state, add_sos=False, batch_size=1)
        outs.append(out)
    return joint.joint(encoded.transpose(1, 2)[:, :frames], torch.cat(outs, dim=1))[0]


def test_the_joint_term_is_the_mean_kl_of_the_bases_piece_distribution_over_each_lattice_cell(
    tokenizers,  # noqa: F811
):
    """KL(base || finetune) of the softmax over the pieces and blank (durations left out) at each
    (t, u) with t below the utterance's frames and u up to its pieces, averaged per utterance,
    summed over the base-language utterances and divided by the micro-batch's size."""
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in list(model.decoder.parameters()) + list(model.joint.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    eval_mode(model)
    batch = batch_of(model, ["hi", "en", "en"])
    loss, added = base_anchor.distilled_loss(
        model, batch, base, ("en",), 0.0, encoder_frozen=True, joint_weight=2.0
    )
    blank = int(model.decoder.blank_idx)
    expected = 0.0
    with torch.no_grad():
        encoded, encoded_len = model.forward(
            input_signal=batch.signal, input_signal_length=batch.signal_len
        )
        for b in (1, 2):
            frames, pieces = int(encoded_len[b]), int(batch.token_len[b])
            ids = batch.tokens[b, :pieces].tolist()
            one = encoded[b : b + 1]
            mine = lattice_logits(model, model.joint, model.decoder, one, frames, ids)
            theirs = lattice_logits(
                model, base.parts["joint"], base.parts["decoder"], one, frames, ids
            )
            p = torch.softmax(theirs[..., : blank + 1].double(), -1)
            q = torch.softmax(mine[..., : blank + 1].double(), -1)
            expected += float((p * (p.log() - q.log())).sum(-1).mean())
    expected = 2.0 * expected / 3
    assert float(added) == pytest.approx(expected, rel=1e-4)
    plain = asr_model.training_loss(model, batch, encoder_frozen=True)
    assert float(loss.detach()) == pytest.approx(float(plain) + expected, rel=1e-5)


def test_the_joint_term_trains_the_decoder_and_joint_with_the_encoder_frozen_and_charges_new_pieces(
    tokenizers,  # noqa: F811
):
    model = carried_model(tokenizers)
    base = base_anchor.FrozenBase.of(model)
    eval_mode(model)
    batch = batch_of(model, ["en", "en"])
    _, at_start = base_anchor.distilled_loss(
        model, batch, base, ("en",), 0.0, encoder_frozen=True, joint_weight=1.0
    )
    assert float(at_start) == pytest.approx(0.0, abs=1e-6)  # the base itself: nothing to charge
    # the new pieces' outputs raised, as the new languages' learning raises them
    ((joint_out, new_rows),) = [
        (p, rows) for p, rows in asr_model.new_piece_parameters(model) if p.dim() == 1
    ][:1]
    with torch.no_grad():
        joint_out[new_rows] += 3.0
    for p in model.parameters():
        p.grad = None
    _, added = base_anchor.distilled_loss(
        model, batch, base, ("en",), 0.0, encoder_frozen=True, joint_weight=1.0
    )
    assert float(added) > 0.1
    loss, _ = base_anchor.distilled_loss(
        model, batch, base, ("en",), 0.0, encoder_frozen=True, joint_weight=1.0
    )
    asr_model.set_encoder_trainable(model, False)
    loss.backward()
    assert joint_out.grad is not None and float(joint_out.grad[new_rows].abs().sum()) > 0
    assert all(p.grad is None for p in asr_model.encoder(model).parameters())


def test_preflights_step_check_runs_the_step_with_the_copy_the_run_will_hold(
    tokenizers,  # noqa: F811
    monkeypatch,
):
    """With DISTILL_WEIGHT on, preflight's step is train.py's: the same frozen copy on the device
    beside it, and every utterance of its micro-batch distilled (the most a micro-batch costs)."""
    from scripts import preflight

    model = carried_model(tokenizers)
    model.base_model = {"path": "base.nemo"}
    monkeypatch.setattr(config, "DISTILL_WEIGHT", 1.0)
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 4.0)
    monkeypatch.setattr(config, "MAX_DURATION", 2.0)
    seen = []
    real = training_step.TrainingModule.compute_loss

    def compute_loss(self, batch):
        loss = real(self, batch)
        seen.append((self.frozen_base, self.last_distill))
        return loss

    monkeypatch.setattr(training_step.TrainingModule, "compute_loss", compute_loss)
    node = preflight.Node(device=torch.device("cpu"), model=model)
    check = preflight.check_step(node)
    assert (
        "with the frozen base copy (" in check.figure
        and "every utterance distilled" in check.figure
    )
    assert seen and all(isinstance(base, base_anchor.FrozenBase) for base, _ in seen)
    # phase 2 distils: the encoder trains there
    assert any(term is not None and float(term) > 0 for _, term in seen)
