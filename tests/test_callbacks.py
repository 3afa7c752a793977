"""callbacks.py and what its callbacks use: WER/CER (evaluation.py), the metrics file and callback
(run_logging.py, training_metrics.py), the progress bar, atomic step checkpoints (checkpoints.py), epoch
sync, exact resume and the W&B offline run.

Lightning runs here are single-process fits of a tiny module over the real DurationBucketBatchSampler
and collate_asr_batch (synthetic signals, no audio files, no NeMo; DataLoader workers where prefetching
matters); a fit takes well under a second.
The kill-and-resume test of train.py under torchrun is tests/test_resume.py.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import callbacks
import checkpoints
import config
import dataset as dataset_module
import evaluation
import manifest_schema
import model_card
import run_logging
import training_metrics
from dataset import collate_asr_batch
from sampler import BatchingSettings, DurationBucketBatchSampler

# ---------------------------------------------------------------------------------------------------
# WER / CER
# ---------------------------------------------------------------------------------------------------


def test_strip_lang_tag_removes_every_tag_and_collapses_whitespace():
    assert manifest_schema.strip_lang_tag("<|hi|>  नमस्ते   दुनिया ") == "नमस्ते दुनिया"
    assert manifest_schema.strip_lang_tag("hello <|en|> world") == "hello world"
    assert manifest_schema.strip_lang_tag("a <b> c|") == "a <b> c|"


def test_language_tag_is_stripped_from_reference_and_hypothesis():
    counts = evaluation.corpus_error_rates(["<|en|> hello world"], ["hello world"], ["en"])
    assert counts["en"].wer == 0.0 and counts["en"].cer == 0.0
    counts = evaluation.corpus_error_rates(["hello world"], ["<|en|> hello world"], ["en"])
    assert counts["en"].word_edits == 0 and counts["en"].words == 2


def test_corpus_wer_is_total_edits_over_total_words_not_a_mean_of_utterance_wers():
    refs = ["<|en|> yes", "<|en|> one two three four five six seven eight nine"]
    hyps = ["no", "one two three four five six seven eight nine"]
    counts = evaluation.corpus_error_rates(refs, hyps, ["en", "en"])["en"]
    assert counts.word_edits == 1 and counts.words == 10
    assert counts.wer == pytest.approx(
        0.1
    )  # the mean of utterance WERs would be (1.0 + 0.0) / 2 = 0.5


def test_cer_counts_characters_including_the_spaces_between_words():
    counts = evaluation.corpus_error_rates(["ab cd"], ["ab cx"], ["en"])["en"]
    assert (counts.char_edits, counts.chars) == (1, 5)
    assert counts.cer == pytest.approx(0.2)


def test_word_edits_split_into_substitutions_deletions_and_insertions_per_language():
    refs = ["a b c d", "x y", "p q"]
    hyps = ["a z c", "x y extra more", "p q"]  # 1 sub + 1 del; 2 ins; none
    counts = evaluation.corpus_error_rates(refs, hyps, ["hi", "en", "en"])
    hi, en = counts["hi"], counts["en"]
    assert (hi.substitutions, hi.deletions, hi.insertions) == (1, 1, 0)
    assert (en.substitutions, en.deletions, en.insertions) == (0, 0, 2)
    assert hi.rate(hi.substitutions) + hi.rate(hi.deletions) == pytest.approx(hi.wer)
    metrics = training_metrics.evaluation_metrics(counts, 3, 1.0)
    assert metrics["val/wer_ins/en"] == pytest.approx(0.5) == metrics["val/wer/en"]
    assert metrics["val/wer_del/all"] == pytest.approx(1 / 8)


def test_rates_are_per_language_plus_an_all_row_pooling_every_utterance():
    counts = evaluation.corpus_error_rates(["a b", "x y z w"], ["a c", "x y z w"], ["hi", "en"])
    assert list(counts) == ["en", "hi", "all"]
    assert counts["hi"].wer == 0.5 and counts["en"].wer == 0.0
    assert counts["all"].wer == pytest.approx(1 / 6) and counts["all"].utterances == 2


def test_a_language_without_reference_words_has_an_undefined_rate_not_an_error():
    counts = evaluation.corpus_error_rates(["<|en|>"], ["something"], ["en"])["en"]
    assert counts.words == 0 and math.isnan(counts.wer)


def test_mismatched_lengths_are_refused_with_the_counts():
    with pytest.raises(ValueError, match="2 references, 1 hypotheses"):
        evaluation.corpus_error_rates(["a", "b"], ["a"], ["en", "en"])


words = st.lists(st.sampled_from(["a", "b", "c", "dd"]), min_size=1, max_size=6).map(" ".join)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(words, words), min_size=1, max_size=8))
def test_corpus_wer_is_the_word_weighted_mean_of_utterance_wers(pairs):
    refs, hyps = [r for r, _ in pairs], [h for _, h in pairs]
    corpus = evaluation.corpus_error_rates(refs, hyps, ["en"] * len(pairs))["en"].wer
    single = [evaluation.corpus_error_rates([r], [h], ["en"])["en"] for r, h in pairs]
    weighted = sum(c.wer * c.words for c in single) / sum(c.words for c in single)
    assert corpus == pytest.approx(weighted)


# ---------------------------------------------------------------------------------------------------
# JSONL metrics file and progress text
# ---------------------------------------------------------------------------------------------------


def test_jsonl_logger_appends_one_json_line_per_call_with_the_step_and_nan_as_null(tmp_path):
    logger = run_logging.JsonlMetricsLogger(tmp_path / "run" / "metrics.jsonl")
    logger.log_metrics({"train/loss": 1.5, "train/lr": float("nan")}, step=1)
    logger.log_metrics({"train/loss": torch.tensor(0.5)}, step=2)
    logger.log_table("val/examples", ["lang", "reference"], [["en", "hi"]], step=2)
    lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [l["step"] for l in lines] == [1, 2, 2]
    assert (
        lines[0]["train/loss"] == 1.5
        and lines[0]["train/lr"] is None
        and lines[1]["train/loss"] == 0.5
    )
    assert lines[2]["table"] == "val/examples" and lines[2]["rows"] == [["en", "hi"]]


def test_progress_postfix_shows_micro_batches_loss_lr_and_phase():
    text = callbacks.progress_postfix(49, 0, 48, 5000, 1.23456, 3e-4, 1)
    assert text == "micro-batch 49 (epoch 0: 48/5000) | loss 1.2346 | lr 3.00e-04 | phase 1"
    assert (
        callbacks.progress_postfix(1, 2, 1, None, None, float("nan"), None)
        == "micro-batch 1 (epoch 2: 1) | loss - | lr - | phase -"
    )


# ---------------------------------------------------------------------------------------------------
# A tiny training setup over the real sampler and collate
# ---------------------------------------------------------------------------------------------------

N_UTTS, SAMPLE_RATE = 16, 100
GRAD_ACCUM = 2


class SignalDataset(torch.utils.data.Dataset):
    """Items shaped like LocalShardDataset's; durations are distinct so a batch is identified by them."""

    def __init__(self, n: int = N_UTTS, bad: frozenset = frozenset()):
        rng = np.random.default_rng(0)
        self.durations = np.round(rng.uniform(1.0, 3.0, n), 3) + np.arange(n) * 1e-4
        self.languages = np.array(["hi", "en", "ta", "hi"] * (n // 4))[:n]
        self.bad = bad

    def __len__(self):
        return len(self.durations)

    def __getitem__(self, i):
        if i in self.bad:
            dataset_module._record_bad_audio("unreadable", "src/xx/shard", f"{i}.flac", "test")
            return None
        g = torch.Generator().manual_seed(int(i))
        n = int(self.durations[i] * SAMPLE_RATE)
        return {
            "signal": torch.randn(n, generator=g),
            "tokens": torch.tensor([1, 2, 3]),
            "duration": float(self.durations[i]),
            "lang": str(self.languages[i]),
            "index": int(i),
        }


class TinyModule(pl.LightningModule):
    """The attributes train.py's TrainingModule exposes to callbacks, on a 2-layer net with dropout."""

    def __init__(self, dataset: SignalDataset | None = None, num_workers: int = 0):
        super().__init__()
        self.num_workers = num_workers
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
        )
        self.dataset = dataset or SignalDataset()
        self.sampler = None
        self.resume_sampler_state = None
        self.seen: list[tuple] = []
        self.last_loss = None
        self.last_grad_norm = None
        self.phase = 1
        self.skipped_steps = self.empty_micro_batches = self.nonfinite_losses = 0

    SETTINGS = dict(
        boundaries=(2.0,),
        max_batch_duration=6.0,
        temperature=0.5,
        grad_accum=GRAD_ACCUM,
        seed=1,
        epoch_size=0,
        lang_weighting="count",
        cost_quadratic=0.0,
    )

    def train_dataloader(self):
        settings = BatchingSettings.from_config(**self.SETTINGS)
        self.sampler = DurationBucketBatchSampler(
            self.dataset.durations, self.dataset.languages, settings, world_size=1, rank=0
        )
        if self.resume_sampler_state is not None:  # as train.py does
            self.sampler.load_state_dict(self.resume_sampler_state)
            self.resume_sampler_state = None
        return torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            collate_fn=collate_asr_batch,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def training_step(self, batch, batch_idx):
        self.seen.append((self.trainer.current_epoch, tuple(round(d, 4) for d in batch.durations)))
        if batch.is_empty:
            loss = sum(p.sum() for p in self.parameters()) * 0.0
        else:
            s = batch.signal
            feats = torch.stack(
                [s.mean(1), s.std(1), s.abs().amax(1), batch.signal_len / 300.0], dim=1
            )
            loss = self.net(feats).pow(2).mean()
        self.last_loss = loss.detach()
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.last_grad_norm = float(
            torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])
        )

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1e-2 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(
    tmp_path: Path,
    max_steps: int,
    extra: list | None = None,
    module: TinyModule | None = None,
    ckpt_path: str | None = None,
    every: int = 3,
    loggers=None,
    progress: bool = False,
    seed: int = 5,
):
    module = module or TinyModule()
    cbs = [
        callbacks.EpochBoundarySyncCallback(),
        callbacks.ExactResumeCallback(),
        callbacks.StepOnlyModelCheckpoint(
            tmp_path / "ckpt", every_n_steps=every, export_nemo_at_end=False
        ),
        *(extra or []),
    ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=-1,
        accumulate_grad_batches=GRAD_ACCUM,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=cbs,
        logger=loggers or False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    pl.seed_everything(seed)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def weights(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------------------------------
# Atomic step checkpoints
# ---------------------------------------------------------------------------------------------------


def test_crash_mid_save_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    def torch_save_that_dies(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torch_save_that_dies)
    with pytest.raises(checkpoints.CheckpointError, match="disk full"):
        checkpoints.AtomicCheckpointIO().save_checkpoint(
            {"state_dict": {}}, tmp_path / "step_00000003.ckpt"
        )
    assert list(tmp_path.iterdir()) == []  # neither the final name nor a temporary file


def test_atomic_checkpoint_io_writes_a_loadable_file_and_no_temporary(tmp_path):
    checkpoints.AtomicCheckpointIO().save_checkpoint(
        {"global_step": 7}, tmp_path / "step_00000007.ckpt"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000007.ckpt"]
    umask = os.umask(0)
    os.umask(umask)
    assert (
        tmp_path / "step_00000007.ckpt"
    ).stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    assert torch.load(tmp_path / "step_00000007.ckpt")["global_step"] == 7


def test_step_checkpoints_come_every_n_optimizer_steps_only_named_with_the_step(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".step_00000009.ckpt.k3j2.tmp").write_bytes(b"left by a crash mid-save")
    trainer, module = fit(tmp_path, max_steps=7, every=3)
    assert trainer.current_epoch >= 1, "the run should cross an epoch boundary (no epoch-end save)"
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_00000003.ckpt", "step_00000006.ckpt"]
    for step in (3, 6):
        assert (
            torch.load(tmp_path / "ckpt" / f"step_{step:08d}.ckpt", weights_only=False)[
                "global_step"
            ]
            == step
        )
    assert isinstance(trainer.strategy.checkpoint_io, checkpoints.AtomicCheckpointIO)


def test_find_last_checkpoint_takes_the_highest_step_and_ignores_temporary_files(tmp_path):
    for name in (
        "step_00000003.ckpt",
        "step_00000012.ckpt",
        ".step_00000015.ckpt.x1y2.tmp",
        "step_00000009.nemo",
    ):
        torch.save({"global_step": 0}, tmp_path / name)
    assert checkpoints.find_last_checkpoint(tmp_path).name == "step_00000012.ckpt"
    assert checkpoints.resolve_resume_from("last", tmp_path) == str(tmp_path / "step_00000012.ckpt")


def test_resume_from_last_without_any_checkpoint_starts_fresh_and_a_missing_path_fails(tmp_path):
    assert checkpoints.resolve_resume_from("last", tmp_path / "none") is None
    assert checkpoints.resolve_resume_from("", tmp_path) is None
    with pytest.raises(FileNotFoundError, match="RESUME_FROM=.*nope.ckpt"):
        checkpoints.resolve_resume_from(str(tmp_path / "nope.ckpt"), tmp_path)


def test_nemo_export_is_atomic_and_comes_with_its_model_card(tmp_path):
    from types import SimpleNamespace

    class Model(torch.nn.Module):
        def __init__(self, fail):
            super().__init__()
            self.fail = fail
            self.layer = torch.nn.Linear(2, 2)
            self.tokenizer = SimpleNamespace(vocab_size=10)

        def save_to(self, path):
            Path(path).write_bytes(b"partial")
            if self.fail:
                raise RuntimeError("killed")

    with pytest.raises(OSError, match="killed") as failed:
        model_card.export_nemo(Model(fail=True), tmp_path / "step_00000010.nemo")
    assert failed.value.filename == str(tmp_path / "step_00000010.nemo")
    assert list(tmp_path.iterdir()) == []
    model_card.export_nemo(Model(fail=False), tmp_path / "step_00000010.nemo", {"step": 10})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000010.model-card.md",
        "step_00000010.nemo",
    ]
    assert (
        "trained for 10 optimizer steps" in (tmp_path / "step_00000010.model-card.md").read_text()
    )


# ---------------------------------------------------------------------------------------------------
# Epoch boundaries and exact resume
# ---------------------------------------------------------------------------------------------------


def test_epoch_sync_sets_the_epoch_on_the_batch_sampler_then_waits_at_a_barrier(
    tmp_path, monkeypatch
):
    calls = []
    set_epoch = DurationBucketBatchSampler.set_epoch
    monkeypatch.setattr(
        DurationBucketBatchSampler,
        "set_epoch",
        lambda self, e: (calls.append(("set_epoch", e)), set_epoch(self, e))[1],
    )

    class Spy(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            barrier = trainer.strategy.barrier
            trainer.strategy.barrier = lambda name=None: (
                calls.append(("barrier", name)),
                barrier(name),
            )[1]

    trainer, module = fit(tmp_path, max_steps=7, extra=[Spy()])
    epochs = module.seen[-1][0] + 1
    assert epochs >= 3
    synced = [c for c in calls if c[0] == "set_epoch" or c[1] == "epoch_boundary"]
    assert synced == [
        c for e in range(epochs) for c in (("set_epoch", e), ("barrier", "epoch_boundary"))
    ]
    # every epoch's batches came from that epoch's plan: all distinct within an epoch
    for e in range(epochs):
        batches = [b for ep, b in module.seen if ep == e]
        assert len(batches) == len(set(batches)) > 0


def test_checkpoint_marks_the_saving_micro_batch_completed_and_carries_sampler_position(tmp_path):
    fit(tmp_path, max_steps=3, every=3)
    ckpt = torch.load(tmp_path / "ckpt" / "step_00000003.ckpt", weights_only=False)
    progress = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert progress["completed"] == progress["processed"]
    assert ckpt["sampler_state"]["position"] == progress["processed"]
    assert ckpt["sampler_state"]["position"] % GRAD_ACCUM == 0
    assert len(ckpt["rng_states"]) == 1 and "torch" in ckpt["rng_states"][0]


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers-prefetching"])
def test_resume_continues_at_the_next_micro_batch_and_ends_with_the_straight_runs_weights(
    tmp_path, workers
):
    _, straight = fit(tmp_path / "a", max_steps=8, module=TinyModule(num_workers=workers))
    _, first = fit(
        tmp_path / "b",
        max_steps=8,
        every=5,
        extra=[StopAt(5)],
        module=TinyModule(num_workers=workers),
    )
    assert first.trainer.global_step == 5
    # A resumed process starts with other RNG states (seed 999); the checkpoint's must win (dropout).
    trainer, resumed = fit(
        tmp_path / "b",
        max_steps=8,
        every=5,
        seed=999,
        module=TinyModule(num_workers=workers),
        ckpt_path=str(tmp_path / "b" / "ckpt" / "step_00000005.ckpt"),
    )
    assert trainer.global_step == 8
    assert first.seen + resumed.seen == straight.seen
    for k, v in weights(straight).items():
        torch.testing.assert_close(weights(resumed)[k], v, rtol=0, atol=0)


def test_resume_from_a_checkpoint_taken_at_the_last_micro_batch_of_an_epoch(tmp_path):
    _, straight = fit(tmp_path / "a", max_steps=8)
    boundary = sum(1 for epoch, _ in straight.seen if epoch == 0) // GRAD_ACCUM
    assert 0 < boundary < 8
    fit(tmp_path / "b", max_steps=8, every=boundary, extra=[StopAt(boundary)])
    checkpoint = tmp_path / "b" / "ckpt" / f"step_{boundary:08d}.ckpt"
    state = torch.load(checkpoint, weights_only=False)["sampler_state"]
    assert (
        state["epoch"] == 0 and state["position"] == boundary * GRAD_ACCUM
    )  # the whole epoch consumed
    trainer, resumed = fit(
        tmp_path / "b", max_steps=8, every=100, seed=999, ckpt_path=str(checkpoint)
    )
    assert trainer.global_step == 8
    assert resumed.seen == straight.seen[boundary * GRAD_ACCUM :]
    for k, v in weights(straight).items():
        torch.testing.assert_close(weights(resumed)[k], v, rtol=0, atol=0)


class UnevenEpochsModule(TinyModule):
    """32 utterances played at 0.9, 1.0 or 1.1 speed: the sampler packs each epoch into another
    number of micro-batches, some epochs more than the first and some fewer."""

    SETTINGS = dict(TinyModule.SETTINGS, seed=0, speed_factors=(0.9, 1.0, 1.1))

    def __init__(self, num_workers: int = 0):
        super().__init__(SignalDataset(32), num_workers=num_workers)

    def planned_lengths(self, epochs: int) -> list[int]:
        """Each epoch's micro-batches, from a sampler of its own (the plan is a pure function)."""
        sampler = DurationBucketBatchSampler(
            self.dataset.durations,
            self.dataset.languages,
            BatchingSettings.from_config(**self.SETTINGS),
        )
        lengths = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            lengths.append(len(sampler))
        return lengths


def micro_batches_per_epoch(seen: list[tuple]) -> list[int]:
    epochs = [epoch for epoch, _ in seen]
    return [epochs.count(e) for e in range(epochs[-1] + 1)]


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers-prefetching"])
def test_every_epoch_trains_exactly_the_micro_batches_its_own_plan_holds(tmp_path, workers):
    planned = UnevenEpochsModule().planned_lengths(4)
    first = planned[0]
    assert any(n > first for n in planned[1:]) and any(n < first for n in planned[1:]), planned
    steps = sum(planned) // GRAD_ACCUM
    _, straight = fit(tmp_path / "a", max_steps=steps, module=UnevenEpochsModule(workers))
    assert micro_batches_per_epoch(straight.seen) == planned


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers-prefetching"])
def test_a_run_resumed_at_any_step_trains_what_the_straight_run_trains_with_uneven_epochs(
    tmp_path, workers
):
    planned = UnevenEpochsModule().planned_lengths(4)
    steps = sum(planned) // GRAD_ACCUM
    _, straight = fit(tmp_path / "a", max_steps=steps, module=UnevenEpochsModule(workers))
    boundaries = np.cumsum(planned) // GRAD_ACCUM
    # Mid-epoch in the first, longer and shorter epochs, and at the end of the longer one.
    for stop in (2, int(boundaries[0]) + 3, int(boundaries[1]), int(boundaries[2]) + 2):
        root = tmp_path / f"stop{stop}"
        _, first = fit(
            root,
            max_steps=steps,
            every=stop,
            extra=[StopAt(stop)],
            module=UnevenEpochsModule(workers),
        )
        _, resumed = fit(
            root,
            max_steps=steps,
            every=1000,
            seed=999,
            module=UnevenEpochsModule(workers),
            ckpt_path=str(root / "ckpt" / f"step_{stop:08d}.ckpt"),
        )
        assert first.seen + resumed.seen == straight.seen, f"resumed at step {stop}"
        for k, v in weights(straight).items():
            torch.testing.assert_close(weights(resumed)[k], v, rtol=0, atol=0)


class StopAt(pl.Callback):
    """Ends the fit right after optimizer step ``step`` (a crash, as far as the loop knows)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = (
                True  # no further micro-batch: what a crash right after the save leaves
            )


def test_without_the_restored_sampler_state_the_resumed_data_would_differ(tmp_path):
    # The control for the test above: Lightning alone replays the epoch from its first batch.
    _, straight = fit(tmp_path / "a", max_steps=8)
    fit(tmp_path / "b", max_steps=8, every=5, extra=[StopAt(5)])

    class ForgetfulModule(TinyModule):
        def train_dataloader(self):
            self.resume_sampler_state = None
            return super().train_dataloader()

    module = ForgetfulModule()
    fit(
        tmp_path / "b",
        max_steps=8,
        every=5,
        module=module,
        ckpt_path=str(tmp_path / "b" / "ckpt" / "step_00000005.ckpt"),
    )
    assert module.seen != straight.seen[len(straight.seen) - len(module.seen) :]


# ---------------------------------------------------------------------------------------------------
# TrainingMetricsCallback, progress bar, W&B
# ---------------------------------------------------------------------------------------------------

STEP_KEYS = {
    "train/loss",
    "train/lr",
    "train/phase",
    "train/grad_norm",
    "train/epoch",
    "train/micro_batch",
    "train/skipped_steps",
    "train/empty_micro_batches",
    "train/nonfinite_losses",
    "time/step_s",
    "time/checkpoint_s",
    "time/data_wait_fraction",
    "time/data_wait_fraction_max",
    "throughput/audio_s_per_step",
    "throughput/audio_s_per_s",
    "throughput/utterances_per_step",
    "throughput/utterances_per_s",
    "data/padding_efficiency",
    "data/bad_audio_total",
    "lang_share/hi",
    "lang_target/hi",
    "lang_share/en",
    "lang_share/ta",
}


class BatchRecorder(pl.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((trainer.global_step, batch))


def test_metrics_are_logged_once_per_optimizer_step_with_every_key(tmp_path):
    metrics = callbacks.TrainingMetricsCallback()
    logger = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    fit(tmp_path, max_steps=5, extra=[metrics], loggers=[logger])
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 4, 5]
    for line in lines:
        assert STEP_KEYS <= line.keys(), STEP_KEYS - line.keys()
        assert 0 <= line["time/data_wait_fraction"] <= 1 and line["time/step_s"] > 0
        assert sum(line[f"lang_share/{l}"] for l in ("hi", "en", "ta")) == pytest.approx(1.0)
    assert lines[0]["train/lr"] == pytest.approx(1e-2)  # the LR step 0 used, not the next one
    assert "gpu/peak_memory_gib" not in lines[0]  # CUDA only
    settings = json.loads(
        (tmp_path / "hparams.json").read_text()
    )  # the run's config, beside the metrics
    assert (
        settings["world_size"] == 1
        and settings["resumed_at_step"] == 0
        and "CHECKPOINT_EVERY" in settings
    )
    # numbers are logged as numbers, so runs can be filtered and plotted by them
    assert settings["CHECKPOINT_EVERY"] == config.CHECKPOINT_EVERY
    assert isinstance(settings["PHASE2_LR"], float) and isinstance(settings["SEED"], int)
    assert isinstance(settings["LANGUAGES"], list) and isinstance(settings["TOKENIZER_DIR"], str)


def test_checkpoint_time_is_reported_apart_from_data_wait_in_the_following_step(tmp_path):
    logger = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    fit(
        tmp_path,
        max_steps=5,
        every=3,
        extra=[callbacks.TrainingMetricsCallback()],
        loggers=[logger],
    )
    lines = {
        l["step"]: l for l in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    }
    assert (
        lines[4]["time/checkpoint_s"] > 0
    )  # the save after step 3 happened during step 4's window
    assert all(lines[s]["time/checkpoint_s"] == 0 for s in (1, 2, 3, 5))


def test_a_non_finite_loss_is_counted_but_not_averaged_into_the_loss(tmp_path):
    class NanOnce(TinyModule):
        def __init__(self):
            super().__init__()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if len(self.seen) == 3:  # the first micro-batch of optimizer step 1: non-finite
                self.nonfinite_losses += 1
                self.last_loss = torch.tensor(math.nan)
                loss = loss * 0.0  # its step would be skipped; only the metrics matter here
            self.losses.append(float(self.last_loss))
            return loss

    module = NanOnce()
    logger = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    fit(
        tmp_path,
        max_steps=2,
        module=module,
        extra=[callbacks.TrainingMetricsCallback()],
        loggers=[logger],
    )
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["train/loss"] == pytest.approx(sum(module.losses[:2]) / 2)
    assert lines[1]["train/loss"] == pytest.approx(module.losses[3])
    assert lines[1]["train/nonfinite_losses"] == 1


def test_fault_counters_are_summed_over_ranks_and_survive_a_resume(tmp_path):
    class NanOnce(TinyModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if len(self.seen) == 3:
                self.nonfinite_losses += 1
                self.last_loss = loss = loss * 0.0
            return loss

    logger = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    fit(
        tmp_path,
        max_steps=8,
        every=5,
        module=NanOnce(),
        loggers=[logger],
        extra=[callbacks.TrainingMetricsCallback(), StopAt(5)],
    )
    fit(
        tmp_path,
        max_steps=8,
        every=5,
        loggers=[logger],
        extra=[callbacks.TrainingMetricsCallback()],
        ckpt_path=str(tmp_path / "ckpt" / "step_00000005.ckpt"),
    )  # a fresh module: its counter is 0
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, 9))
    assert [l["train/nonfinite_losses"] for l in lines] == [0, 1, 1, 1, 1, 1, 1, 1]


def test_audio_seconds_utterances_and_padding_are_those_of_the_steps_micro_batches(tmp_path):
    metrics, recorder = callbacks.TrainingMetricsCallback(), BatchRecorder()
    logger = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    fit(tmp_path, max_steps=2, extra=[recorder, metrics], loggers=[logger])
    first = [b for step, b in recorder.batches[:GRAD_ACCUM]]
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["throughput/audio_s_per_step"] == pytest.approx(
        sum(sum(b.durations) for b in first)
    )
    assert line["throughput/utterances_per_step"] == sum(b.batch_size for b in first)
    real = sum(int(b.signal_len.sum()) for b in first)
    padded = sum(b.signal.numel() for b in first)
    assert line["data/padding_efficiency"] == pytest.approx(real / padded)


def test_bad_audio_counts_accumulate_across_steps(tmp_path):
    module = TinyModule(SignalDataset(bad=frozenset(range(0, N_UTTS, 5))))
    logger = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    fit(
        tmp_path,
        max_steps=4,
        module=module,
        extra=[callbacks.TrainingMetricsCallback()],
        loggers=[logger],
    )
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    totals = [l["data/bad_audio_total"] for l in lines]
    assert totals == sorted(totals) and totals[-1] > 0
    assert (
        lines[-1]["data/bad_audio/unreadable"] == totals[-1]
        and lines[-1]["data/bad_audio/missing"] == 0
    )


class ScriptedLosses(TinyModule):
    """Every micro-batch of optimizer step s reports the training loss ``train(s)``."""

    def __init__(self, train):
        super().__init__()
        self.train_loss = train

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = torch.tensor(float(self.train_loss(self.trainer.global_step + 1)))
        return loss


class ScriptedValidation(pl.Callback):
    """A validation every ``every`` steps, as PerLanguageWERCallback leaves it in
    ``last_evaluation`` (before TrainingMetricsCallback in the list, as train.py orders them)."""

    def __init__(self, every, val_loss):
        self.every, self.val_loss = every, val_loss

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if (
            step % self.every == 0
            and (pl_module.__dict__.get("last_evaluation") or {}).get("step") != step
        ):
            pl_module.last_evaluation = {"step": step, "loss": self.val_loss(step)}

    def on_train_end(self, trainer, pl_module):
        # the run's last step, validated once more when it is no multiple of ``every``
        if trainer.global_step % self.every:
            pl_module.last_evaluation = {
                "step": trainer.global_step,
                "loss": self.val_loss(trainer.global_step),
            }


def overfitting_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "overfitting" in r.getMessage()
    ]


def test_overfitting_is_warned_once_with_the_numbers_and_what_to_do(tmp_path, caplog):
    """Validations every 2 steps; the validation loss rises at each from step 4 on (1.0 at step 2,
    then 1.2, 1.3, 1.4, ...) while the training loss falls as 1/s: the third rise is step 8's."""
    module = ScriptedLosses(lambda s: 1.0 / s)
    val = ScriptedValidation(2, lambda s: 1.0 if s <= 2 else 1.0 + 0.05 * s)
    with caplog.at_level("WARNING", logger="callbacks"):
        fit(tmp_path, max_steps=14, module=module,
            extra=[val, callbacks.TrainingMetricsCallback()])  # fmt: skip
    warned = overfitting_warnings(caplog)
    assert len(warned) == 1, warned  # the rises at steps 10, 12 and 14 are not warned again
    line = warned[0]
    assert line.startswith("step 8: overfitting") and "\n" not in line
    assert "last 3 validations (1.0000 at step 2 -> 1.4000)" in line
    # the training loss's means between validations: steps 3-4 (1/3, 1/4) and steps 7-8
    assert (
        f"{(1 / 3 + 1 / 4) / 2:.4f} up to step 4 -> {(1 / 7 + 1 / 8) / 2:.4f} up to step 8" in line
    )
    for remedy in ("KEEP_BEST_CHECKPOINTS", "MAX_STEPS", "data", "augmentation"):
        assert remedy in line


def test_the_validation_at_the_end_of_a_run_is_judged_too(tmp_path, caplog):
    """Validations at steps 2, 4, 6 and at the end, 7: the third rise is the last validation's."""
    module = ScriptedLosses(lambda s: 1.0 / s)
    val = ScriptedValidation(2, lambda s: 1.0 if s <= 2 else 1.0 + 0.05 * s)
    with caplog.at_level("WARNING", logger="callbacks"):
        fit(tmp_path, max_steps=7, module=module,
            extra=[val, callbacks.TrainingMetricsCallback()])  # fmt: skip
    assert [w.split(":")[0] for w in overfitting_warnings(caplog)] == ["step 7"]


def test_a_validation_loss_that_falls_with_the_training_loss_is_not_warned(tmp_path, caplog):
    module = ScriptedLosses(lambda s: 1.0 / s)
    val = ScriptedValidation(2, lambda s: 2.0 / (s + 1))
    with caplog.at_level("WARNING", logger="callbacks"):
        fit(tmp_path, max_steps=14, module=module,
            extra=[val, callbacks.TrainingMetricsCallback()])  # fmt: skip
    assert overfitting_warnings(caplog) == []


def test_overfitting_is_judged_across_a_resume_and_warned_once_a_run(tmp_path, caplog):
    """The job that saved step 6 saw the validations of steps 2, 4, 6; the resumed one adds 8 (the
    third rise: the warning) and, resumed again after step 9, does not warn again."""

    def job(max_steps, stop, ckpt=None):
        module = ScriptedLosses(lambda s: 1.0 / s)
        val = ScriptedValidation(2, lambda s: 1.0 if s <= 2 else 1.0 + 0.05 * s)
        fit(tmp_path, max_steps=max_steps, module=module, every=3, ckpt_path=ckpt,
            extra=[val, callbacks.TrainingMetricsCallback(), StopAt(stop)])  # fmt: skip

    with caplog.at_level("WARNING", logger="callbacks"):
        job(14, 6)
        assert overfitting_warnings(caplog) == []
        job(14, 9, str(tmp_path / "ckpt" / "step_00000006.ckpt"))
        assert [w.split(":")[0] for w in overfitting_warnings(caplog)] == ["step 8"]
        job(14, 14, str(tmp_path / "ckpt" / "step_00000009.ckpt"))
    assert len(overfitting_warnings(caplog)) == 1


def test_progress_bar_counts_optimizer_steps_of_max_steps_then_micro_batches(tmp_path, capsys):
    bar = callbacks.OptimizerStepProgressBar(refresh_rate=1, plain=False)
    fit(tmp_path, max_steps=4, extra=[callbacks.TrainingMetricsCallback(), bar], progress=True)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (4, 4)
    out = capsys.readouterr().out
    assert "step: 100%" in out and "4/4" in out
    assert f"micro-batch {4 * GRAD_ACCUM} (epoch" in out and "| lr 2.50e-03 | phase 1" in out


def test_without_a_terminal_progress_is_plain_log_lines(tmp_path, capsys, caplog):
    bar = callbacks.OptimizerStepProgressBar(refresh_rate=2, plain=True)
    with caplog.at_level("INFO", logger="callbacks"):
        fit(tmp_path, max_steps=4, extra=[callbacks.TrainingMetricsCallback(), bar], progress=True)
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err and "\x1b" not in out.out + out.err
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[-1].startswith("step 4/4 (100%) | micro-batch"), lines
    assert "steps/s, ETA 0:00:00" in lines[-1], lines


def test_the_rate_counts_only_the_steps_this_process_trained(monkeypatch):
    bar = callbacks.OptimizerStepProgressBar(plain=True)
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: next(clock))
    bar._start_step, bar._start_time = 5000, 100.0  # what on_train_start records on a resume
    assert bar.rate_line(5000, 6000) == ""
    assert bar.rate_line(5005, 6000) == "0.5 steps/s, ETA 0:33:10"


def test_a_resumed_job_continues_the_run_it_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "CHECKPOINT_DIR", tmp_path / "ckpt")
    monkeypatch.setattr(config, "WANDB_RUN_NAME", "")
    name, run_id = checkpoints.run_identity(resuming=False)
    assert json.loads((tmp_path / "ckpt" / "run.json").read_text()) == {
        "name": name,
        "wandb_id": run_id,
    }
    assert checkpoints.run_identity(resuming=True) == (name, run_id)
    assert checkpoints.run_identity(resuming=False)[1] != run_id, (
        "a fresh job must not append to the old run"
    )


def test_a_new_run_name_on_resume_starts_a_new_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "CHECKPOINT_DIR", tmp_path / "ckpt")
    monkeypatch.setattr(config, "WANDB_RUN_NAME", "first")
    _, first_id = checkpoints.run_identity(resuming=False)
    monkeypatch.setattr(config, "WANDB_RUN_NAME", "second")
    name, second_id = checkpoints.run_identity(resuming=True)
    assert name == "second" and second_id != first_id


def test_wandb_offline_run_directory_holds_the_logged_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in (
        ("WANDB_MODE", ""),
        ("WANDB_PROJECT", "test"),
        ("WANDB_RUN_NAME", "offline-test"),
        ("WANDB_LOG_DIR", tmp_path / "wandb_logs"),
        ("CHECKPOINT_DIR", tmp_path / "ckpt"),
    ):
        monkeypatch.setattr(config, name, value)
    assert config.wandb_mode() == "offline"
    loggers = run_logging.build_loggers()
    fit(tmp_path, max_steps=3, extra=[callbacks.TrainingMetricsCallback()], loggers=loggers)
    import wandb

    wandb.finish()
    run_dir = tmp_path / "wandb_logs" / "offline-test"
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(run_dir.rglob("*"))
    # wandb-core writes the file asynchronously; finish() can return before the last records land.
    deadline = time.monotonic() + 30
    while True:
        try:
            records = list(read_wandb_records(files[0]))
        except Exception:  # a record still being written
            records = []
        if (
            any(r.WhichOneof("record_type") == "exit" for r in records)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    keys = {
        item.key or "/".join(item.nested_key)
        for r in records
        if r.WhichOneof("record_type") == "history"
        for item in r.history.item
    }
    assert STEP_KEYS <= keys, STEP_KEYS - keys
    jsonl = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in jsonl] == [1, 2, 3] and STEP_KEYS <= jsonl[0].keys()


def test_without_the_wandb_package_a_run_logs_to_metrics_jsonl_after_one_warning(
    tmp_path, monkeypatch, caplog
):
    for name, value in (
        ("WANDB_MODE", "offline"),
        ("WANDB_RUN_NAME", "no-wandb"),
        ("WANDB_LOG_DIR", tmp_path / "wandb_logs"),
        ("CHECKPOINT_DIR", tmp_path / "ckpt"),
    ):
        monkeypatch.setattr(config, name, value)
    monkeypatch.setattr(run_logging, "wandb_installed", lambda: False)
    with caplog.at_level("WARNING", logger="run_logging"):
        loggers = run_logging.build_loggers()
    assert [type(l).__name__ for l in loggers] == ["JsonlMetricsLogger"]
    warned = [
        r.getMessage() for r in caplog.records if "wandb package is not installed" in r.getMessage()
    ]
    assert (
        len(warned) == 1
        and "metrics.jsonl only" in warned[0]
        and "WANDB_MODE=disabled" in warned[0]
    )
    fit(tmp_path, max_steps=3, extra=[callbacks.TrainingMetricsCallback()], loggers=loggers)
    run_dir = tmp_path / "wandb_logs" / "no-wandb"
    jsonl = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in jsonl] == [1, 2, 3] and STEP_KEYS <= jsonl[0].keys()
    assert not (run_dir / "wandb").exists()


def read_wandb_records(path: Path):
    """The protobuf records of a .wandb file (W&B's leveldb-style log: 32 KiB blocks, 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        parts = payload if kind in (1, 2) else parts + payload
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


class ConfigScheduleModule(TinyModule):
    """TinyModule on train.py's LR schedule (config.py's knobs), recording each optimizer step's LR."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lrs: list[float] = []

    def configure_optimizers(self):
        from training_step import lr_schedule_from_config

        opt = torch.optim.AdamW(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule_from_config())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self):
        from training_step import apply_current_lr_schedule

        apply_current_lr_schedule(self.trainer)

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_every_step_after_a_resume_follows_the_current_schedule_even_the_first(
    tmp_path, monkeypatch
):
    from training_step import lr_schedule_from_config

    for name, value in dict(
        WARMUP_STEPS=1, PHASE1_LR=1e-3, UNFREEZE_STEP=2, PHASE2_WARMUP=1, PHASE2_LR=1e-3,
        MIN_LR=1e-5, MAX_STEPS=6,
    ).items():  # fmt: skip
        monkeypatch.setattr(config, name, value)
    fit(tmp_path, max_steps=4, every=4, module=ConfigScheduleModule())
    monkeypatch.setattr(config, "MAX_STEPS", 40)  # the run is extended: a slower cosine from here
    _, resumed = fit(
        tmp_path,
        max_steps=7,
        every=4,
        module=ConfigScheduleModule(),
        ckpt_path=str(tmp_path / "ckpt" / "step_00000004.ckpt"),
    )
    new = lr_schedule_from_config()
    assert resumed.lrs == pytest.approx([new(step) for step in range(4, 7)], rel=1e-12)
    monkeypatch.setattr(config, "MAX_STEPS", 6)
    assert lr_schedule_from_config()(4) != pytest.approx(new(4))  # the old settings differ there


# ---------------------------------------------------------------------------------------------------
# Checkpoints that always resume: unreadable ones skipped, errors that name the file, pruning, space
# ---------------------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_resume_from_last_falls_back_past_a_truncated_newest_checkpoint(tmp_path, caplog):
    fit(tmp_path, max_steps=6, every=3)
    newest = tmp_path / "ckpt" / "step_00000006.ckpt"
    _truncate(newest)
    with caplog.at_level("WARNING"):
        chosen = checkpoints.resolve_resume_from("last", tmp_path / "ckpt")
    assert chosen == str(tmp_path / "ckpt" / "step_00000003.ckpt")
    assert str(newest) in caplog.text and chosen in caplog.text and "truncated" in caplog.text
    trainer, _ = fit(tmp_path, max_steps=8, every=3, ckpt_path=chosen)
    assert trainer.global_step == 8


def test_resume_from_last_with_no_readable_checkpoint_names_the_directory(tmp_path):
    fit(tmp_path, max_steps=3, every=3)
    _truncate(tmp_path / "ckpt" / "step_00000003.ckpt")
    with pytest.raises(
        checkpoints.CheckpointError, match=r"none of the 1 step checkpoints.*RESUME_FROM="
    ):
        checkpoints.resolve_resume_from("last", tmp_path / "ckpt")


def test_loading_a_truncated_checkpoint_names_its_path(tmp_path):
    fit(tmp_path, max_steps=3, every=3)
    path = tmp_path / "ckpt" / "step_00000003.ckpt"
    _truncate(path)
    with pytest.raises(
        checkpoints.CheckpointError, match=rf"cannot load checkpoint {path}: truncated"
    ):
        fit(tmp_path, max_steps=5, every=3, ckpt_path=str(path))


def test_a_full_disk_names_the_checkpoint_and_the_free_space(tmp_path, monkeypatch):
    def full(obj, f):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:858] . unexpected pos 1030848 vs 1030736"
        )

    monkeypatch.setattr(checkpoints.torch, "save", full)
    monkeypatch.setattr(checkpoints, "free_bytes", lambda d: 12 * 2**20)
    with pytest.raises(checkpoints.CheckpointError) as err:
        fit(tmp_path, max_steps=3, every=3)
    message = str(err.value)
    assert "step_00000003.ckpt: disk full" in message and "0.0 GiB free" in message
    assert "KEEP_CHECKPOINTS" in message
    assert not list((tmp_path / "ckpt").iterdir())  # no partial file under any name


def test_keep_checkpoints_keeps_only_the_newest(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "KEEP_CHECKPOINTS", 2)
    fit(tmp_path, max_steps=5, every=1)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.ckpt")) == [
        "step_00000004.ckpt",
        "step_00000005.ckpt",
    ]


class FakeValidation(pl.Callback):
    """Sets ``last_evaluation`` of every step as PerLanguageWERCallback would, with a given WER;
    from step ``normalized_from`` on, of normalized texts (its ``scoring``), as-written before."""

    def __init__(self, wer_at: dict[int, float], normalized_from: int = 0):
        self.wer_at = wer_at
        self.normalized_from = normalized_from

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in self.wer_at:
            words = 1000
            all_ = {"word_edits": int(self.wer_at[step] * words), "words": words, "char_edits": 1}
            module.last_evaluation = {
                "step": step,
                "loss": 1.0,
                "results": {"all": {**all_, "chars": 10}},
            }
            if step >= self.normalized_from:
                module.last_evaluation["scoring"] = evaluation.NORMALIZED_SCORING


def test_the_checkpoint_with_the_lowest_validation_wer_is_kept_whatever_keep_checkpoints_says(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(config, "KEEP_CHECKPOINTS", 2)
    monkeypatch.setattr(config, "KEEP_BEST_CHECKPOINTS", 1)
    wer = {1: 0.5, 2: 0.3, 3: 0.4, 4: 0.6, 5: 0.7}
    fit(tmp_path, max_steps=5, every=1, extra=[FakeValidation(wer)])
    kept = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.ckpt"))
    assert kept == ["step_00000002.ckpt", "step_00000004.ckpt", "step_00000005.ckpt"]
    scores = json.loads((tmp_path / "ckpt" / "run.json").read_text())["validation"]
    assert {int(k): round(v["wer"], 3) for k, v in scores.items()} == wer
    assert checkpoints.best_checkpoints(1, tmp_path / "ckpt") == [tmp_path / "ckpt" / kept[0]]


def test_a_run_resumed_across_a_change_of_scoring_keeps_the_best_of_the_newest_scoring(
    tmp_path, monkeypatch
):
    """Steps 1-2 scored texts as written, steps 3-5 normalized: step 1's 0.1 is not comparable
    with the later WERs, so the best kept is step 4's."""
    monkeypatch.setattr(config, "KEEP_CHECKPOINTS", 2)
    monkeypatch.setattr(config, "KEEP_BEST_CHECKPOINTS", 1)
    wer = {1: 0.1, 2: 0.5, 3: 0.4, 4: 0.3, 5: 0.6}
    fit(tmp_path, max_steps=5, every=1, extra=[FakeValidation(wer, normalized_from=3)])
    kept = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.ckpt"))
    assert kept == ["step_00000004.ckpt", "step_00000005.ckpt"]
    scores = json.loads((tmp_path / "ckpt" / "run.json").read_text())["validation"]
    assert {int(k): v["scoring"] for k, v in scores.items()} == {
        1: None,
        2: None,
        3: evaluation.NORMALIZED_SCORING,
        4: evaluation.NORMALIZED_SCORING,
        5: evaluation.NORMALIZED_SCORING,
    }
    assert checkpoints.best_checkpoints(1, tmp_path / "ckpt") == [tmp_path / "ckpt" / kept[0]]


def scored_directory(tmp_path: Path, entries: dict[int, dict], carried: dict[int, dict]) -> Path:
    """A CHECKPOINT_DIR with a step checkpoint of every step in ``entries`` (its run record's
    ``evaluation`` the one in ``carried``, if any) and run.json's validation ``entries``."""
    for step in entries:
        record = {"evaluation": carried[step]} if step in carried else {}
        torch.save(
            {"global_step": step, "run_record": record},
            tmp_path / checkpoints.checkpoint_name(step),
        )
    validation = {str(step): entry for step, entry in entries.items()}
    (tmp_path / "run.json").write_text(json.dumps({"name": "r", "validation": validation}))
    return tmp_path


def test_best_of_run_json_entries_that_do_not_say_their_scoring_asks_their_checkpoints(tmp_path):
    """An entry that does not say how its texts were compared: the checkpoint's own record of its
    validation says it (normalized at step 2 here, as written at step 1)."""
    normalized = {"scoring": evaluation.NORMALIZED_SCORING}
    directory = scored_directory(
        tmp_path,
        {1: {"wer": 0.1}, 2: {"wer": 0.3}, 3: {"wer": 0.2, **normalized}},
        {1: {"step": 1}, 2: {"step": 2, **normalized}},
    )
    names = [p.name for p in checkpoints.best_checkpoints(3, directory)]
    assert names == ["step_00000003.ckpt", "step_00000002.ckpt"]
    with pytest.raises(checkpoints.CheckpointError, match="1 more scored otherwise"):
        checkpoints.best_checkpoints(3, directory, strict=True)


def test_a_prune_at_every_save_reads_each_checkpoint_of_an_older_run_json_once(
    tmp_path, monkeypatch
):
    """50 kept checkpoints whose run.json entries predate 'scoring': each one's own record is read
    at the first prune, not again at the next (on a 0.6B run the reads stalled every save by
    seconds); one rewritten in place is read again."""
    directory = scored_directory(
        tmp_path,
        {step: {"wer": 1.0 / step} for step in range(1, 51)},
        {step: {"step": step} for step in range(1, 51)},
    )
    reads = []
    read = checkpoints.read_checkpoint
    monkeypatch.setattr(
        checkpoints,
        "read_checkpoint",
        lambda path, *a, **k: (reads.append(path), read(path, *a, **k))[1],
    )
    for _ in range(3):
        assert checkpoints.prune_checkpoints(50, directory, keep_best=3) == []
        best = checkpoints.best_checkpoints(3, directory)
    assert [p.name for p in best] == [checkpoints.checkpoint_name(s) for s in (50, 49, 48)]
    assert sorted(reads) == sorted(checkpoints.step_checkpoints(directory))  # once each
    rewritten = directory / checkpoints.checkpoint_name(7)
    torch.save(
        {"global_step": 7, "run_record": {"evaluation": {"step": 7}}, "pad": [0] * 99}, rewritten
    )
    checkpoints.prune_checkpoints(50, directory, keep_best=3)
    assert reads.count(rewritten) == 2


def test_best_names_the_lowest_wer_checkpoints_on_disk_ties_to_the_later_step(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(config, "CHECKPOINT_DIR", tmp_path)
    for step in (1, 2, 3, 4):
        torch.save({"global_step": step}, tmp_path / checkpoints.checkpoint_name(step))
    scores = {"1": 0.2, "2": 0.4, "3": 0.2, "4": 0.3, "9": 0.0}  # step 9 was pruned
    (tmp_path / "run.json").write_text(
        json.dumps(
            {"name": "r", "wandb_id": "x", "validation": {k: {"wer": v} for k, v in scores.items()}}
        )
    )
    names = [p.name for p in checkpoints.best_checkpoints(3)]
    assert names == ["step_00000003.ckpt", "step_00000001.ckpt", "step_00000004.ckpt"]
    assert checkpoints.resolve_model_path("best").name == "step_00000003.ckpt"
    with pytest.raises(
        checkpoints.CheckpointError, match="4 step checkpoint\\(s\\) .* 5 asked for"
    ):
        checkpoints.best_checkpoints(5, strict=True)


def test_best_without_any_validation_score_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "CHECKPOINT_DIR", tmp_path)
    torch.save({"global_step": 1}, tmp_path / checkpoints.checkpoint_name(1))
    with pytest.raises(checkpoints.CheckpointError, match="EVAL_EVERY_STEPS"):
        checkpoints.resolve_model_path("best")


def test_a_validation_of_an_earlier_step_does_not_score_a_checkpoint(tmp_path):
    evaluation = {
        "step": 4,
        "results": {"all": {"word_edits": 1, "words": 10, "char_edits": 1, "chars": 9}},
    }
    assert not checkpoints.record_validation(5, evaluation, tmp_path)
    assert checkpoints.record_validation(4, evaluation, tmp_path)
    assert json.loads((tmp_path / "run.json").read_text())["validation"]["4"]["wer"] == 0.1


def test_a_file_system_without_room_for_the_next_checkpoints_is_warned_about(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(checkpoints, "free_bytes", lambda d: 1)
    with caplog.at_level("WARNING"):
        fit(tmp_path, max_steps=1, every=3)
    assert "has room for 0 checkpoint(s)" in caplog.text and str(tmp_path / "ckpt") in caplog.text


def test_a_resumed_run_does_not_log_again_the_steps_its_crashed_job_logged(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "WANDB_MODE", "disabled")
    monkeypatch.setattr(config, "WANDB_LOG_DIR", tmp_path / "logs")
    monkeypatch.setattr(config, "WANDB_RUN_NAME", "run")
    monkeypatch.setattr(config, "CHECKPOINT_DIR", tmp_path / "ckpt")
    metrics = tmp_path / "logs" / "run" / "metrics.jsonl"
    # The first job checkpoints step 3, logs up to step 5, then crashes.
    fit(
        tmp_path,
        max_steps=5,
        every=3,
        extra=[callbacks.TrainingMetricsCallback()],
        loggers=run_logging.build_loggers(),
    )
    first = metrics.read_text()
    trainer, _ = fit(
        tmp_path,
        max_steps=7,
        every=3,
        extra=[callbacks.TrainingMetricsCallback()],
        loggers=run_logging.build_loggers(
            resume_path=str(tmp_path / "ckpt" / "step_00000003.ckpt")
        ),
        ckpt_path=str(tmp_path / "ckpt" / "step_00000003.ckpt"),
    )
    assert trainer.global_step == 7
    text = metrics.read_text()
    assert text.startswith(first)  # what the first job logged stays as it was
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7]  # steps 4 and 5 were redone, not logged twice


def test_the_watchdog_reports_a_rank_stuck_before_its_first_micro_batch_with_its_stack(caplog):
    from types import SimpleNamespace

    watchdog = callbacks.ProgressWatchdog(seconds=1)
    trainer = SimpleNamespace(global_rank=0, world_size=1, global_step=0)

    def stuck_loading_the_first_batch():
        time.sleep(2.5)

    with caplog.at_level("WARNING"):
        watchdog.on_train_start(trainer, None)
        stuck_loading_the_first_batch()
        watchdog.on_train_end(trainer, None)
    reports = [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]
    assert reports and "rank 0 has finished no micro-batch" in reports[0]
    assert "stuck_loading_the_first_batch" in reports[0]


class StopAgreedAt(pl.Callback):
    """Stands in for the ranks agreeing on a stop signal in optimizer step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.stop_agreed = trainer.global_step + 1 == self.step


@pytest.mark.parametrize("stop_at, max_steps", [(2, 5), (5, 5)])
def test_an_agreed_stop_saves_that_step_and_stops_unless_it_is_the_last(
    tmp_path, stop_at, max_steps
):
    trainer, _ = fit(tmp_path, max_steps=max_steps, every=100, extra=[StopAgreedAt(stop_at)])
    saver = next(
        cb for cb in trainer.callbacks if isinstance(cb, callbacks.StepOnlyModelCheckpoint)
    )
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.ckpt"))
    if stop_at < max_steps:
        assert saver.preempted and trainer.global_step == stop_at
        assert saved == [f"step_{stop_at:08d}.ckpt"]
    else:  # the last step: a normal end, no preemption
        assert not saver.preempted and trainer.global_step == max_steps and saved == []


class RecordedValidation(callbacks.PerLanguageWERCallback):
    """The validation schedule of PerLanguageWERCallback, each pass recorded instead of run."""

    def __init__(self, every_n_steps: int):
        super().__init__(every_n_steps=every_n_steps, manifest_path="unused.parquet")
        self.validated: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step

    def evaluate(self, trainer, pl_module):
        self.validated.append(trainer.global_step)
        return {}


def test_a_stop_agreed_in_a_validation_step_saves_and_stops_without_validating(tmp_path):
    validation = RecordedValidation(every_n_steps=2)
    trainer, _ = fit(tmp_path, max_steps=6, every=100, extra=[StopAgreedAt(4), validation])
    assert trainer.global_step == 4
    assert validation.validated == [2]  # step 4 was due, and the ranks had agreed to stop
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*.ckpt")) == ["step_00000004.ckpt"]


def test_the_phase_2_rewrap_frees_the_old_ddp_buckets_before_allocating_new_ones():
    import weakref
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tests.torchrun_jobs import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        module = torch.nn.Linear(64, 64)
        seen = []

        class Strategy:
            _ddp_kwargs = {"find_unused_parameters": True}
            model = DistributedDataParallel(module, find_unused_parameters=True)

            def _setup_model(self, m):
                seen.append(old_wrapper() is None)  # the old wrapper and its buckets are gone
                return DistributedDataParallel(m, **self._ddp_kwargs)

            def _register_ddp_hooks(self):
                pass

        strategy = Strategy()
        strategy.model = Strategy.model
        del Strategy.model
        old_wrapper = weakref.ref(strategy.model)
        trainer = SimpleNamespace(strategy=strategy, global_rank=1)
        assert callbacks.stop_searching_unused_parameters(trainer)
        assert seen == [True]
        assert strategy.model.find_unused_parameters is False
    finally:
        dist.destroy_process_group()


def test_a_resume_maps_the_checkpoint_instead_of_copying_it_into_private_memory(tmp_path):
    def private_mib() -> float:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
        return 0.0

    path = tmp_path / "step_00000001.ckpt"
    torch.save({"state_dict": {"w": torch.ones(16_000_000)}}, path)  # 61 MiB
    before = private_mib()
    loaded = checkpoints.AtomicCheckpointIO().load_checkpoint(path)
    assert float(loaded["state_dict"]["w"].sum()) == 16_000_000  # every page read
    assert private_mib() - before < 16, "the checkpoint was copied into this process's memory"
