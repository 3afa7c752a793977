"""scripts/launch.py: torchrun whose deliberate ends (a user error, a saved stop) finish on the run's own
line and exit status, while a crash keeps torchrun's whole summary; every stop signal saves, and a
stack-dump request (SIGUSR2, scripts/dump_stacks.py) leaves the job training."""

from __future__ import annotations

import linecache
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts import launch
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import child_pids, free_port, tiny_train_env

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def launch_command(script: Path) -> list[str]:
    return [
        sys.executable,
        str(REPO / "scripts" / "launch.py"),
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
    ]


def failure(rank: int, exitcode: int, timestamp: int, message="") -> SimpleNamespace:
    return SimpleNamespace(local_rank=rank, exitcode=exitcode, timestamp=timestamp, message=message)


def test_only_a_user_error_or_a_saved_stop_with_ranks_stopped_after_it_counts_as_clean():
    assert launch.clean_exit({0: failure(0, 2, 5), 1: failure(1, -signal.SIGTERM, 6)}) == 2
    assert launch.clean_exit({0: failure(0, 75, 5), 1: failure(1, 75, 5)}) == 75
    assert launch.clean_exit({0: failure(0, 1, 5), 1: failure(1, -signal.SIGTERM, 6)}) is None
    assert launch.clean_exit({0: failure(0, 2, 5), 1: failure(1, -signal.SIGKILL, 6)}) is None
    assert launch.clean_exit({0: failure(0, -signal.SIGSEGV, 4), 1: failure(1, 2, 5)}) is None


def test_a_rank_stopped_in_the_same_second_as_the_user_error_is_not_taken_for_the_root_cause():
    # torchrun records failure times in whole seconds: rank 1 refused a setting and rank 0, stopped
    # by torchrun's SIGTERM in that second, has the lower rank number
    failures = {
        0: failure(0, -signal.SIGTERM, 5),
        1: failure(1, 2, 5, {"message": "ConfigError: GRAD_ACCUM='four'", "extraInfo": {}}),
    }
    assert launch.clean_exit(failures) == 2
    assert launch.error_line(failures) == "error: GRAD_ACCUM='four'"
    # a stop a second earlier than any exit of its own is a rank killed from outside: not clean
    assert launch.clean_exit({0: failure(0, -signal.SIGTERM, 4), 1: failure(1, 2, 5)}) is None


def test_the_stop_signals_are_always_handed_to_torchrun_and_the_stack_dump_signal_never():
    assert launch.signals_to_handle("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == (
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    )
    assert launch.signals_to_handle("SIGUSR2, SIGTERM") == "SIGTERM,SIGUSR1,SIGINT"


def test_a_stop_landing_before_torchs_metrics_clock_starts_reaches_the_agent_a_moment_later():
    """torch's metrics wrapper binds ``start`` inside its try; a SignalException raised before that
    turns into UnboundLocalError in its finally and the agent stops the ranks with SIGTERM. The
    signal must instead reach torchrun's handler once the wrapper has run."""
    from torch.distributed.elastic.metrics.api import prof
    from torch.distributed.elastic.multiprocessing import api as torchrun_processes

    @prof
    def monitor_once():
        return "monitored"

    handle = launch.stop_once(torchrun_processes._terminate_process_handler)
    landed = []

    def land_the_signal_before_start_is_bound(frame, event, arg):
        code = frame.f_code
        source = linecache.getline(code.co_filename, frame.f_lineno).strip()
        if (
            event == "line"
            and not landed
            and source.startswith("start = ")
            and "start" not in frame.f_locals
        ):
            landed.append(frame.f_lineno)
            handle(signal.SIGUSR1, frame)  # as if SLURM's USR1 arrived on this line
        return land_the_signal_before_start_is_bound

    def trace_the_wrapper(frame, event, arg):
        if frame.f_code is monitor_once.__code__:
            return land_the_signal_before_start_is_bound
        return None

    previous = signal.signal(signal.SIGUSR1, handle)
    try:
        sys.settrace(trace_the_wrapper)
        try:
            result = monitor_once()
        finally:
            sys.settrace(None)
        assert landed, "the trace never reached the wrapper's `start = ...` line"
        assert result == "monitored"
        with pytest.raises(torchrun_processes.SignalException) as raised:
            time.sleep(5)
        assert raised.value.sigval == signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_error_line_is_the_root_causes_message_as_the_rank_printed_it():
    recorded = {"message": "TooLittleData: raise EPOCH_SIZE", "extraInfo": {}}
    assert launch.error_line({1: failure(1, 2, 9), 0: failure(0, 2, 5, recorded)}) == (
        "error: raise EPOCH_SIZE"
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_training_data(tmp_path_factory.mktemp("launch"), per_lang=4)


def test_a_user_error_under_torchrun_ends_on_its_one_line_and_exit_2(data, tmp_path):
    # GRAD_ACCUM 4 x 2 ranks on an epoch of one batch: train.py refuses it on every rank
    env = tiny_train_env(data, DATA_DIR=str(tmp_path), GRAD_ACCUM="4", MAX_BATCH_DURATION="90")
    result = subprocess.run(
        launch_command(REPO / "train.py"), env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: an epoch of "), result.stderr[-3000:]
    assert result.stderr.count("error: ") == 1, result.stderr[-3000:]
    assert "micro-batches, fewer than the 8 of one optimizer step" in last
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


def test_a_bad_knob_prints_its_error_line_once_and_last(data, tmp_path):
    env = tiny_train_env(data, DATA_DIR=str(tmp_path), GRAD_ACCUM="four")
    result = subprocess.run(
        launch_command(REPO / "train.py"), env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error: " in line]
    assert errors == ["error: invalid configuration: GRAD_ACCUM='four': expected an integer"], (
        result.stderr[-3000:]
    )
    assert result.stderr.strip().splitlines()[-1] == errors[0]


def test_a_crash_keeps_torchruns_summary_and_traceback(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('a real bug')\n")
    result = subprocess.run(
        launch_command(crash), capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert result.returncode == 1
    assert "ChildFailedError" in result.stderr and "a real bug" in result.stderr


def start_training(data: dict, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A launch.py job of train.py that trains until stopped, once its first checkpoint is written."""
    env = tiny_train_env(
        data, DATA_DIR=str(tmp_path), MAX_STEPS="100000", GRAD_ACCUM="1", CHECKPOINT_EVERY="5"
    )
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        job = subprocess.Popen(
            launch_command(REPO / "train.py"),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for_checkpoint(job, tmp_path / "checkpoints", log, after=0)
    return job, log


def wait_for_checkpoint(job: subprocess.Popen, checkpoints: Path, log: Path, after: int) -> int:
    """The number of checkpoints once there are more than ``after``; the job killed if it ends or
    none comes in 240 s."""
    deadline = time.monotonic() + 240
    while len(list(checkpoints.glob("step_*.ckpt"))) <= after:
        if job.poll() is not None or time.monotonic() > deadline:
            stop(job)
            pytest.fail(f"no new checkpoint (exit {job.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return len(list(checkpoints.glob("step_*.ckpt")))


def stop(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)  # the ranks die with the launcher (PR_SET_PDEATHSIG)
        job.wait()


def test_ctrl_c_ends_on_one_stopped_line_and_exit_75_after_the_ranks_saved(data, tmp_path):
    job, log = start_training(data, tmp_path)
    try:
        os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the group
        assert job.wait(timeout=180) == 75
    finally:
        stop(job)
    text = log.read_text()
    assert (
        text.strip().splitlines()[-1].startswith("stopped by SIGINT: every rank was told to save")
    )
    assert "Traceback" not in text and "SignalException" not in text
    assert "stop signal: saved" in text  # the ranks saved the step they were in


def test_sigusr1_even_repeated_has_every_rank_save_before_the_launcher_exits_75(data, tmp_path):
    # SLURM's warning before the time limit. Under srun it reaches the launcher more than once: SLURM
    # signals every process of the step, and srun and slurm_train.sh pass it on too.
    job, log = start_training(data, tmp_path)
    try:
        for _ in range(3):
            job.send_signal(signal.SIGUSR1)  # the launcher only
            time.sleep(0.02)
        assert job.wait(timeout=180) == 75, log.read_text()[-3000:]
    finally:
        stop(job)
    lines = log.read_text().strip().splitlines()
    assert lines[-1].startswith("stopped by SIGUSR1: every rank was told to save"), lines[-20:]
    saved = [line for line in lines if "stopped on SIGUSR1 after saving optimizer step" in line]
    assert len(saved) == 2, lines[-20:]  # both ranks, written before the launcher's last line


@pytest.fixture(scope="module")
def training_job(data, tmp_path_factory):
    """One launch.py job that trains on while the stack-dump tests poke it, then stops saved."""
    tmp_path = tmp_path_factory.mktemp("stacks")
    job, log = start_training(data, tmp_path)
    try:
        yield job, log, tmp_path / "checkpoints"
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=180) == 75, log.read_text()[-3000:]
    finally:
        stop(job)


def test_sigusr2_to_the_launcher_leaves_the_job_training(training_job):
    job, log, checkpoints = training_job
    before = len(list(checkpoints.glob("step_*.ckpt")))
    job.send_signal(signal.SIGUSR2)  # what `kill -USR2` on every pid `pgrep -f train.py` lists does
    wait_for_checkpoint(job, checkpoints, log, after=before)  # fails if the job ended
    assert "launch.py: SIGUSR2 ignored" in log.read_text()


def test_dump_stacks_signals_each_rank_and_worker_once_and_never_the_launcher(training_job):
    job, log, checkpoints = training_job
    ranks = child_pids(job.pid)
    workers = [w for r in ranks for w in child_pids(r) if cmdline(w) == cmdline(r)]
    assert len(ranks) == 2 and len(workers) == 2  # NUM_WORKERS=1
    script = [sys.executable, str(REPO / "scripts" / "dump_stacks.py"), str(job.pid)]
    listed = subprocess.run(script + ["--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert pids_in(listed.stdout) == sorted(ranks + workers), listed.stdout

    before = stacks_in(log.read_text())
    done = subprocess.run(script + ["--pause", "0.2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and pids_in(done.stdout) == sorted(ranks + workers), done.stdout
    wait_for_checkpoint(job, checkpoints, log, after=len(list(checkpoints.glob("step_*.ckpt"))))
    after = stacks_in(log.read_text())  # training went on, and each process printed its stack
    assert (after[0] - before[0], after[1] - before[1]) == (4, 2), log.read_text()[-3000:]


def stacks_in(text: str) -> tuple[int, int]:
    """Stacks printed by processes running train.py (a main thread's first frame) and, of them,
    by DataLoader workers."""
    return len(re.findall(r'train\.py", line \d+ in <module>', text)), text.count("in _worker_loop")


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def pids_in(listing: str) -> list[int]:
    return sorted(int(line.split()[1]) for line in listing.splitlines() if line.startswith("pid "))
