"""train.py under `torchrun --nproc_per_node 2` on CPU: both phases, rank agreement, faults inside a step.

Each test module run starts two torchrun jobs (about 30-60 s each on 2 cores): the plain `train.py`
entry point, and `train.main()` behind a probe that dumps state_dicts per rank and injects one
empty micro-batch (rank 1) and one NaN loss (rank 0). A hang fails the test at the timeout.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import run_torchrun, tiny_train_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
MAX_STEPS, UNFREEZE_STEP, GRAD_ACCUM = 6, 3, 2
EMPTY_AT = (1, 2)  # (rank, micro-batch): rank 1's first micro-batch of optimizer step 1
NAN_AT = (0, 9)  # rank 0's second micro-batch of optimizer step 4 (phase 2)
NAN_STEP = NAN_AT[1] // GRAD_ACCUM

PROBE = textwrap.dedent('''
    """train.main() with state dumps and injected faults, for tests/test_train_ddp.py."""
    import json, os, sys
    from pathlib import Path
    import lightning.pytorch as pl
    import torch
    import train
    from dataset import collate_asr_batch

    OUT = Path(os.environ["PROBE_OUT"])
    RANK = int(os.environ["RANK"])
    EMPTY_AT = tuple(map(int, os.environ["EMPTY_AT"].split(":")))
    NAN_AT = tuple(map(int, os.environ["NAN_AT"].split(":")))
    NAN_STEP, UNFREEZE = int(os.environ["NAN_STEP"]), int(os.environ["UNFREEZE_STEP"])

    def dump(name, module):
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, OUT / f"rank{RANK}_{name}.pt")

    class Probe(pl.Callback):
        find_unused = {}
        def on_train_start(self, trainer, m):
            dump("encoder_start", m.model.encoder)
        def on_train_batch_start(self, trainer, m, batch, batch_idx):
            self.find_unused[trainer.global_step] = trainer.strategy.model.find_unused_parameters
            for step, name, part in ((UNFREEZE, "encoder_at_unfreeze", m.model.encoder),
                                     (NAN_STEP, "before_nan_step", m), (NAN_STEP + 1, "after_nan_step", m)):
                if trainer.global_step == step and not (OUT / f"rank{RANK}_{name}.pt").exists():
                    dump(name, part)
        def on_train_end(self, trainer, m):
            dump("final", m)
            (OUT / f"rank{RANK}_counters.json").write_text(json.dumps(dict(
                global_step=trainer.global_step, skipped_steps=m.skipped_steps, phase=m.phase,
                empty_micro_batches=m.empty_micro_batches, nonfinite_losses=m.nonfinite_losses,
                find_unused=self.find_unused)))

    seen = {"n": 0}
    step = train.TrainingModule.training_step
    def training_step(self, batch, batch_idx):
        n, seen["n"] = seen["n"], seen["n"] + 1
        if (RANK, n) == EMPTY_AT:
            batch = collate_asr_batch([None] * 2)
        self._inject_nan = (RANK, n) == NAN_AT
        return step(self, batch, batch_idx)
    train.TrainingModule.training_step = training_step
    loss = train.TrainingModule.compute_loss
    train.TrainingModule.compute_loss = lambda self, b: loss(self, b) * (float("nan") if self._inject_nan else 1.0)
    callbacks = train.build_callbacks
    train.build_callbacks = lambda: callbacks() + [Probe()]
    sys.exit(train.main([]))
''')


def torchrun(script: Path, env: dict, log_path: Path) -> subprocess.CompletedProcess:
    return run_torchrun(script, env, REPO, TIMEOUT_S, log_path)


@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    data = make_training_data(root, per_lang=16, vocab_size=64)
    env = tiny_train_env(
        data,
        DATA_DIR=str(root / "data"),
        GRAD_ACCUM=str(GRAD_ACCUM),
        MAX_STEPS=str(MAX_STEPS),
        UNFREEZE_STEP=str(UNFREEZE_STEP),
        REPO=str(REPO),
    )
    return root, env


@pytest.fixture(scope="module")
def plain_run(run_env):
    root, env = run_env
    result = torchrun(REPO / "train.py", env, root / "plain.log")
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def probed_run(run_env):
    root, env = run_env
    out = root / "probe"
    out.mkdir()
    script = root / "probe_train.py"
    script.write_text(PROBE)
    env = dict(
        env,
        DATA_DIR=str(root / "probe_data"),  # its own run, its own CHECKPOINT_DIR
        PROBE_OUT=str(out),
        EMPTY_AT="{}:{}".format(*EMPTY_AT),
        NAN_AT="{}:{}".format(*NAN_AT),
        NAN_STEP=str(NAN_STEP),
    )
    result = torchrun(script, env, root / "probe.log")
    assert result.returncode == 0, result.stdout[-4000:]

    def load(rank, name):
        return torch.load(out / f"rank{rank}_{name}.pt")

    counters = {r: json.loads((out / f"rank{r}_counters.json").read_text()) for r in (0, 1)}
    return load, counters, result.stdout


def assert_bit_identical(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different[:5]} (+{max(0, len(different) - 5)})"


def test_torchrun_train_py_runs_both_phases_to_max_steps(plain_run):
    assert (
        "phase 1, encoder frozen" in plain_run and "step 3: phase 2, encoder unfrozen" in plain_run
    )
    assert plain_run.count(f"done: {MAX_STEPS} optimizer steps, 0 skipped") == 2  # both ranks


def test_startup_logs_the_distributed_assumptions_and_the_first_step(plain_run):
    assert "world size 2 = 1 node(s) x 2 process(es); strategy DDPStrategy" in plain_run
    assert "up to 24 s (0.4 min) of audio" in plain_run  # 2 ranks x 2 micro-batches x 6 s
    for rank in (0, 1):
        assert f"rank {rank}: " in plain_run and "most expensive micro-batch" in plain_run


def test_phase1_leaves_the_encoder_state_dict_bit_identical_on_every_rank(probed_run):
    load, _, _ = probed_run
    for rank in (0, 1):
        assert_bit_identical(load(rank, "encoder_at_unfreeze"), load(rank, "encoder_start"))


def test_encoder_trains_after_unfreezing(probed_run):
    load, counters, _ = probed_run
    start = load(0, "encoder_start")
    final = {
        k[len("model.encoder.") :]: v
        for k, v in load(0, "final").items()
        if k.startswith("model.encoder.")
    }
    assert any(not torch.equal(v, start[k]) for k, v in final.items() if "weight" in k)
    assert counters[0]["phase"] == 2


def test_every_parameter_and_buffer_is_bit_identical_across_ranks_after_unfreezing(probed_run):
    load, counters, _ = probed_run
    assert counters[0]["global_step"] == counters[1]["global_step"] == MAX_STEPS
    assert_bit_identical(load(0, "final"), load(1, "final"))


def test_empty_micro_batch_on_one_rank_neither_hangs_nor_skips_the_step(probed_run):
    _, counters, log = probed_run
    assert counters[1]["empty_micro_batches"] == 1 and counters[0]["empty_micro_batches"] == 0
    assert "every utterance was bad audio; it contributes nothing" in log


def test_nan_loss_on_one_rank_skips_that_step_on_every_rank(probed_run):
    load, counters, log = probed_run
    assert counters[0]["nonfinite_losses"] == 1 and counters[1]["nonfinite_losses"] == 0
    assert counters[0]["skipped_steps"] == counters[1]["skipped_steps"] == 1
    for rank in (0, 1):
        assert_bit_identical(load(rank, "after_nan_step"), load(rank, "before_nan_step"))
    assert f"optimizer step {NAN_STEP} skipped on every rank: non-finite loss" in log


def test_ddp_searches_for_unused_parameters_only_while_the_encoder_is_frozen(probed_run):
    _, counters, log = probed_run
    for rank in (0, 1):
        flags = {int(step): on for step, on in counters[rank]["find_unused"].items()}
        assert flags == {step: step < UNFREEZE_STEP for step in range(MAX_STEPS)}
    assert (
        f"step {UNFREEZE_STEP}: DDP re-wrapped with find_unused_parameters=False for phase 2" in log
    )
