"""process_control's stack dumps: SIGUSR2 prints a process's threads and it goes on; a rank's
watchdog has its forked helpers (DataLoader workers) print theirs, and never signals a process that
is not one of its own forks (SIGUSR2 would end it). scripts/dump_stacks.py signals only the processes
that answer it (tests/test_launch.py runs it on a real job)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import process_control

REPO = Path(__file__).resolve().parents[1]


def sleeping_helper() -> None:
    time.sleep(60)


def test_a_forked_helper_prints_its_stack_on_request_and_lives_on(capfd):
    process_control.install_stack_dump()
    helper = multiprocessing.get_context("fork").Process(target=sleeping_helper, daemon=True)
    helper.start()
    try:
        time.sleep(0.5)  # in sleeping_helper by now
        process_control.add_helpers([helper.pid])
        assert process_control.live_helpers() == [helper.pid]
        assert process_control.dump_helper_stacks(pause=0.5) == [helper.pid]
        err = capfd.readouterr().err
        assert "in sleeping_helper" in err, err
        assert helper.is_alive()
    finally:
        helper.kill()
        helper.join()
    assert helper.pid not in process_control.live_helpers()  # a helper gone is forgotten


def test_a_child_running_another_program_or_a_foreign_pid_is_never_signalled():
    process_control.install_stack_dump()
    other_program = subprocess.Popen(["sleep", "30"])
    try:
        process_control.add_helpers([other_program.pid, os.getppid()])
        assert process_control.live_helpers() == []
        assert process_control.dump_helper_stacks() == []
        assert other_program.poll() is None  # SIGUSR2 would have ended it
    finally:
        other_program.kill()
        other_program.wait()


def test_dump_stacks_knows_a_rank_from_its_launchers_by_the_script_python_runs():
    from scripts.dump_stacks import script_of

    python = "/venv/bin/python"
    assert script_of([python, "-u", "/repo/train.py", "--flag"]) == "train.py"  # a rank
    assert script_of([python, "-X", "dev", "train.py"]) == "train.py"
    assert script_of([python, "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py"]) == (
        "torchrun"
    )
    assert script_of([python, "-m", "torch.distributed.run", "train.py"]) is None
    assert script_of([python, "scripts/launch.py", "--nproc_per_node", "2", "train.py"]) == (
        "launch.py"
    )
    assert script_of(["bash", "scripts/slurm_train.sh"]) is None


def test_dump_stacks_finds_only_processes_that_answer_sigusr2(tmp_path):
    from scripts.dump_stacks import find_processes

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, time\n"
        "import process_control\n"
        "if sys.argv[1:] == ['dumps']:\n"
        "    process_control.install_stack_dump()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        for args in (["dumps"], [])
    ]
    try:
        for proc in procs:
            assert proc.stdout.readline() == "ready\n"
        found = {p.pid: p.answers for p in find_processes("train.py", {p.pid for p in procs})}
        assert found == {procs[0].pid: True, procs[1].pid: False}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
