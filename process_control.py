"""The signals a training job answers, and the lifetime of its processes.

- ``install_stop_handlers``: SIGTERM, SIGUSR1 and SIGINT (what SLURM sends before a preemption or the
  time limit, scancel, Ctrl-C; torchrun forwards SIGTERM and SIGINT, and SIGUSR1 when
  TORCHELASTIC_SIGNALS_TO_HANDLE lists it) ask the run to stop. While training runs, the request is
  only recorded (``stop_requested``): the ranks agree on it at the next optimizer-step boundary, save
  an exact checkpoint and exit with ``PREEMPTED_EXIT_CODE``. Before training starts there is nothing
  to save, and the process exits at once with that code.
- Helper processes (DataLoader workers, the training cache's builders) leave stop signals to the
  process that started them: torchrun signals each rank's whole process group and SLURM every process
  of the job, and a helper that died of the signal would take its rank down before the save. The
  parent forks them inside ``stop_signals_blocked`` and each calls ``leave_stop_signals_to_parent``
  first thing, so no window is left in which a signal kills a helper; they still die with their
  parent (``die_with_parent``).
- ``install_stack_dump``: SIGUSR2 prints every thread's stack of the process to stderr (the job's
  log) and the run goes on; DataLoader workers forked after it answer it too.
  ``scripts/dump_stacks.py`` sends it to the ranks and workers of a job that seems to hang (never to
  torchrun's agent, which it would end), showing where each waits.
- ``die_with_parent``: the kernel kills this process when its parent dies, however the parent dies
  (even SIGKILL). Ranks call it with torchrun's agent as the parent, so no orphan trains on after its
  launcher is gone; helper processes call it with the process that started them.
- ``UserError`` and ``report_user_error``: an error the user causes and can fix (a bad knob, a
  missing manifest, unreadable audio, a checkpoint that cannot be saved) ends the job with one line on
  rank 0 (``error: <what is wrong, which variable or path, what to do>``; under scripts/launch.py the
  launcher prints it instead, as the job's last line), nothing from the other ranks, exit code
  ``USER_ERROR_EXIT_CODE``, and torchrun's failure summary naming it as the root cause.
  ``exit_on_user_errors`` does the same for errors raised while modules are imported (a bad knob is
  found when config.py is imported).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("process_control")

# EX_TEMPFAIL (sysexits.h): the run saved its state and stopped on request; run it again to continue.
PREEMPTED_EXIT_CODE = 75
USER_ERROR_EXIT_CODE = 2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_requested: str | None = None
_training = False
_owner: int | None = None  # the process that installed the handlers


def install_stop_handlers() -> None:
    """Route SIGTERM, SIGUSR1 and SIGINT to ``_on_stop_signal`` (call from the main thread)."""
    global _owner
    _owner = os.getpid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


STACK_DUMP_SIGNAL = signal.SIGUSR2
_helpers: set[int] = set()  # forked helpers that answer STACK_DUMP_SIGNAL (dump_helper_stacks)
_stack_dump_installed = False


def install_stack_dump() -> None:
    """SIGUSR2 writes the stack of every thread of this process (and of the processes it forks
    later, which inherit the handler) to stderr; nothing else happens."""
    global _stack_dump_installed
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    _stack_dump_installed = True


def add_helpers(pids) -> None:
    """Helper processes this process forked (DataLoader workers) whose stacks ``dump_helper_stacks``
    prints; ignored unless ``install_stack_dump`` ran, so that they answer the signal."""
    if _stack_dump_installed:
        _helpers.update(int(pid) for pid in pids)


def _is_own_fork(pid: int) -> bool:
    """Whether ``pid`` is a live child of this process running this program (forked, not exec'd):
    a recycled pid or a child that runs another program would end of SIGUSR2."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        same = Path(f"/proc/{pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return stat[0] != "Z" and int(stat[1]) == os.getpid() and same


def live_helpers() -> list[int]:
    """The helpers of ``add_helpers`` still running (forgetting those that are gone)."""
    for pid in [pid for pid in _helpers if not _is_own_fork(pid)]:
        _helpers.discard(pid)
    return sorted(_helpers)


def dump_helper_stacks(pids: list[int] | None = None, pause: float = 0.5) -> list[int]:
    """Have each helper in ``pids`` (default ``live_helpers()``) write its threads' stacks to stderr,
    one at a time (``pause`` seconds apart, so the dumps do not interleave); the pids signalled.
    For a rank that waits on its DataLoader, the workers' stacks say where they are stuck."""
    signalled = []
    for pid in live_helpers() if pids is None else pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_DUMP_SIGNAL)
            signalled.append(pid)
            time.sleep(pause)
    return signalled


def _on_stop_signal(signum, frame) -> None:
    global _requested
    if os.getpid() != _owner:
        return  # a forked helper that inherited the handler: its parent decides
    name = signal.Signals(signum).name
    if not _training:
        if _requested is not None:
            return  # exiting already: a second signal (torchrun's forward of the same stop, say)
            # must not interrupt the clean-up the first one started
        _requested = name
        log.warning("%s received before training started: exiting (nothing to save)", name)
        raise SystemExit(PREEMPTED_EXIT_CODE)
    if _requested is None:
        log.warning(
            "%s received: the ranks save a checkpoint at the end of this optimizer step, then exit "
            "with code %d",
            name,
            PREEMPTED_EXIT_CODE,
        )
    _requested = name


def set_training(active: bool) -> None:
    """Whether a stop signal is deferred to the next step boundary (True) or exits at once (False)."""
    global _training
    _training = active


def stop_requested() -> str | None:
    """The name of the stop signal this process received, or None."""
    return _requested


@contextlib.contextmanager
def stop_signals_blocked():
    """Hold the stop signals of the calling thread while helper processes are forked in this block:
    a child starts with them blocked until ``leave_stop_signals_to_parent``, and a signal that
    reaches this process meanwhile is delivered when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def leave_stop_signals_to_parent(parent: int | None = None, but: tuple = ()) -> None:
    """In a helper process: ignore the stop signals (its parent saves and ends the job, and ends it
    with it), those in ``but`` excepted (they keep their default action), and die when ``parent``
    (default: the current parent) dies."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL if sig in but else signal.SIG_IGN)
    # A stop signal sent to this helper since the fork was held (the mask is inherited): discarded now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_parent(parent)


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (default: the current parent) dies.

    Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op. Exits at once when the parent is already
    gone, which closes the race between reading the parent and arming the signal.
    """
    import ctypes

    parent = os.getppid() if parent is None else parent
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


class UserError(Exception):
    """An error the user causes and can fix; its message says what, which variable or path, and what
    to do. Reported as one line (``report_user_error``), never as a traceback."""


USER_ERRORS = (UserError, FileNotFoundError)


# Set by scripts/launch.py for the ranks it starts: it prints the root cause's ``error:`` line itself,
# as the job's last line, so rank 0 only records it (printed by both, the line came twice).
LAUNCHER_PRINTS_ERRORS = "LAUNCHER_PRINTS_ERRORS"


def report_user_error(exc: BaseException) -> int:
    """Rank 0 prints ``error: <message>`` (unless its launcher prints it: LAUNCHER_PRINTS_ERRORS);
    every rank records it for torchrun's failure summary. Returns USER_ERROR_EXIT_CODE."""
    if int(os.environ.get("RANK", "0")) == 0:
        _record_for_torchrun(exc)
        if not os.environ.get(LAUNCHER_PRINTS_ERRORS):
            print(f"error: {exc}", file=sys.stderr, flush=True)
    else:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # Every rank meets the same error at about the same moment, and torchrun's summary names
            # the earliest recorded one (to the second) as the root cause: rank 0's record and line
            # come first. An error of this rank alone is still recorded, 2 s later.
            time.sleep(2.0)
        _record_for_torchrun(exc)
    return USER_ERROR_EXIT_CODE


def _record_for_torchrun(exc: BaseException) -> None:
    """Write ``exc`` where torchrun's agent reads a failed rank's error (TORCHELASTIC_ERROR_FILE), in
    its format; the earliest failure is the summary's root cause. A user error is recorded as its
    message, anything else with its traceback."""
    import json
    import time
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = f"{type(exc).__name__}: {exc}"
    detail = (
        text
        if isinstance(exc, USER_ERRORS)
        else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    data = {
        "message": {
            "message": text,
            "extraInfo": {"py_callstack": detail, "timestamp": str(int(time.time()))},
        }
    }
    with contextlib.suppress(OSError), open(path, "w") as fh:
        json.dump(data, fh)


def exit_on_user_errors() -> None:
    """Report a UserError (or FileNotFoundError) that escapes to the top as one line and exit with
    USER_ERROR_EXIT_CODE; any other exception keeps its traceback."""
    default = sys.excepthook
    if getattr(default, "reports_user_errors", False):
        return  # installed already

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, USER_ERRORS):
            code = report_user_error(exc)
            sys.stderr.flush()
            os._exit(code)
        _record_for_torchrun(exc)
        default(exc_type, exc, tb)

    hook.reports_user_errors = True
    sys.excepthook = hook
