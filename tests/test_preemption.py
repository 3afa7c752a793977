"""Stop signals under a real `torchrun --nproc_per_node 2 train.py` with DataLoader workers (CPU).

A cluster job is stopped by a signal that reaches more than the ranks: torchrun forwards its own to
each rank's whole process group (the rank and its DataLoader workers), and SLURM signals every
process of the job at once (torchrun, ranks, workers, W&B's service). Each test starts a tiny job
with one DataLoader worker per rank (the real default is more) and stops it at a different moment:
- during training, SIGTERM to every process of the job, W&B offline: the ranks save the step in
  progress and exit with code 75; the dead W&B service is one warning;
- during a validation pass, SIGUSR1 to plain torchrun started with the documented
  --signals-to-handle (SIGUSR1 added): the pass is cut short, that step is saved, exit 75;
- during start-up, while the training cache is built by worker processes, SIGTERM to every
  process: the ranks exit with code 75 at once, no worker and no half-built cache is left.
The requeued job's exactness is tests/test_resume.py's (also with workers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from checkpoints import checkpoint_name
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import (
    is_running,
    job_processes,
    signal_every_process,
    tiny_train_env,
    torchrun_command,
)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180

PROBE = textwrap.dedent('''
    """train.main() that tells the test when a stage is under way, and can slow a stage down:
    PROBE_SLOW_VALIDATION holds the first validation batch until a stop signal arrives,
    PROBE_SLOW_CACHE makes each part of the training cache build take a second."""
    import os, sys, time
    from pathlib import Path
    import evaluation, process_control, train, training_cache

    OUT = Path(os.environ["PROBE_OUT"])
    RANK = os.environ["RANK"]
    if os.environ.get("PROBE_SLOW_VALIDATION"):
        decode = evaluation.decode
        def held(*args, **kwargs):
            (OUT / f"validating{RANK}").touch()
            for _ in range(600):
                if process_control.stop_requested():
                    break
                time.sleep(0.1)
            return decode(*args, **kwargs)
        evaluation.decode = held
    if os.environ.get("PROBE_SLOW_CACHE"):
        build_part = training_cache._build_part
        def slow(task):
            (OUT / f"building{os.getpid()}").touch()
            time.sleep(1.0)
            return build_part(task)
        training_cache._build_part = slow
    sys.exit(train.main([]))
''')


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    made = make_training_data(root, per_lang=16, vocab_size=64)
    (root / "probe_train.py").write_text(PROBE)
    return root, made


def start(root: Path, env: dict, name: str, handle_usr1: bool = False) -> subprocess.Popen:
    cmd = torchrun_command(root / "probe_train.py")
    if handle_usr1:  # docs/operations.md's plain torchrun command (scripts/launch.py adds SIGUSR1)
        cmd.insert(3, "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=open(root / f"{name}.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for(predicate, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"never saw {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def wait_for_exit(proc: subprocess.Popen, env: dict, log: Path, sent: float) -> float:
    """Seconds from the signal until every process of the job is gone."""
    deadline = sent + 90
    while (proc.poll() is None or job_processes(env)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = job_processes(env)
    if proc.poll() is None or left:
        signal_every_process(env, signal.SIGKILL)
        pytest.fail(
            f"processes {left} still running 90 s after the signal:\n{log.read_text()[-3000:]}"
        )
    return time.monotonic() - sent


def rank_lines(text: str) -> str:
    """The job's output without torchrun's own report of the signal it got (its SignalException
    traceback, which ends torchrun with status 1 whatever the ranks did)."""
    return text.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0]


def test_sigterm_to_every_process_during_training_saves_that_step_and_exits_75(data):
    root, made = data
    env = tiny_train_env(
        made,
        DATA_DIR=str(root / "all"),
        PROBE_OUT=str(root),
        MAX_STEPS="100000",
        UNFREEZE_STEP="2",
        GRAD_ACCUM="1",
        CHECKPOINT_EVERY="1000",
        EVAL_EVERY_STEPS="0",
        WANDB_MODE="offline",
        WANDB_RUN_NAME="all",
    )
    log = root / "all.log"
    proc = start(root, env, "all")
    metrics = root / "all" / "wandb_logs" / "all" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, proc, log, "a trained step")
    workers = [
        p for p in job_processes(env) if "pt_data_worker" in Path(f"/proc/{p}/comm").read_text()
    ]
    assert len(workers) == 2, "one DataLoader worker per rank"
    signalled = signal_every_process(env)
    seconds = wait_for_exit(proc, env, log, time.monotonic())
    (root / "seconds_to_exit_after_sigterm_to_every_process").write_text(f"{seconds:.1f}")
    out = log.read_text()
    assert len(signalled) >= 5, signalled  # torchrun, 2 ranks, 2 workers (and W&B's service)
    assert "killed by signal" not in out and "exited unexpectedly" not in out, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    saved = sorted((root / "all" / "checkpoints").glob("step_*.ckpt"))
    assert len(saved) == 1, out[-3000:]
    step = torch.load(saved[0], weights_only=False)["global_step"]
    for rank in (0, 1):
        assert (
            f"[rank {rank}] WARNING train: stopped on SIGTERM after saving optimizer step {step}; "
            f"exit code 75" in out
        ), out[-3000:]
    assert not list((root / "all" / "checkpoints").glob("*.nemo"))
    assert seconds < 30, out[-3000:]


def test_sigusr1_during_a_validation_pass_cuts_it_short_saves_that_step_and_exits_75(data):
    root, made = data
    env = tiny_train_env(
        made,
        DATA_DIR=str(root / "val"),
        PROBE_OUT=str(root),
        PROBE_SLOW_VALIDATION="1",
        VAL_MANIFEST_PATH=str(made["manifest"]),
        EVAL_EVERY_STEPS="2",
        EVAL_SAMPLES_PER_LANG="6",
        MAX_STEPS="100000",
        UNFREEZE_STEP="1",
        GRAD_ACCUM="1",
        CHECKPOINT_EVERY="1000",
        WANDB_RUN_NAME="val",
    )
    log = root / "val.log"
    proc = start(root, env, "val", handle_usr1=True)
    wait_for(
        lambda: all((root / f"validating{r}").exists() for r in (0, 1)), proc, log, "validation"
    )
    proc.send_signal(signal.SIGUSR1)  # slurm_train.sh passes SLURM's USR1 on to torchrun
    seconds = wait_for_exit(proc, env, log, time.monotonic())
    out = log.read_text()
    assert "killed by signal" not in rank_lines(out), out[-3000:]
    assert "step 2: validation cut short by a stop signal" in out, out[-3000:]
    saved = sorted(p.name for p in (root / "val" / "checkpoints").glob("step_*.ckpt"))
    assert saved == [checkpoint_name(2)], out[-3000:]
    assert out.count("stopped on SIGUSR1 after saving optimizer step 2; exit code 75") == 2
    lines = (root / "val" / "wandb_logs" / "val" / "metrics.jsonl").read_text().splitlines()
    assert not [line for line in lines if "val/wer/all" in json.loads(line)]  # nothing half-counted
    assert seconds < 30, out[-3000:]


def test_sigterm_to_every_process_during_start_up_exits_75_with_no_worker_or_cache_left(data):
    root, made = data
    manifest = root / "startup" / "train_manifest.parquet"
    manifest.parent.mkdir()
    manifest.write_bytes(made["manifest"].read_bytes())  # a manifest without a training cache
    env = tiny_train_env(
        {**made, "manifest": manifest},
        DATA_DIR=str(root / "startup"),
        PROBE_OUT=str(root / "startup"),
        PROBE_SLOW_CACHE="1",
        CACHE_BUILD_WORKERS="2",
        MAX_STEPS="4",
    )
    log = root / "startup.log"
    proc = start(root, env, "startup")
    wait_for(lambda: list((root / "startup").glob("building*")), proc, log, "a cache build")
    signal_every_process(env)
    seconds = wait_for_exit(proc, env, log, time.monotonic())
    out = log.read_text()
    assert out.count("SIGTERM received before training started: exiting (nothing to save)") == 2
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    leftovers = [p.name for p in manifest.parent.iterdir() if ".tmp-" in p.name]
    assert not leftovers, f"a half-built cache was left: {leftovers}"
    assert not list((root / "startup").rglob("*.ckpt"))
    assert seconds < 30, out[-3000:]


def test_a_helper_process_leaves_stop_signals_to_its_parent_and_dies_with_it(tmp_path):
    child = textwrap.dedent("""
        import os, signal, sys, time
        import process_control
        with process_control.stop_signals_blocked():
            pid = os.fork()
            if pid == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # held by the inherited block until...
                process_control.leave_stop_signals_to_parent()  # ...discarded here
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGINT)
                print("helper alive", flush=True)
                time.sleep(60)
                os._exit(0)
        print(pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    lines = sorted(proc.stdout.readline().strip() for _ in range(2))  # the two print in any order
    helper = int(lines[0])
    assert lines[1] == "helper alive"
    os.kill(helper, signal.SIGTERM)
    time.sleep(0.3)
    assert is_running(helper), "a helper must not die of a stop signal"
    proc.kill()  # the parent dies (even by SIGKILL): the helper goes with it
    proc.wait()
    deadline = time.monotonic() + 10
    while is_running(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(helper)
