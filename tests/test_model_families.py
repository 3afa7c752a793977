"""asr_model's model families: a config names its family, and a hybrid TDT-CTC model trains through
train.py with nothing but its family in asr_model.py and its config."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import asr_model
import config
from dataset import collate_asr_batch
from tests.test_model import synthetic_items
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import tiny_train_env

HYBRID = config.REPO_DIR / "configs" / "tiny_hybrid_tdt_ctc.yaml"
TINY = config.REPO_DIR / "configs" / "tiny_tdt.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_training_data(
        tmp_path_factory.mktemp("families"), per_lang=6, langs=("hi", "en"), vocab_size=64
    )


@pytest.fixture(scope="module")
def hybrid(data):
    torch.manual_seed(0)
    return asr_model.build_model(
        init_model="", model_config=HYBRID, tokenizer_dir=data["tokenizer"]
    )


def test_a_config_without_target_builds_tdt_and_the_hybrid_config_builds_hybrid(data, hybrid):
    tdt = asr_model.build_model(init_model="", model_config=TINY, tokenizer_dir=data["tokenizer"])
    assert type(asr_model.family(tdt)) is asr_model.TDT
    assert type(asr_model.family(hybrid)) is asr_model.HybridTDTCTC
    assert type(hybrid).__name__ == "EncDecHybridRNNTCTCBPEModel"
    assert "CTC loss (weight 0.3)" in asr_model.describe(hybrid)


def test_the_hybrid_loss_weighs_the_tdt_and_ctc_losses_by_ctc_loss_weight(hybrid):
    batch = collate_asr_batch(synthetic_items(3, hybrid.tokenizer.vocab_size))
    hybrid.eval()  # no dropout: the three losses see the same encoder output
    with torch.no_grad():
        encoded, encoded_len = hybrid.forward(
            input_signal=batch.signal, input_signal_length=batch.signal_len
        )
        tdt = asr_model.TDT().loss_of_encoded(hybrid, encoded, encoded_len, batch)
        ctc = hybrid.ctc_loss(
            log_probs=hybrid.ctc_decoder(encoder_output=encoded),
            targets=batch.tokens,
            input_lengths=encoded_len,
            target_lengths=batch.token_len,
        )
        both = asr_model.training_loss(hybrid, batch, encoder_frozen=True)
    assert float(both) == pytest.approx(0.7 * float(tdt) + 0.3 * float(ctc), rel=1e-5)


def test_the_tdt_loss_of_the_joints_logits_is_the_loss_of_its_cpu_log_softmax(data, monkeypatch):
    """On CPU NeMo's joint log-softmaxes its output unless told not to; the loss normalizes its
    token and duration logits itself, so the training loss skips that pass: the same loss and
    gradients as the joint's log-softmaxed output gives, and the joint left as it was."""
    torch.manual_seed(0)
    model = asr_model.build_model(init_model="", model_config=TINY, tokenizer_dir=data["tokenizer"])
    model.eval()
    batch = collate_asr_batch(synthetic_items(3, model.tokenizer.vocab_size))
    encoded, encoded_len = model.forward(
        input_signal=batch.signal, input_signal_length=batch.signal_len
    )
    encoded = encoded.detach()
    decoded, target_len, _ = model.decoder(targets=batch.tokens, target_length=batch.token_len)
    assert model.joint.log_softmax is None
    log_probs = model.joint(encoder_outputs=encoded, decoder_outputs=decoded)
    # one log-softmax over tokens and durations together: the loss renormalizes each part
    assert torch.allclose(log_probs.exp().sum(-1), torch.tensor(1.0))
    reference = model.loss(
        log_probs=log_probs,
        targets=batch.tokens,
        input_lengths=encoded_len,
        target_lengths=target_len,
    )
    weight = model.joint.joint_net[-1].weight
    (ref_grad,) = torch.autograd.grad(reference, weight)

    full_softmaxes = []
    real = torch.Tensor.log_softmax

    def counting(self, *args, **kwargs):
        if self.shape[-1] == log_probs.shape[-1]:
            full_softmaxes.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "log_softmax", counting)
    loss = asr_model.TDT().loss_of_encoded(model, encoded, encoded_len, batch)
    (grad,) = torch.autograd.grad(loss, weight)
    assert full_softmaxes == []
    assert float(loss) == pytest.approx(float(reference), rel=1e-5)
    assert torch.allclose(grad, ref_grad, atol=1e-6, rtol=1e-4)
    assert model.joint.log_softmax is None
    monkeypatch.setattr(model.joint, "joint_net", None)  # a failing joint leaves it as it was too
    with pytest.raises(TypeError):
        asr_model.TDT().loss_of_encoded(model, encoded, encoded_len, batch)
    assert model.joint.log_softmax is None


def test_a_model_of_no_family_is_refused_with_its_class():
    with pytest.raises(config.ConfigError, match="a Linear is no model family"):
        asr_model.family(torch.nn.Linear(1, 1))


@pytest.mark.slow
def test_train_py_trains_a_hybrid_tdt_ctc_model_through_both_phases(data, tmp_path):
    env = tiny_train_env(
        data,
        MODEL_CONFIG=str(HYBRID),
        VAL_MANIFEST_PATH=str(data["manifest"]),
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        DATA_DIR=str(tmp_path),
        MAX_STEPS="4",
        UNFREEZE_STEP="2",
        CHECKPOINT_EVERY="2",
        GRAD_ACCUM="1",
    )
    out = subprocess.run(
        [sys.executable, str(config.REPO_DIR / "train.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "model EncDecHybridRNNTCTCBPEModel" in log and "+ CTC loss (weight 0.3)" in log
    assert (
        "step 2: phase 2, encoder unfrozen" in log and "done: 4 optimizer steps, 0 skipped" in log
    )
    model = asr_model.load_trained_model(tmp_path / "ckpt" / "step_00000004.ckpt")
    assert type(asr_model.family(model)) is asr_model.HybridTDTCTC
    card = (tmp_path / "ckpt" / "step_00000004.model-card.md").read_text(encoding="utf-8")
    assert "(hybrid TDT-CTC," in card
