"""The full-size Parakeet-TDT 0.6B architecture (configs/parakeet_tdt_0.6b.yaml) trains on CPU.

One module-scoped run keeps it within CI (about 11 GB of memory, under a minute on one thread):
build the model from the config, switch it to a tokenizer with other language tags (NeMo's
change_vocabulary, then the rebuilt TDT loss), then one phase-1 and one phase-2 optimizer step on a
2-utterance batch through Lightning, fingerprinting the encoder between the steps (per-tensor
BLAKE2 digests instead of copies: two copies of a 0.6B encoder would double the memory).
"""

from __future__ import annotations

import gc
import hashlib
import math

import lightning.pytorch as pl
import pytest
import torch

import asr_model
import callbacks
import config
from tests.test_model import loader, synthetic_items
from tests.tiny_training_data import make_training_data
from training_step import TrainingModule

FULL = config.REPO_DIR / "configs" / "parakeet_tdt_0.6b.yaml"

pytestmark = pytest.mark.slow


def digests(module: torch.nn.Module) -> dict[str, str]:
    """BLAKE2 digest of every tensor of ``module.state_dict()``: equal digests = bit-identical tensors."""
    return {
        name: hashlib.blake2b(
            memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
        ).hexdigest()
        for name, t in module.state_dict().items()
    }


class Probe(pl.Callback):
    """Encoder / decoder+joint digests at the start of every optimizer step and the loss of every step."""

    def __init__(self):
        self.encoder: list[dict[str, str]] = []
        self.rest: list[dict[str, str]] = []
        self.losses: list[float] = []
        self.phases: list[int] = []

    def _snapshot(self, pl_module):
        self.encoder.append(digests(pl_module.model.encoder))
        self.rest.append({**digests(pl_module.model.decoder), **digests(pl_module.model.joint)})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._snapshot(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(pl_module.last_loss))
        self.phases.append(pl_module.phase)

    def on_train_end(self, trainer, pl_module):
        self._snapshot(pl_module)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    first = make_training_data(
        tmp_path_factory.mktemp("first"), per_lang=4, langs=("hi", "en"), vocab_size=64
    )
    second = make_training_data(
        tmp_path_factory.mktemp("second"), per_lang=4, langs=("hi", "en", "ta"), vocab_size=90
    )
    torch.manual_seed(0)
    model = asr_model.build_model(
        init_model="", model_config=FULL, tokenizer_dir=first["tokenizer"]
    )
    built = {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": model.tokenizer.vocab_size,
    }
    print(f"parakeet_tdt_0.6b.yaml: {built['params']:,} parameters ({built['params'] / 1e9:.3f} B)")
    asr_model.use_tokenizer(model, second["tokenizer"])

    probe = Probe()
    with pytest.MonkeyPatch.context() as mp:
        # No warmup: the first step of each phase moves every weight by about the peak LR, far above
        # float32 resolution, so "changed" is visible on every encoder tensor.
        mp.setattr(config, "WARMUP_STEPS", 0)
        mp.setattr(config, "PHASE2_WARMUP", 0)
        module = TrainingModule(model)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=2,
            max_epochs=-1,
            precision="32-true",
            gradient_clip_val=config.GRAD_CLIP,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            use_distributed_sampler=False,
            callbacks=[callbacks.EncoderUnfreezeCallback(unfreeze_step=1), probe],
        )
        items = synthetic_items(4, model.tokenizer.vocab_size)
        trainer.fit(module, train_dataloaders=loader(items, batch_size=2))
    result = {
        "built": built,
        "model": model,
        "probe": probe,
        "second": second,
        "steps": trainer.global_step,
    }
    yield result
    result.clear()
    del model, module, trainer
    gc.collect()


def test_full_size_architecture_has_about_0_6_billion_parameters(run):
    assert 0.55e9 <= run["built"]["params"] <= 0.65e9
    encoder = run["model"].encoder
    assert (encoder.n_layers, encoder.d_model, encoder._feat_in) == (24, 1024, 128)
    assert run["model"].joint.num_extra_outputs == 5


def test_change_vocabulary_gives_the_language_tags_and_a_tdt_loss_with_the_new_blank(run):
    model = run["model"]
    tokenizer = model.tokenizer
    assert tokenizer.vocab_size != run["built"]["vocab"]
    assert asr_model.tokenizer_matches(model, run["second"]["tokenizer"])
    tag = tokenizer.token_to_id("<|ta|>")
    assert tokenizer.ids_to_tokens([tag]) == ["<|ta|>"]
    inner = model.loss._loss
    assert inner.blank == tokenizer.vocab_size
    assert inner.durations == [0, 1, 2, 3, 4]
    assert model.joint.fuse_loss_wer and model.joint._loss is model.loss


def test_one_optimizer_step_in_each_phase_with_a_finite_loss(run):
    probe = run["probe"]
    assert run["steps"] == 2
    assert probe.phases == [1, 2]
    assert all(math.isfinite(loss) and loss > 0 for loss in probe.losses)


def test_phase1_step_leaves_the_encoder_bit_identical_and_trains_decoder_and_joint(run):
    before, after = run["probe"].encoder[0], run["probe"].encoder[1]
    assert before == after
    rest_before, rest_after = run["probe"].rest[0], run["probe"].rest[1]
    assert any(rest_before[k] != rest_after[k] for k in rest_before)


def test_phase2_step_changes_every_encoder_parameter(run):
    before, after = run["probe"].encoder[1], run["probe"].encoder[2]
    params = [name for name, _ in run["model"].encoder.named_parameters()]
    unchanged = [name for name in params if before[name] == after[name]]
    assert not unchanged, (
        f"{len(unchanged)} of {len(params)} encoder parameters unchanged: {unchanged[:5]}"
    )
