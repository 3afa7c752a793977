"""asr_model.build_model, the TDT loss after change_vocabulary, and the two training phases (one process)."""

from __future__ import annotations

import logging
import math

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf

import asr_model
import callbacks
import config
import tdt_loss
import train
import vocabulary
from dataset import collate_asr_batch
from tests.tiny_training_data import make_training_data
from training_step import TrainingModule

TINY = config.REPO_DIR / "configs" / "tiny_tdt.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    a = make_training_data(
        tmp_path_factory.mktemp("a"), per_lang=10, langs=("hi", "en"), vocab_size=64
    )
    b = make_training_data(
        tmp_path_factory.mktemp("b"), per_lang=10, langs=("hi", "en", "ta"), vocab_size=90
    )
    return {"tok_a": a["tokenizer"], "tok_b": b["tokenizer"]}


@pytest.fixture(scope="module")
def nemo_file(data, tmp_path_factory):
    model = asr_model.build_model(init_model="", model_config=TINY, tokenizer_dir=data["tok_a"])
    path = tmp_path_factory.mktemp("nemo") / "tiny.nemo"
    model.save_to(str(path))
    return path


@pytest.fixture
def fresh(data):
    torch.manual_seed(0)
    return asr_model.build_model(init_model="", model_config=TINY, tokenizer_dir=data["tok_a"])


def synthetic_items(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        seconds = 1.0 + 0.5 * (i % 3)
        items.append(
            {
                "signal": 0.05 * torch.randn(int(seconds * 16000), generator=g),
                "tokens": torch.randint(0, vocab, (4 + i % 3,), generator=g),
                "duration": seconds,
                "lang": "hi",
                "index": i,
            }
        )
    return items


def loader(items, batch_size=2):
    return torch.utils.data.DataLoader(
        items, batch_size=batch_size, collate_fn=collate_asr_batch, shuffle=False
    )


def fit(module, items, *, max_steps, unfreeze_step, extra_callbacks=(), accumulate=1):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=-1,
        precision="32-true",
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[callbacks.EncoderUnfreezeCallback(unfreeze_step), *extra_callbacks],
    )
    trainer.fit(module, train_dataloaders=loader(items))
    return trainer


def state(module_or_model):
    return {k: v.detach().clone() for k, v in module_or_model.state_dict().items()}


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"changed: {different[:5]}"


class StateAt(pl.Callback):
    """Snapshots of a submodule's state_dict at the start of given global steps."""

    def __init__(self, part, steps):
        self.part, self.steps, self.snapshots = part, set(steps), {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps and trainer.global_step not in self.snapshots:
            self.snapshots[trainer.global_step] = state(
                getattr(pl_module.model, self.part) if self.part else pl_module
            )


@pytest.fixture(autouse=True)
def fast_schedule(monkeypatch):
    monkeypatch.setattr(config, "WARMUP_STEPS", 0)
    monkeypatch.setattr(config, "PHASE2_WARMUP", 0)
    monkeypatch.setattr(config, "MAX_STEPS", 100)


# ---- build_model and the loss -------------------------------------------------------------------


def test_fresh_tiny_model_has_a_tdt_loss_whose_blank_is_the_vocabulary_size(fresh):
    inner = fresh.loss._loss
    assert isinstance(inner, tdt_loss.DeviceDispatchTDTLoss)
    assert inner.blank == fresh.tokenizer.vocab_size == fresh.loss._blank
    assert inner.durations == [0, 1, 2, 3, 4]


def test_tiny_model_is_fastconformer_tdt_with_8x_subsampling(fresh):
    assert (
        fresh.cfg.encoder.subsampling == "dw_striding" and fresh.cfg.encoder.subsampling_factor == 8
    )
    assert fresh.joint.num_extra_outputs == 5
    assert fresh.joint.num_classes_with_blank == fresh.tokenizer.vocab_size + 1 + 5


def test_nemo_change_vocabulary_alone_leaves_a_wrong_blank_rnnt_loss(nemo_file, data):
    """The upstream behaviour build_model repairs (if this fails, NeMo fixed it: keep the repair anyway)."""
    from nemo.collections.asr.models import ASRModel

    model = ASRModel.restore_from(str(nemo_file), map_location="cpu")
    model.change_vocabulary(new_tokenizer_dir=str(data["tok_b"]), new_tokenizer_type="bpe")
    vocab = model.tokenizer.vocab_size
    assert model.loss._blank == vocab + 5
    assert type(model.loss._loss).__name__ != "TDTLossNumba"


def test_build_model_with_a_new_tokenizer_changes_vocabulary_and_rebuilds_the_tdt_loss(
    nemo_file, data
):
    model = asr_model.build_model(init_model=str(nemo_file), tokenizer_dir=data["tok_b"])
    vocab = model.tokenizer.vocab_size
    assert vocab == vocabulary._spm_pieces(data["tok_b"] / "tokenizer.model").__len__()
    inner = model.loss._loss
    assert isinstance(inner, tdt_loss.DeviceDispatchTDTLoss)
    assert inner.blank == model.loss._blank == vocab
    assert inner.durations == [0, 1, 2, 3, 4] and inner.sigma == pytest.approx(0.02)
    assert model.joint.num_classes_with_blank == vocab + 1 + 5
    assert model.tokenizer.token_to_id("<|ta|>") != model.tokenizer.token_to_id("<unk>")


def test_build_model_keeps_the_weights_when_the_tokenizer_matches(nemo_file, data):
    from nemo.collections.asr.models import ASRModel

    saved = ASRModel.restore_from(str(nemo_file), map_location="cpu")
    model = asr_model.build_model(init_model=str(nemo_file), tokenizer_dir=data["tok_a"])
    assert_bit_identical(state(model.decoder), state(saved.decoder))
    assert_bit_identical(state(model.joint), state(saved.joint))


def test_cpu_loss_of_a_micro_batch_is_finite_and_trains_the_joint(fresh):
    module = TrainingModule(fresh)
    batch = collate_asr_batch(synthetic_items(3, fresh.tokenizer.vocab_size))
    loss = module.compute_loss(batch)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    assert fresh.joint.joint_net[-1].weight.grad.abs().sum() > 0


def test_fused_joint_path_uses_the_rebuilt_loss(data):
    cfg = OmegaConf.load(TINY)
    cfg.model.joint.fuse_loss_wer = True
    cfg.model.joint.fused_batch_size = 2
    path = data["tok_a"].parent / "tiny_fused.yaml"
    OmegaConf.save(cfg, path)
    model = asr_model.build_model(init_model="", model_config=path, tokenizer_dir=data["tok_a"])
    assert model.joint._loss is model.loss
    loss = TrainingModule(model).compute_loss(
        collate_asr_batch(synthetic_items(3, model.tokenizer.vocab_size))
    )
    assert math.isfinite(loss.item())


def test_model_has_a_validation_ds_so_transcribe_works(fresh):
    assert fresh.cfg.validation_ds is not None


def test_missing_tokenizer_is_reported_with_the_variable(tmp_path):
    with pytest.raises(FileNotFoundError, match="TOKENIZER_DIR"):
        asr_model.build_model(init_model="", model_config=TINY, tokenizer_dir=tmp_path)


def test_train_help_shows_usage(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert "torchrun --nproc_per_node 8 train.py" in capsys.readouterr().out


# ---- phases (one process; the DDP side is tests/test_train_ddp.py) ------------------------------


def test_phase1_keeps_the_encoder_state_dict_bit_identical_and_trains_the_rest(fresh):
    encoder_before, decoder_before = state(fresh.encoder), state(fresh.decoder)
    module = TrainingModule(fresh)
    fit(module, synthetic_items(8, fresh.tokenizer.vocab_size), max_steps=3, unfreeze_step=100)
    assert_bit_identical(
        state(fresh.encoder), encoder_before
    )  # weights AND BatchNorm running stats
    assert any(not torch.equal(v, decoder_before[k]) for k, v in state(fresh.decoder).items())
    assert module.phase == 1 and module.encoder_frozen


def test_batchnorm_statistics_would_drift_in_train_mode(fresh):
    """Why the callback re-imposes eval(): frozen weights alone do not keep BatchNorm buffers."""
    before = state(fresh.encoder)
    for p in fresh.encoder.parameters():
        p.requires_grad_(False)
    fresh.train()
    batch = collate_asr_batch(synthetic_items(2, fresh.tokenizer.vocab_size))
    with torch.no_grad():
        fresh.forward(input_signal=batch.signal, input_signal_length=batch.signal_len)
    changed = [k for k, v in state(fresh.encoder).items() if not torch.equal(v, before[k])]
    assert changed and all("running" in k or "num_batches" in k for k in changed)


def test_phase2_unfreezes_the_encoder_at_unfreeze_step(fresh):
    encoder_start = state(fresh.encoder)
    snap = StateAt("encoder", [2])
    module = TrainingModule(fresh)
    fit(
        module,
        synthetic_items(8, fresh.tokenizer.vocab_size),
        max_steps=4,
        unfreeze_step=2,
        extra_callbacks=[snap],
    )
    assert_bit_identical(snap.snapshots[2], encoder_start)
    assert any(not torch.equal(v, encoder_start[k]) for k, v in state(fresh.encoder).items())
    assert module.phase == 2 and all(p.requires_grad for p in fresh.encoder.parameters())


def test_callback_refuses_an_encoder_frozen_before_the_ddp_wrap(fresh):
    for p in fresh.encoder.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="frozen before DDP wraps"):
        fit(
            TrainingModule(fresh),
            synthetic_items(2, fresh.tokenizer.vocab_size),
            max_steps=1,
            unfreeze_step=1,
        )


# ---- faults ---------------------------------------------------------------------------------------


def test_empty_micro_batch_gives_zero_gradient_to_every_trainable_parameter(fresh):
    module = TrainingModule(fresh)
    empty = collate_asr_batch([None, None])
    assert empty.is_empty
    loss = module.training_step(empty, 0)
    loss.backward()
    assert loss.item() == 0.0 and module.empty_micro_batches == 1
    assert all(
        p.grad is not None and not p.grad.any() for p in fresh.parameters() if p.requires_grad
    )


def test_an_optimizer_step_with_only_empty_micro_batches_is_skipped(fresh):
    before = state(fresh)
    module = TrainingModule(fresh)
    fit(module, [None] * 4, max_steps=1, unfreeze_step=0)
    assert module.skipped_steps == 1
    assert_bit_identical(state(fresh), before)


def test_non_finite_loss_skips_the_optimizer_step_and_counts_it(fresh, monkeypatch):
    module = TrainingModule(fresh)
    real = module.compute_loss
    monkeypatch.setattr(
        module,
        "compute_loss",
        lambda batch: real(batch) * (float("nan") if module.trainer.global_step == 1 else 1.0),
    )
    snap = StateAt(None, [1, 2])
    fit(
        module,
        synthetic_items(8, fresh.tokenizer.vocab_size),
        max_steps=3,
        unfreeze_step=0,
        extra_callbacks=[snap],
    )
    assert module.nonfinite_losses == 1 and module.skipped_steps == 1
    assert_bit_identical(snap.snapshots[2], snap.snapshots[1])  # step 1 changed nothing
    assert any(
        not torch.equal(v, snap.snapshots[2][k]) for k, v in state(module).items()
    )  # step 2 did


def test_gradients_are_clipped_to_grad_clip_with_the_norm_measured_before_the_step(fresh):
    module = TrainingModule(fresh)
    module._window_utterances = 1
    for p in fresh.parameters():
        p.grad = torch.ones_like(p)
    optimizer = module.configure_optimizers()["optimizer"]
    module.on_before_optimizer_step(optimizer)
    measured = module.last_grad_norm
    assert measured == pytest.approx(
        math.sqrt(sum(p.numel() for p in fresh.parameters())), rel=1e-5
    )
    module.configure_gradient_clipping(
        optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm"
    )
    clipped = torch.nn.utils.get_total_norm([p.grad for p in fresh.parameters()])
    assert float(clipped) == pytest.approx(0.5, rel=1e-4)


def test_a_skipped_step_restores_batchnorm_statistics_and_leaves_other_buffers_alone(fresh):
    module = TrainingModule(fresh)
    module.on_train_batch_start(None, 0)
    names = [name for name, _ in module.batchnorm_buffers()]
    assert names and all(".running_" in n or n.endswith("num_batches_tracked") for n in names)
    assert set(module._window_buffers) == set(names)
    norm = next(m for m in fresh.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    before = norm.running_mean.clone()
    norm.running_mean.add_(float("nan"))
    module._window_bad = 1  # a non-finite loss in this window: the step is skipped
    module.on_before_optimizer_step(module.configure_optimizers()["optimizer"])
    assert module.skipped_steps == 1 and torch.equal(norm.running_mean, before)


def test_optimizer_steps_with_no_utterance_stop_the_run_after_max_empty_steps(fresh, monkeypatch):
    import config
    from training_step import NoTrainingData

    monkeypatch.setattr(config, "MAX_EMPTY_STEPS", 3)
    module = TrainingModule(fresh)
    with pytest.raises(NoTrainingData, match=r"3 optimizer steps in a row had no utterance"):
        fit(module, [None] * 20, max_steps=10, unfreeze_step=0)
    assert module.skipped_steps == 2  # the third empty step raised before it was counted


def test_harmless_nemo_messages_are_dropped_by_their_text_and_the_rest_kept():
    import logging
    import warnings

    import asr_model

    asr_model.quiet_harmless_messages()  # idempotent: a second call adds no second filter
    nemo = logging.getLogger("nemo_logger")

    def passes(message: str) -> bool:
        record = logging.LogRecord("nemo_logger", logging.WARNING, __file__, 1, message, None, None)
        return bool(nemo.filter(record))

    assert not passes(
        "Could not load dataset as `manifest_filepath` was None. Provided config : {}"
    )
    assert not passes("Using RNNT Loss : tdt")
    assert passes("Could not load the tokenizer from /data/tok")  # a real problem stays
    for harmless in (
        "If you intend to do validation, please call the ModelPT.setup_validation_data() or ...",
        "You tried to register an artifact under config key=tokenizer.model_path but an artifact",
    ):
        assert not passes(harmless)
    with warnings.catch_warnings(record=True) as caught:
        torch.nn.LSTM(4, 4, num_layers=1, dropout=0.2)
    assert not [w for w in caught if "dropout option" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("a warning nobody silenced", UserWarning)
    assert caught


def one_logger_records_in_the_run_log(records: list[tuple[str, int, str]]) -> list[str]:
    """The messages of ``records`` (module logger, level, message), logged the way nv_one_logger's
    modules log them once OneLogger is set up (a level of their own on each module's logger), that
    reach a handler on the root logger, as train.py's logging.basicConfig puts there."""
    import asr_model

    asr_model.quiet_harmless_messages()
    seen = []
    run_log = logging.Handler()
    run_log.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger().addHandler(run_log)
    try:
        for name, level, message in records:
            module_logger = logging.getLogger(name)
            module_logger.setLevel(logging.INFO)
            module_logger.log(level, message)
    finally:
        logging.getLogger().removeHandler(run_log)
    return seen


def test_one_logger_notes_reach_no_log_even_from_a_module_logger_with_its_own_level():
    notes = [
        (
            "nv_one_logger.core.internal.safe_execution",
            logging.WARNING,
            "Skipping execution of on_app_start because OneLogger is not enabled.",
        ),
        (
            "nv_one_logger.api.config",
            logging.WARNING,
            "OneLogger: Setting error_handling_strategy to DISABLE_QUIETLY_AND_REPORT_METRIC_ERROR "
            "for rank (rank=0) with OneLogger disabled. To override: explicitly set "
            "error_handling_strategy parameter.",
        ),
        (
            "nv_one_logger.training_telemetry.api.training_telemetry_provider",
            logging.WARNING,
            "No exporters were provided. This means that no telemetry data will be collected.",
        ),
        (
            "nv_one_logger.exporter.export_config_manager",
            logging.INFO,
            "Final configuration contains 0 exporter(s)",
        ),
    ]
    assert one_logger_records_in_the_run_log(notes) == []


def test_a_genuine_one_logger_warning_reaches_the_run_log_once():
    genuine = "Failed to load config file /etc/one_logger.yaml: expected a dict"
    seen = one_logger_records_in_the_run_log(
        [("nv_one_logger.exporter.export_config_manager", logging.WARNING, genuine)]
    )
    assert seen == [genuine]


def test_nemos_vocabulary_dump_becomes_its_count_and_first_pieces():
    import asr_model

    pieces = ["<unk>", "<|en|>"] + [f"p{i}" for i in range(300)]
    record = logging.LogRecord(
        "nemo_logger",
        logging.INFO,
        __file__,
        1,
        f"Changed decoder to output to {pieces} vocabulary.",
        None,
        None,
    )
    assert asr_model._SummarizeVocabulary().filter(record)
    assert record.getMessage() == (
        "Changed decoder to output to 302 pieces ('<unk>', '<|en|>', 'p0', 'p1', 'p2', 'p3', 'p4', 'p5', ...)"
    )
