"""The full-size Parakeet-TDT 0.6B architecture (configs/parakeet_tdt_0.6b.yaml) trains on CPU.

One module-scoped run keeps it within CI (about 11 GB of memory, a few minutes on one thread):
build the model from the config with a 1,024-piece English tokenizer (the size of
parakeet-tdt-0.6b-v2's), switch it to that tokenizer extended to 12,000 pieces for Hindi and Tamil
(NeMo's change_vocabulary with the base's decoder and joint carried, then the rebuilt TDT loss),
then one phase-1 and one phase-2 optimizer step on a 2-utterance batch through Lightning,
fingerprinting the encoder between the steps (per-tensor BLAKE2 digests instead of copies: two
copies of a 0.6B encoder would double the memory).
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
import vocabulary
from tests.test_model import loader, synthetic_items
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


def synthetic_rows(lang: str, letters: str, n: int, rng) -> list[tuple[str, str]]:
    """``n`` sentences of random words over ``letters`` (syllables for the Indic scripts)."""
    words = ["".join(rng.choice(list(letters), size=rng.integers(2, 5))) for _ in range(4000)]
    return [(lang, " ".join(rng.choice(words, size=8))) for _ in range(n)]


def full_size_tokenizers(root) -> dict:
    """A 1,024-piece English base tokenizer and its extension to 12,000 pieces for hi and ta."""
    import numpy as np

    from scripts import train_tokenizer as tt
    from tests.test_train_tokenizer import write_manifest

    rng = np.random.default_rng(0)
    english = synthetic_rows("en", "abcdefghijklmnopqrstuvwxyz", 6000, rng)
    devanagari = [
        c + v for c in "कखगघचछजझटठडढतथदधनपफबभमयरलवशसह" for v in ["", "ा", "ि", "ी", "ु", "े", "ो"]
    ]
    tamil = [c + v for c in "கஙசஞடணதநபமயரலவழளறன" for v in ["", "ா", "ி", "ீ", "ு", "ெ", "ோ"]]
    mix = (
        english[:2000]
        + synthetic_rows("hi", devanagari, 20000, rng)
        + synthetic_rows("ta", tamil, 20000, rng)
    )
    common = dict(temperature=1.0, lang_weighting="count", seed=0)
    base = write_manifest(root / "en.parquet", english)
    tt.train_tokenizer(base, root / "base", vocab_size=1024, mode="new", **common)
    target = write_manifest(root / "mix.parquet", mix)
    tt.train_tokenizer(
        target,
        root / "extended",
        vocab_size=12000,
        mode="extend",
        base=str(root / "base"),
        **common,
    )
    return {"base": root / "base", "extended": root / "extended"}


def decoder_and_joint_rows(model) -> dict[str, torch.Tensor]:
    """Copies of the vocabulary-sized rows (embedding, joint output) and of two weights that do not
    depend on the vocabulary (an LSTM input matrix, the joint's encoder projection)."""
    return {
        "embed": model.decoder.prediction["embed"].weight.detach().clone(),
        "out_weight": model.joint.joint_net[-1].weight.detach().clone(),
        "out_bias": model.joint.joint_net[-1].bias.detach().clone(),
        "lstm": model.decoder.state_dict()["prediction.dec_rnn.lstm.weight_ih_l0"].clone(),
        "enc": model.joint.enc.weight.detach().clone(),
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tokenizers = full_size_tokenizers(tmp_path_factory.mktemp("tokenizers"))
    second = {"tokenizer": tokenizers["extended"]}
    torch.manual_seed(0)
    model = asr_model.build_model(
        init_model="", model_config=FULL, tokenizer_dir=tokenizers["base"]
    )
    built = {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": model.tokenizer.vocab_size,
    }
    print(f"parakeet_tdt_0.6b.yaml: {built['params']:,} parameters ({built['params'] / 1e9:.3f} B)")
    base_rows = decoder_and_joint_rows(model)
    vocabulary_change = asr_model.use_tokenizer(model, tokenizers["extended"], decoder_init="carry")
    carried_rows = decoder_and_joint_rows(model)

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
        "base_rows": base_rows,
        "vocabulary_change": vocabulary_change,
        "carried_rows": carried_rows,
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
    assert vocabulary.tokenizer_matches(model, run["second"]["tokenizer"])
    tag = tokenizer.token_to_id("<|ta|>")
    assert tokenizer.ids_to_tokens([tag]) == ["<|ta|>"]
    inner = model.loss._loss
    assert inner.blank == tokenizer.vocab_size
    assert inner.durations == [0, 1, 2, 3, 4]
    assert model.joint.fuse_loss_wer and model.joint._loss is model.loss


def test_a_1024_piece_base_extended_to_12k_carries_its_decoder_and_joint_at_full_size(run):
    base, carried, change = run["base_rows"], run["carried_rows"], run["vocabulary_change"]
    assert run["built"]["vocab"] == 1024 and run["model"].tokenizer.vocab_size == 12000
    assert change["carried"] == 1024 and change["new"] == 12000 - 1024 and change["dropped"] == 0
    assert carried["embed"].shape[0] == 12001 and carried["out_weight"].shape[0] == 12000 + 1 + 5
    assert torch.equal(carried["lstm"], base["lstm"]) and torch.equal(carried["enc"], base["enc"])
    assert torch.equal(carried["embed"][:1024], base["embed"][:1024])  # every base piece, same id
    assert torch.equal(carried["embed"][12000], base["embed"][1024])  # blank
    assert torch.equal(carried["out_weight"][:1024], base["out_weight"][:1024])
    assert torch.equal(carried["out_weight"][12000:], base["out_weight"][1024:])  # blank, durations
    assert torch.equal(carried["out_bias"][12000:], base["out_bias"][1024:])
    mean_row = base["out_weight"][:1024].mean(dim=0)
    assert torch.allclose(carried["out_weight"][1024:12000], mean_row.expand(12000 - 1024, -1))
    expected = float(base["out_bias"][:1024].mean()) - math.log(12000 - 1024)
    assert torch.allclose(carried["out_bias"][1024:12000], torch.full((12000 - 1024,), expected))


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
