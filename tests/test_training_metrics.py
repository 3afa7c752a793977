"""training_metrics.py: the declarations, their reduction over ranks, and docs/metrics.md's generated list."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
