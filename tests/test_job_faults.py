"""Faults a 2-process `torchrun train.py` meets on a cluster, each reproduced (tiny model, CPU):
a bad knob, every audio file missing, torchrun itself SIGKILLed, one rank stopped (SIGSTOP), a
DataLoader worker that stops delivering."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import child_pids, is_running, tiny_train_env, torchrun_command

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    data = make_training_data(root, per_lang=16, vocab_size=64)
    env = tiny_train_env(data, GRAD_ACCUM="1", MAX_STEPS="4", UNFREEZE_STEP="2")
    return root, env, data


def start(env: dict, log: Path, **extra) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_command(REPO / "train.py"),
        cwd=REPO,
        env={**env, **extra},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, log: Path, timeout: float = 240) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"no exit in {timeout} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text()


def wait_for(text: str, log: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"never saw {text!r}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def test_a_bad_knob_is_one_line_from_rank_0_and_the_root_cause_of_torchruns_summary(job_env):
    root, env, _ = job_env
    log = root / "bad_knob.log"
    rc, out = finish(start(env, log, GRAD_ACCUM="four"), log)
    assert rc != 0
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    expected = "error: invalid configuration: GRAD_ACCUM='four': expected an integer"
    assert errors == [expected], out[-3000:]
    ranks_output = out.split("ChildFailedError")[0].split("Traceback")[0]  # torchrun's own follow
    assert "error: invalid configuration:" in ranks_output
    root_cause = out.split("Root Cause")[1]
    assert "exitcode  : 2" in root_cause and "GRAD_ACCUM='four'" in root_cause


def test_a_manifest_whose_audio_is_all_missing_stops_before_training(job_env):
    root, env, data = job_env
    table = pq.read_table(data["manifest"])
    audio = "audio_filepath"
    moved = pc.replace_substring(table[audio], str(data["manifest"].parent), "/nonexistent")
    manifest = root / "moved.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index(audio), audio, moved), manifest)
    log = root / "missing_audio.log"
    started = time.monotonic()
    rc, out = finish(
        start(env, log, TRAIN_MANIFEST_PATH=str(manifest), DATA_DIR=str(root / "m")), log
    )
    assert rc != 0 and time.monotonic() - started < 120
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "none of" in errors[0] and "/nonexistent" in errors[0], out[-3000:]
    assert not list((root / "m").rglob("*.nemo")) and not list((root / "m").rglob("*.ckpt"))


def test_ranks_die_with_a_sigkilled_torchrun(job_env):
    root, env, _ = job_env
    log = root / "orphans.log"
    proc = start(env, log, MAX_STEPS="100000", DATA_DIR=str(root / "o"))
    wait_for("micro-batches this epoch", log, proc)
    ranks = child_pids(proc.pid)
    assert len(ranks) == 2
    proc.send_signal(signal.SIGKILL)  # the launcher only, as an OOM killer or a node agent would
    proc.wait()
    deadline = time.monotonic() + 10
    while any(is_running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(p) for p in ranks), "ranks outlived torchrun"


def test_a_stopped_rank_ends_the_job_within_the_collective_timeout_and_is_named(job_env):
    root, env, _ = job_env
    log = root / "stopped.log"
    proc = start(
        env,
        log,
        MAX_STEPS="100000",
        DATA_DIR=str(root / "s"),
        COLLECTIVE_TIMEOUT_MINUTES="0.5",
        WATCHDOG_SECONDS="8",
    )
    wait_for("micro-batches this epoch", log, proc)
    time.sleep(3)  # a few optimizer steps, so both ranks have reported a heartbeat
    rank1 = [
        p for p in child_pids(proc.pid) if "RANK=1\0" in Path(f"/proc/{p}/environ").read_text()
    ]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        rc, out = finish(proc, log, timeout=150)
    finally:
        if is_running(rank1[0]):
            os.kill(rank1[0], signal.SIGKILL)
    seconds = time.monotonic() - stopped
    (root / "seconds_to_exit_after_sigstop").write_text(f"{seconds:.1f}")
    assert rc != 0
    assert seconds < 30 + 90, out[-3000:]
    watchdog = [line for line in out.splitlines() if "watchdog: rank 0" in line]
    assert watchdog, out[-3000:]
    assert "rank 1: NOT RESPONDING" in watchdog[0] and "rank 0: alive" in watchdog[0]


STUCK_WORKER = '''
import os, sys, time
import torch.utils.data
import dataset, train

# Every item a worker loads, plain or planned (augmented), is read by _item.
real_item = dataset.LocalShardDataset._item
calls = 0

def stuck_after_four_items(self, i, *args, **kwargs):
    """Rank 1's DataLoader worker stops delivering after its first items, as a worker that
    deadlocked or waits on a dead file system would."""
    global calls
    if os.environ["RANK"] == "1" and torch.utils.data.get_worker_info() is not None:
        calls += 1
        if calls > 4:
            time.sleep(3600)
    return real_item(self, i, *args, **kwargs)

dataset.LocalShardDataset._item = stuck_after_four_items
sys.exit(train.main([]))
'''


def test_a_stuck_dataloader_worker_is_shown_with_its_stack_by_its_ranks_watchdog(job_env):
    root, env, _ = job_env
    script = root / "stuck_worker.py"
    script.write_text(STUCK_WORKER)
    log = root / "stuck_worker.log"
    proc = subprocess.Popen(
        torchrun_command(script),
        cwd=REPO,
        env={**env, "MAX_STEPS": "100000", "DATA_DIR": str(root / "w"), "WATCHDOG_SECONDS": "8"},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    workers_state = ""
    try:
        wait_for("watchdog: rank 1", log, proc, timeout=120)
        # The watchdog repeats its report every WATCHDOG_SECONDS while the stall lasts: on a loaded
        # machine the first one can come before the worker reached its stuck item.
        deadline = time.monotonic() + 60
        while "in stuck_after_four_items" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        workers_state = "\n".join(
            f"{pid}: {process_state(pid)}" for pid in WORKER_PIDS.findall(log.read_text())
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = log.read_text()
    report = out[out.index("watchdog: rank 1") :]
    assert "_try_get_data" in report  # the rank itself waits on its DataLoader
    assert "every thread of this rank, then each of its DataLoader workers (pids " in report
    worker = report[report.index("prints its stack next") :]
    assert "in stuck_after_four_items" in worker and "in _worker_loop" in worker, (
        f"workers named in the reports, as /proc shows them:\n{workers_state}\n"
        f"the log from rank 1's first report on:\n{report[-12000:]}"
    )


WORKER_PIDS = re.compile(r"DataLoader workers \(pids ([0-9]+)")


def process_state(pid: str) -> str:
    """State, blocked and caught signals of a live process, for a failure message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "gone"
    return " ".join(
        line for line in lines if line.startswith(("State", "SigBlk", "SigCgt", "PPid"))
    )
