"""Launching the multi-process tests' jobs: a free loopback port, the torchrun command line, the
environment of a tiny CPU train.py run (with a DataLoader worker per rank, as real jobs have), the
state of the processes a job started, and signalling every process of a job as SLURM does."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

_jobs = itertools.count()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: Path, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` with ``nproc`` local ranks on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
    ]


def run_torchrun(
    script: Path, env: dict, cwd: Path, timeout: float, log_path: Path | None = None
) -> subprocess.CompletedProcess:
    """``script`` under torchrun with 2 local ranks, its output (stdout and stderr together)
    captured and written to ``log_path`` when given; a job still running after ``timeout`` seconds
    (a hang) is killed with every process it started and fails the test."""
    cmd = torchrun_command(script)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        dump_stacks(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if log_path is not None:
            log_path.write_text(out)
        pytest.fail(
            f"torchrun did not finish in {timeout:g} s (a hang?); log: {log_path}\n{out[-12000:]}"
        )
    if log_path is not None:
        log_path.write_text(out)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def tiny_train_env(data: dict, **knobs: str) -> dict:
    """The environment of a tiny train.py run on CPU over ``make_training_data``'s manifest and
    tokenizer, one DataLoader worker per rank, without W&B, a 60 s watchdog and a 2-minute
    collective timeout, plus ``knobs``; the caller's W&B,
    RESUME_FROM and PROBE_ variables are left out so the shell that runs the tests cannot change the
    job. Every process of the job carries PROBE_JOB (``job_processes`` finds them by it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "RESUME", "PROBE"))}
    env.update(
        PROBE_JOB=f"job-{os.getpid()}-{next(_jobs)}",
        ACCELERATOR="cpu",
        PRECISION="32-true",
        NUM_WORKERS="1",
        OMP_NUM_THREADS="1",
        INIT_MODEL="",
        TRAIN_MANIFEST_PATH=str(data["manifest"]),
        TOKENIZER_DIR=str(data["tokenizer"]),
        WARMUP_STEPS="1",
        PHASE2_WARMUP="1",
        MAX_BATCH_DURATION="6",
        BUCKET_BOUNDARIES="2",
        WANDB_MODE="disabled",
        # A tiny job that stops making progress says where each rank waits (the watchdog) and ends
        # with the collective's error, both well within the tests' time limits.
        WATCHDOG_SECONDS="60",
        COLLECTIVE_TIMEOUT_MINUTES="2",
    )
    env.update(knobs)
    return env


def dump_stacks(launcher: int, settle: float = 2.0) -> list[int]:
    """Have every process below the torchrun ``launcher`` (its ranks and what they forked: DataLoader
    workers) write all its threads' stacks to the job's log (SIGUSR2,
    ``process_control.install_stack_dump``), then wait ``settle`` seconds for them to be written;
    the pids signalled. torchrun's agent is left alone: SIGUSR2 would end it."""
    pids, todo = [], child_pids(launcher)
    while todo:
        pid = todo.pop()
        todo += child_pids(pid)
        if is_running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
                pids.append(pid)
    if pids:
        time.sleep(settle)
    return pids


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started that are still its children (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        out += [int(c) for c in task.read_text().split()]
    return out


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def job_processes(env: dict) -> list[int]:
    """Every live process of the job started with ``env`` (torchrun, ranks, DataLoader and cache
    workers, W&B's service): those whose environment holds its PROBE_JOB, as SLURM's cgroup holds a
    job's processes whatever their process group."""
    mark = f"PROBE_JOB={env['PROBE_JOB']}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if mark in (proc / "environ").read_bytes() and is_running(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def signal_every_process(env: dict, sig: int = signal.SIGTERM) -> list[int]:
    """Send ``sig`` to every process of the job at once, as SLURM does on scancel, preemption or the
    time limit; the pids signalled."""
    pids = job_processes(env)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids
