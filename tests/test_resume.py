"""Kill and resume under `torchrun --nproc_per_node 2` on CPU: the resumed run is the straight run.

Five torchrun jobs of train.py (about 25 s each on 2 cores), all with MAX_STEPS=15, GRAD_ACCUM=2,
CHECKPOINT_EVERY=5 and UNFREEZE_STEP=4 over three languages, with speed perturbation and an
EPOCH_SIZE below the corpus, so each epoch packs into its own number of micro-batches (6, 8, 6, 8
per rank: epochs end at steps 3, 7, 10 and 14; step 15 is in epoch 4) and the resumed parts cross
epochs both longer and shorter than their process's first:
1. straight: steps 0..15;
2. killed: the same job, SIGKILLed (the whole process group) once step_00000005.ckpt exists, while it
   is held inside step 5 (a probe sleeps there, so the kill lands mid-run, deterministically);
3. resumed: RESUME_FROM=last in the killed job's CHECKPOINT_DIR, steps 5..15 (from mid-epoch 1);
4. preempted: the same job, sent SIGTERM (torchrun's own pid, as a scheduler would) while held inside
   step 8: the ranks finish that optimizer step, save step_00000009.ckpt and exit;
5. requeued: RESUME_FROM=last in the preempted job's CHECKPOINT_DIR, steps 9..15 (from mid-epoch 2).
Every job runs with a DataLoader worker per rank, as real jobs do. A probe logs every micro-batch
that trains (its dataset indices) and each epoch's planned length, per rank. Every epoch trains
exactly its plan; both runs must train on the same batches in the same order and end with the same
weights and optimizer state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch

from asr_model import PORTABLE_KEY
from checkpoints import checkpoint_name
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import dump_stacks, tiny_train_env, torchrun_command
from training_step import RUN_RECORD_KEY

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 200
MAX_STEPS, KILLED_AT, PREEMPTED_AT = 15, 5, 9
LANGUAGES = ("hi", "en", "ta")

PROBE = textwrap.dedent('''
    """train.main() that logs each micro-batch it trains, per rank, and can hold inside a step."""
    import json, os, sys, time
    from pathlib import Path
    import lightning.pytorch as pl
    import train

    LOG = Path(os.environ["PROBE_OUT"]) / f"rank{os.environ['RANK']}_batches.jsonl"
    PLANS = Path(os.environ["PROBE_OUT"]) / f"rank{os.environ['RANK']}_plans.jsonl"
    HOLD_AT = int(os.environ.get("PROBE_HOLD_AT_STEP", "-1"))
    HOLD_UNTIL_STOP = os.environ.get("PROBE_HOLD_UNTIL_STOP") == "1"

    class Trained(pl.Callback):
        """What trains, whatever the DataLoader workers prefetched, and what each epoch planned."""
        def on_train_epoch_start(self, trainer, module):
            with open(PLANS, "a") as f:
                f.write(json.dumps({"epoch": trainer.current_epoch,
                                    "planned": len(module.sampler)}) + "\\n")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            with open(LOG, "a") as f:
                f.write(json.dumps({"epoch": trainer.current_epoch, "position": batch_idx,
                                    "indices": batch.indices}) + "\\n")

    class Hold(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == HOLD_AT and HOLD_UNTIL_STOP:
                import process_control
                (Path(os.environ["PROBE_OUT"]) / f"holding{os.environ['RANK']}").touch()
                for _ in range(6000):  # the test sends SIGTERM to torchrun here
                    if process_control.stop_requested():
                        break
                    time.sleep(0.1)
            elif trainer.global_step == HOLD_AT:
                time.sleep(600)  # the test kills the job here
    callbacks = train.build_callbacks
    train.build_callbacks = lambda: callbacks() + [Trained(), Hold()]
    sys.exit(train.main([]))
''')


def start_torchrun(script: Path, env: dict, log_path: Path) -> subprocess.Popen:
    cmd = torchrun_command(script)
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait(proc: subprocess.Popen, log_path: Path) -> None:
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        dump_stacks(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(
            f"torchrun did not finish in {TIMEOUT_S} s (a hang?); log {log_path}:\n"
            f"{log_path.read_text()[-12000:]}"
        )
    assert proc.returncode == 0, log_path.read_text()[-4000:]


def batches(out: Path, rank: int) -> list[dict]:
    return [
        json.loads(line) for line in (out / f"rank{rank}_batches.jsonl").read_text().splitlines()
    ]


def plans(out: Path, rank: int) -> dict[int, int]:
    """Epoch -> micro-batches its plan holds for this rank, as the process saw at the epoch's start."""
    lines = (out / f"rank{rank}_plans.jsonl").read_text().splitlines()
    return {row["epoch"]: row["planned"] for row in map(json.loads, lines)}


def trained_per_epoch(out: Path, rank: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for b in batches(out, rank):
        counts[b["epoch"]] = counts.get(b["epoch"], 0) + 1
    return counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    data = make_training_data(
        root, per_lang=16, langs=LANGUAGES, vocab_size=96, min_s=1.0, max_s=4.0
    )
    script = root / "probe_train.py"
    script.write_text(PROBE)
    base = tiny_train_env(
        data,
        VAL_MANIFEST_PATH=str(data["manifest"]),
        GRAD_ACCUM="2",
        MAX_STEPS=str(MAX_STEPS),
        UNFREEZE_STEP="4",
        CHECKPOINT_EVERY=str(KILLED_AT),
        EVAL_EVERY_STEPS=str(KILLED_AT),
        # Epochs of different lengths: a fresh subset of 24 utterances each, at drawn speeds.
        EPOCH_SIZE="24",
        SPEED_PERTURB="0.9,1.0,1.1",
        SEED="4",
        EVAL_SAMPLES_PER_LANG="3",
        WANDB_RUN_NAME="run",
        REPO=str(REPO),
    )

    def env_for(name: str, **extra) -> dict:
        out = root / name
        out.mkdir(exist_ok=True)
        return {**base, "DATA_DIR": str(root / f"{name}_data"), "PROBE_OUT": str(out), **extra}

    straight_env = env_for("straight")
    proc = start_torchrun(script, straight_env, root / "straight.log")
    wait(proc, root / "straight.log")

    killed_env = env_for("killed", PROBE_HOLD_AT_STEP=str(KILLED_AT))
    checkpoint = root / "killed_data" / "checkpoints" / f"step_{KILLED_AT:08d}.ckpt"
    proc = start_torchrun(script, killed_env, root / "killed.log")
    deadline = time.monotonic() + TIMEOUT_S
    while not checkpoint.exists():  # the final name appears only once the file is complete
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(
                f"no {checkpoint.name} from the job to kill; log:\n{(root / 'killed.log').read_text()[-3000:]}"
            )
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    resumed_env = env_for("resumed", RESUME_FROM="last", DATA_DIR=killed_env["DATA_DIR"])
    proc = start_torchrun(script, resumed_env, root / "resumed.log")
    wait(proc, root / "resumed.log")

    preempted_env = env_for(
        "preempted", PROBE_HOLD_AT_STEP=str(PREEMPTED_AT - 1), PROBE_HOLD_UNTIL_STOP="1"
    )
    proc = start_torchrun(script, preempted_env, root / "preempted.log")
    holding = [root / "preempted" / f"holding{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + TIMEOUT_S
    while not all(p.exists() for p in holding):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(
                f"the job never held in step {PREEMPTED_AT - 1}:\n{(root / 'preempted.log').read_text()[-3000:]}"
            )
        time.sleep(0.1)
    # A job that seems to hang shows where each process waits, and trains on.
    (root / "stack_dumps").write_text(str(len(dump_stacks(proc.pid))))
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no exit 60 s after SIGTERM:\n{(root / 'preempted.log').read_text()[-3000:]}")
    (root / "seconds_to_exit_after_sigterm").write_text(f"{time.monotonic() - sent:.1f}")
    requeued_env = env_for("requeued", RESUME_FROM="last", DATA_DIR=preempted_env["DATA_DIR"])
    proc = start_torchrun(script, requeued_env, root / "requeued.log")
    wait(proc, root / "requeued.log")
    return root, checkpoint


def test_the_job_was_killed_after_its_step_5_checkpoint_and_before_finishing(runs):
    root, checkpoint = runs
    assert torch.load(checkpoint, weights_only=False)["global_step"] == KILLED_AT
    assert "exported" not in (root / "killed.log").read_text()


def test_every_epoch_of_every_run_trains_exactly_the_micro_batches_its_plan_holds(runs):
    """The epochs differ in length, longer and shorter than each process's first; none is cut at
    the first's length, none runs past its own, in the straight run and in the resumed ones. The
    run ends at MAX_STEPS inside epoch 4."""
    root, _ = runs
    for rank in (0, 1):
        planned = plans(root / "straight", rank)
        assert list(planned.values())[:4] == [6, 8, 6, 8], planned  # the data gives uneven epochs
        assert len(planned) == 5
        whole = {e: n for e, n in planned.items() if e < 4}
        trained = trained_per_epoch(root / "straight", rank)
        assert {e: n for e, n in trained.items() if e < 4} == whole
        assert trained[4] == 2 * MAX_STEPS - sum(whole.values()) < planned[4]
        for run, before, at, first in (
            ("resumed", "killed", KILLED_AT, 1),
            ("requeued", "preempted", PREEMPTED_AT, 2),
        ):
            assert plans(root / run, rank) == {e: n for e, n in planned.items() if e >= first}
            # GRAD_ACCUM micro-batches per optimizer step before the checkpoint resumed from
            done = batches(root / before, rank)[: at * 2]
            resumed = trained_per_epoch(root / run, rank)
            assert min(resumed) == first
            assert 0 < resumed[first] < planned[first]  # resumed mid-epoch
            assert sum(1 for b in done if b["epoch"] == first) + resumed[first] == planned[first]
            assert {e: n for e, n in resumed.items() if e > first} == {
                e: n for e, n in trained.items() if e > first
            }


def test_resumed_run_consumes_exactly_the_straight_runs_remaining_batches_on_every_rank(runs):
    root, checkpoint = runs
    state = torch.load(checkpoint, weights_only=False)["sampler_state"]
    resume_at = (state["epoch"], state["position"])
    assert resume_at[1] > 0, "the checkpoint should fall mid-epoch for this test to mean something"
    for rank in (0, 1):
        straight = batches(root / "straight", rank)
        before = [
            b for b in batches(root / "killed", rank) if (b["epoch"], b["position"]) < resume_at
        ]
        resumed = batches(root / "resumed", rank)
        assert (resumed[0]["epoch"], resumed[0]["position"]) == resume_at
        assert before + resumed == straight
        assert len(straight) == MAX_STEPS * 2  # GRAD_ACCUM micro-batches per optimizer step


def test_resumed_run_ends_with_the_straight_runs_weights_and_optimizer_state(runs):
    root, _ = runs
    name = f"step_{MAX_STEPS:08d}.ckpt"
    straight = torch.load(root / "straight_data" / "checkpoints" / name, weights_only=False)
    resumed = torch.load(root / "killed_data" / "checkpoints" / name, weights_only=False)
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    # every step checkpoint rebuilds its model alone and carries the run record of its step
    for checkpoint in (straight, resumed):
        assert {"class", "config", "tokenizer"} <= checkpoint[PORTABLE_KEY].keys()
        record = checkpoint[RUN_RECORD_KEY]
        assert record["step"] == MAX_STEPS and record["world_size"] == 2
        assert record["evaluation"]["step"] == MAX_STEPS  # validated before it was saved
        assert record["settings"]["MAX_STEPS"] == MAX_STEPS
        assert set(record["training_hours"]) == set(LANGUAGES)
    for key, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for a, b in zip(
        straight["optimizer_states"][0]["state"].values(),
        resumed["optimizer_states"][0]["state"].values(),
    ):
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)


def test_resumed_run_logs_after_the_restored_step_only_in_its_jsonl(runs):
    root, _ = runs
    lines = [
        json.loads(l)
        for l in (root / "killed_data" / "wandb_logs" / "run" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    steps = [l["step"] for l in lines if "train/loss" in l]
    assert steps == list(range(1, MAX_STEPS + 1))  # steps 1-5 by the killed job, then the rest


def test_per_language_wer_is_gathered_from_both_ranks(runs):
    root, _ = runs
    lines = [
        json.loads(l)
        for l in (root / "straight_data" / "wandb_logs" / "run" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    evals = [l for l in lines if "val/wer/all" in l]
    assert [l["step"] for l in evals] == [5, 10, 15]
    for l in evals:
        # 3 utterances per language x 3 languages, decoded on both ranks.
        assert l["val/utterances"] == 9
        assert {f"val/{m}/{lang}" for m in ("wer", "cer") for lang in LANGUAGES} <= l.keys()
        assert "val/cer/all" in l
    tables = [l for l in lines if l.get("table") == "val/examples"]
    assert len(tables) == 3 and tables[0]["columns"] == ["lang", "reference", "hypothesis"]


def test_sigusr2_prints_the_stacks_of_every_rank_and_worker_and_the_job_goes_on(runs):
    root, _ = runs
    assert (root / "stack_dumps").read_text() == "4"  # 2 ranks, a DataLoader worker each
    log = (root / "preempted.log").read_text()
    assert log.count("Current thread 0x") == 4, log[-6000:]
    assert "_worker_loop" in log  # the workers' own stacks, not only the ranks'
    assert checkpoint_name(PREEMPTED_AT) in "".join(
        p.name for p in (root / "preempted_data" / "checkpoints").iterdir()
    )


# ---- preemption: SIGTERM saves the current step, and the requeued job ends as the straight one ------


def test_sigterm_saves_the_step_in_progress_and_exits_without_a_nemo(runs):
    root, _ = runs
    directory = root / "preempted_data" / "checkpoints"
    saved = sorted(p.name for p in directory.glob("step_*.ckpt"))  # 10 and 15: the requeued job's
    assert saved == [checkpoint_name(s) for s in (KILLED_AT, PREEMPTED_AT, 10, MAX_STEPS)]
    preempted = torch.load(directory / checkpoint_name(PREEMPTED_AT), weights_only=False)
    assert preempted["global_step"] == PREEMPTED_AT
    log = (root / "preempted.log").read_text()
    assert "SIGTERM received" in log and "exit code 75" in log
    assert "exported" not in log  # the .nemo in that directory is the requeued job's
    assert float((root / "seconds_to_exit_after_sigterm").read_text()) < 30


def test_the_requeued_run_redoes_no_step_and_ends_bit_identical_to_the_straight_run(runs):
    root, _ = runs
    for rank in (0, 1):
        done = batches(root / "preempted", rank)[: PREEMPTED_AT * 2]
        assert done + batches(root / "requeued", rank) == batches(root / "straight", rank)
    name = f"step_{MAX_STEPS:08d}.ckpt"
    straight = torch.load(root / "straight_data" / "checkpoints" / name, weights_only=False)
    requeued = torch.load(root / "preempted_data" / "checkpoints" / name, weights_only=False)
    for key, value in straight["state_dict"].items():
        assert torch.equal(requeued["state_dict"][key], value), key
    for a, b in zip(
        straight["optimizer_states"][0]["state"].values(),
        requeued["optimizer_states"][0]["state"].values(),
    ):
        for key in a:
            assert torch.equal(b[key], a[key]), key
