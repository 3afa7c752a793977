"""torchrun, ending on one line where the run ended cleanly: a user error or a saved stop.

Usage (the arguments are torchrun's, unchanged):
    python scripts/launch.py --nproc_per_node 8 train.py
    python scripts/launch.py --nproc_per_node 8 scripts/preflight.py

torchrun prints a Python traceback and a failure summary of about 25 lines whenever a rank exits
non-zero (``ChildFailedError``) or torchrun itself receives a signal (``SignalException``), even
when train.py ended on purpose: a setting it refused (one ``error: ...`` line, exit 2) or a stop
signal after which every rank saved its step (exit 75). Here, in those two cases, the last line is
the run's own: ``error: <what is wrong and what to do>``, or ``stopped: ...``, with the same exit
status. Anything else (a crash, a rank killed, an exit status the project does not use) keeps
torchrun's whole summary and traceback, so a real failure is never hidden.

After a stop signal (SIGINT, SIGTERM, SIGUSR1) torchrun passes it to every rank and waits
``--shutdown-timeout`` seconds for them; each rank saves its step and exits 75, saying so in its own
lines. The exit status here is then 75. Those three are handled whatever ``--signals-to-handle``
says (torchrun's default leaves out SIGUSR1, SLURM's warning before the time limit, which would end
the launcher and every rank with it, unsaved), and a second stop signal while the ranks save is
ignored (SLURM signals every process of a step, and srun and slurm_train.sh forward the signal too:
torchrun would otherwise stop waiting for the save). SIGUSR2 asks a process for its stacks: the
ranks and their DataLoader workers print theirs; this launcher has none to show and goes on
(``python scripts/dump_stacks.py`` signals the ranks).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from process_control import (
    LAUNCHER_PRINTS_ERRORS,
    PREEMPTED_EXIT_CODE,
    STACK_DUMP_SIGNAL,
    STOP_SIGNALS,
    USER_ERROR_EXIT_CODE,
)

CLEAN_EXITS = (USER_ERROR_EXIT_CODE, PREEMPTED_EXIT_CODE)


def root_cause(failures: dict):
    """The failure that ended the run: the earliest. Failure times are whole seconds, so a rank
    torchrun stopped with SIGTERM after another's exit usually shares that rank's second; within a
    second, a rank that ended by itself comes before one that was stopped."""
    return min(
        failures.values(),
        key=lambda f: (f.timestamp, f.exitcode == -signal.SIGTERM, f.local_rank),
    )


def clean_exit(failures: dict) -> int | None:
    """The exit status a group of failed ranks (``ChildFailedError.failures``: rank -> ProcessFailure)
    ended with when that end was deliberate, else None. Deliberate: the root cause exited 2 or 75,
    and every other rank did too or was stopped by torchrun with SIGTERM after it."""
    if not failures:
        return None
    first = root_cause(failures)
    if first.exitcode not in CLEAN_EXITS:
        return None
    others_ok = all(
        f.exitcode in CLEAN_EXITS or f.exitcode == -signal.SIGTERM for f in failures.values()
    )
    return first.exitcode if others_ok else None


def error_line(failures: dict) -> str:
    """``error: <message>`` of the root cause, as the rank printed it (its recorded message without
    the exception's class name), or a line naming the ranks when none was recorded."""
    first = root_cause(failures)
    message = first.message
    if isinstance(message, dict):  # the error file's form (process_control records it so)
        message = message.get("message")
    if isinstance(message, str) and message and not message.startswith("To enable traceback"):
        head, sep, rest = message.partition(": ")
        return f"error: {rest if sep and head.isidentifier() else message}"
    return f"error: rank {first.local_rank} exited {first.exitcode} (its error line is above)"


def signals_to_handle(requested: str) -> str:
    """torchrun's ``--signals-to-handle`` value: ``requested`` with every stop signal added and the
    stack-dump signal left out (torchrun would take it for a stop and end the ranks)."""
    names = [name.strip() for name in requested.split(",") if name.strip()]
    names += [sig.name for sig in STOP_SIGNALS if sig.name not in names]
    return ",".join(name for name in names if name != STACK_DUMP_SIGNAL.name)


REDELIVERY_DELAY_S = 0.01


def before_its_clock_starts(frame) -> bool:
    """Whether an exception raised in ``frame`` now would end in torch's metrics wrapper
    (``torch.distributed.elastic.metrics.prof``) before it has bound ``start``: its ``finally``
    then fails with UnboundLocalError, which replaces the SignalException, and the agent stops
    the ranks with SIGTERM, not the signal received, and exits 1 with a traceback. The monitor
    loop enters that wrapper ten times a second, so a stop signal lands there now and then."""
    while frame is not None:
        code = frame.f_code
        if (
            code.co_name == "wrapper"
            and code.co_filename.replace(os.sep, "/").endswith("elastic/metrics/api.py")
            and "start" in code.co_varnames
            and "start" not in frame.f_locals
        ):
            return True
        frame = frame.f_back
    return False


def stop_once(handler):
    """torchrun's signal handler (it raises SignalException, and the agent then passes the signal to
    the ranks and waits for them), run for the first signal only: a later one would interrupt that
    wait, and the launcher's exit would kill the ranks (PR_SET_PDEATHSIG) before they saved. A
    signal arriving where raising would break torch's own bookkeeping (before_its_clock_starts) is
    sent again to this process a moment later, when the agent is back in its loop."""
    first: list[str] = []

    def handle(signum, frame):
        name = signal.Signals(signum).name
        if not first and before_its_clock_starts(frame):
            again = threading.Timer(REDELIVERY_DELAY_S, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        if first:
            os.write(
                2,
                f"launch.py: {name} ignored: the ranks are saving after {first[0]}; torchrun "
                f"waits for them up to its --shutdown-timeout\n".encode(),
            )
            return
        first.append(name)
        handler(signum, frame)

    return handle


def answer_stack_dump_request(signum, frame) -> None:
    # A handler, not SIG_IGN: an ignored signal stays ignored in the ranks torchrun execs, a handler
    # is reset there. os.write: this may run while the main thread is inside a print.
    os.write(
        2,
        f"launch.py: SIGUSR2 ignored: the launcher (pid {os.getpid()}) has no stacks to show; "
        f"`python scripts/dump_stacks.py` has each rank and DataLoader worker print theirs\n".encode(),
    )


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.elastic.multiprocessing.api as torchrun_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    args = parser.parse_args(argv)
    args.signals_to_handle = signals_to_handle(args.signals_to_handle)
    # torchrun installs this handler when it starts the ranks, looking it up by name then.
    torchrun_processes._terminate_process_handler = stop_once(
        torchrun_processes._terminate_process_handler
    )
    signal.signal(STACK_DUMP_SIGNAL, answer_stack_dump_request)
    os.environ[LAUNCHER_PRINTS_ERRORS] = "1"  # the ranks inherit it: rank 0 leaves the line to us
    try:
        run(args)
    except ChildFailedError as exc:
        code = clean_exit(exc.failures)
        if code is None:
            raise  # a real failure: torchrun's whole summary
        sys.stdout.flush()
        if code == USER_ERROR_EXIT_CODE:
            print(error_line(exc.failures), file=sys.stderr)
        else:
            print(
                f"stopped: every rank saved its step and exited {code}; RESUME_FROM=last continues "
                f"the run",
                file=sys.stderr,
            )
        return code
    except SignalException as exc:
        if exc.sigval not in STOP_SIGNALS:
            raise
        sys.stdout.flush()
        print(
            f"stopped by {exc.sigval.name}: every rank was told to save its step and exit "
            f"{PREEMPTED_EXIT_CODE} (their lines above say whether they did); RESUME_FROM=last "
            f"continues the run",
            file=sys.stderr,
        )
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
