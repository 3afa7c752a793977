"""process_control's stack dumps: SIGUSR2 prints a process's threads and it goes on; a rank's
watchdog has its forked helpers (DataLoader workers) print theirs, and never signals a process that
is not one of its own forks (SIGUSR2 would end it)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time

import process_control


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
