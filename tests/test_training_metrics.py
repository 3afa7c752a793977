"""training_metrics.py: the declarations, their reduction over ranks, and docs/metrics.md's generated list."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

import training_metrics as tm
from doc_tables import replace_section

REPO = Path(__file__).resolve().parents[1]


def batch(langs, durations, bad=None, loss=1.0):
    n = len(langs)
    signal = torch.zeros(n, 100)
    lens = torch.tensor([50 + 10 * i for i in range(n)])
    b = SimpleNamespace(signal=signal, signal_len=lens, langs=list(langs), durations=list(durations),
                        token_len=torch.full((n,), 4), bad_audio=dict(bad or {}),
                        token_count=4 * n, sample_count=int(lens.sum()))  # fmt: skip
    return b, SimpleNamespace(last_loss=torch.tensor(loss))


def test_docs_metric_list_is_generated_from_the_declarations():
    text = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    body = tm.markdown_list()
    assert replace_section(text, tm.LIST_START, tm.LIST_END, body) == text, (
        "docs/metrics.md metric list is stale: run `make docs`"
    )
    for key in ("train/epoch", "train/micro_batch", "data/bad_audio_total", "val/wer/<lang>"):
        assert f"`{key}`" in body


def test_every_metric_declares_a_known_reduction_and_a_meaning():
    keys = [m.key for m in tm.STEP_METRICS + tm.EVALUATION_METRICS]
    assert len(keys) == len(set(keys))
    for m in tm.STEP_METRICS + tm.EVALUATION_METRICS:
        assert m.ranks in tm.RANK_REDUCTIONS and m.meaning, m.key
    assert all(m.value is not None for m in tm.STEP_METRICS)


def test_every_measure_a_metric_reads_is_declared():
    names = {m.name for m in tm.MEASURES}
    source = (REPO / "training_metrics.py").read_text(encoding="utf-8")
    used = set(re.findall(r's\.(?:m|total)\["([a-z_]+)"\]', source))
    assert used and used <= names, used - names


def test_a_window_sums_its_micro_batches_and_keeps_languages_apart():
    w = tm.Window({"lang": ["en", "hi"], "reason": ["missing", "empty"]})
    w.add_micro_batch(*batch(["hi", "en", "hi"], [1.0, 2.0, 3.0], {"missing": 2}, loss=2.0))
    w.add_micro_batch(*batch(["en"], [4.0], loss=float("nan")))
    r = w.reduced(torch.device("cpu"))
    assert r["utterances"] == 4 and r["audio_seconds"] == 10.0 and r["tokens"] == 16
    assert r["lang_utterances"] == {"en": 2.0, "hi": 2.0}
    assert r["bad_audio"] == {"missing": 2.0, "empty": 0.0}
    assert r["loss_sum"] == 2.0 and r["loss_count"] == 1  # the non-finite loss is left out
    assert r["real_samples"] == 50 + 60 + 70 + 50 and r["padded_samples"] == 400


def test_step_metrics_expand_per_language_keys_and_leave_cuda_ones_out_on_cpu():
    w = tm.Window({"lang": ["en", "hi"], "reason": ["missing"]})
    w.add_micro_batch(*batch(["hi", "en", "hi"], [1.0, 2.0, 3.0]))
    w.set("step_seconds", 2.0)
    w.set("step_seconds_max", 2.0)
    reduced = w.reduced(torch.device("cpu"))
    totals = tm.empty_totals(w.keys)
    tm.add_to_totals(totals, reduced)
    trainer = SimpleNamespace(current_epoch=0, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(
        batch_progress=SimpleNamespace(current=SimpleNamespace(processed=3)))))  # fmt: skip
    module = SimpleNamespace(phase=1, last_grad_norm=0.5)
    step = tm.Step(measures=reduced, total=totals, trainer=trainer, module=module, lr=1e-3,
                   recent_langs=reduced["lang_utterances"], target_share={"en": 0.4, "hi": 0.6})  # fmt: skip
    out = tm.step_metrics(step, cuda=False)
    assert out["lang_share/hi"] == 2 / 3 and out["lang_target/en"] == 0.4
    assert out["throughput/audio_s_per_s"] == 3.0
    assert "gpu/peak_memory_gib" not in out and "data/bad_audio/missing" in out
    assert math.isclose(out["train/loss"], 1.0)


def _two_rank_reduction(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    w = tm.Window({"lang": ["en", "hi"], "reason": ["missing"]})
    w.add_micro_batch(*batch(["hi"] * (rank + 1), [1.0] * (rank + 1)))
    w.set("step_seconds_max", 1.0 + rank)
    w.set("skipped_steps", 1.0)
    out[rank] = w.reduced(torch.device("cpu"))
    dist.destroy_process_group()


def test_sums_and_maxes_combine_the_ranks_by_name():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_two_rank_reduction, args=(port, out), nprocs=2, join=True)
    for rank in (0, 1):
        r = out[rank]
        assert r["utterances"] == 3 and r["lang_utterances"] == {"en": 0.0, "hi": 3.0}
        assert r["step_seconds_max"] == 2.0
        assert r["skipped_steps"] == 1.0  # max: every rank decided the same skip


# ---- overfitting -------------------------------------------------------------------------------


def validations(val_losses, train_means, start=0, every=100):
    return [
        tm.LossAtValidation(start + every * i, v, t)
        for i, (v, t) in enumerate(zip(val_losses, train_means))
    ]


def test_three_rises_of_the_validation_loss_while_training_loss_falls_is_overfitting():
    # the step-0 validation has no training before it; v rises 1.0 -> 1.1 -> 1.2 -> 1.3
    run = validations([1.0, 1.1, 1.2, 1.3], [None, 0.9, 0.5, 0.2])
    assert tm.overfitting_at(run, 3)
    assert tm.overfitting_steps(run, 3) == [300]
    assert not tm.overfitting_at(run[:3], 3)  # two rises are not three
    assert tm.overfitting_at(run[:3], 2)


def test_a_validation_loss_that_stops_rising_even_once_is_no_overfitting():
    assert not tm.overfitting_at(validations([1.0, 1.1, 1.1, 1.3], [None, 0.9, 0.5, 0.2]), 3)
    assert not tm.overfitting_at(validations([1.0, 1.2, 1.1, 1.3], [None, 0.9, 0.5, 0.2]), 3)


def test_a_training_loss_that_does_not_fall_over_the_window_is_no_overfitting():
    # validation and training loss rising together: the run diverges, it does not overfit
    assert not tm.overfitting_at(validations([1.0, 1.1, 1.2, 1.3], [None, 0.5, 0.6, 0.7]), 3)
    assert not tm.overfitting_at(validations([1.0, 1.1, 1.2, 1.3], [None, 0.5, 0.4, 0.5]), 3)
    # the window's first interval is the one ending at its second validation (step 100), not the
    # interval before the window: training rose into the window, then fell within it
    assert tm.overfitting_at(validations([2.0, 1.0, 1.1, 1.2, 1.3], [0.1, 0.9, 0.8, 0.7, 0.6]), 3)


def test_an_unknown_loss_in_the_window_or_fewer_than_two_rises_never_warn():
    assert not tm.overfitting_at(validations([1.0, None, 1.2, 1.3], [None, 0.9, 0.5, 0.2]), 3)
    assert not tm.overfitting_at(validations([1.0, 1.1, 1.2, 1.3], [None, None, 0.5, 0.2]), 3)
    assert not tm.overfitting_at(validations([1.0, 1.1, 1.2, math.nan], [None, 0.9, 0.5, 0.2]), 3)
    assert not tm.overfitting_at(validations([1.0, 1.1], [None, 0.5]), 1)
    assert not tm.overfitting_at(validations([1.0, 1.1, 1.2, 1.3], [None, 0.9, 0.5, 0.2]), 0)


def test_every_validation_of_a_longer_rise_is_an_overfitting_step():
    run = validations([3.0, 2.0, 2.1, 2.2, 2.3, 2.4, 2.0], [None, 2.5, 1.0, 0.8, 0.6, 0.4, 0.3])
    assert tm.overfitting_steps(run, 3) == [400, 500]


def test_the_training_loss_of_a_validation_is_its_mean_since_the_one_before():
    train = [(1, 4.0), (2, 2.0), (3, math.nan), (4, 1.0), (5, 3.0), (6, 5.0), (7, 9.0)]
    got = tm.losses_at_validations([(0, 1.5), (2, 1.4), (4, 1.3), (6, 1.2)], train)
    assert got == [
        tm.LossAtValidation(0, 1.5, None),
        tm.LossAtValidation(2, 1.4, 3.0),  # steps 1-2
        tm.LossAtValidation(4, 1.3, 1.0),  # steps 3-4, the non-finite left out
        tm.LossAtValidation(6, 1.2, 4.0),  # steps 5-6; step 7 follows the last validation
    ]


@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=60),
    st.integers(1, 9),
    st.integers(2, 4),
    st.integers(1, 59),
)
@settings(max_examples=60, deadline=None)
def test_the_live_watch_and_the_reports_reading_of_metrics_find_the_same_steps(
    train, every, rises, resume_at
):
    """train.py watches step by step (and carries the watch through a checkpoint); run_report.py
    reads the same series from metrics.jsonl afterwards: they must agree."""
    import random

    rng = random.Random(len(train) * 31 + every)
    val = [(0, 5.0)] + [(s, rng.uniform(0, 3)) for s in range(every, len(train) + 1, every)]
    series = list(enumerate(train, start=1))
    expected = tm.overfitting_steps(tm.losses_at_validations(val, series), rises)
    watch, found = tm.OverfittingWatch(rises), []
    if watch.validation(0, 5.0):
        found.append(0)
    losses = dict(val)
    for step, loss in series:
        if step == resume_at:  # a resumed job continues from the checkpoint's state
            state = watch.state_dict()
            watch = tm.OverfittingWatch(rises)
            watch.load_state_dict(state)
        watch.train_step(loss)
        if step in losses and watch.validation(step, losses[step]):
            found.append(step)
    assert found == expected
