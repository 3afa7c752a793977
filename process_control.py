"""The signals a training job answers, and the lifetime of its processes.

- ``install_stop_handlers``: SIGTERM and SIGUSR1 (what SLURM sends before a preemption or the time
  limit; torchrun forwards SIGTERM, and SIGUSR1 when TORCHELASTIC_SIGNALS_TO_HANDLE lists it) ask the
  run to stop. While training runs, the request is only recorded (``stop_requested``): the ranks agree
  on it at the next optimizer-step boundary, save an exact checkpoint and exit with
  ``PREEMPTED_EXIT_CODE``. Before training starts there is nothing to save, and the process exits at
  once with that code.
- ``die_with_parent``: the kernel kills this process when its parent dies, however the parent dies
  (even SIGKILL). Ranks call it with torchrun's agent as the parent, so no orphan trains on after its
  launcher is gone; the training cache's workers call it with their builder.
- ``UserError`` and ``report_user_error``: an error the user causes and can fix (a bad knob, a
  missing manifest, unreadable audio, a checkpoint that cannot be saved) ends the job with one line on
  rank 0 (``error: <what is wrong, which variable or path, what to do>``), nothing from the other
  ranks, exit code ``USER_ERROR_EXIT_CODE``, and torchrun's failure summary naming it as the root
  cause. ``exit_on_user_errors`` does the same for errors raised while modules are imported (a bad
  knob is found when config.py is imported).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

log = logging.getLogger("process_control")

# EX_TEMPFAIL (sysexits.h): the run saved its state and stopped on request; run it again to continue.
PREEMPTED_EXIT_CODE = 75
USER_ERROR_EXIT_CODE = 2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_requested: str | None = None
_training = False


def install_stop_handlers() -> None:
    """Route SIGTERM and SIGUSR1 to ``_on_stop_signal`` (call from the main thread)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def _on_stop_signal(signum, frame) -> None:
    global _requested
    name = signal.Signals(signum).name
    if not _training:
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


def report_user_error(exc: BaseException) -> int:
    """Rank 0 prints ``error: <message>``; every rank records it for torchrun's failure summary.
    Returns USER_ERROR_EXIT_CODE."""
    _record_for_torchrun(exc)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
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

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, USER_ERRORS):
            code = report_user_error(exc)
            sys.stderr.flush()
            os._exit(code)
        _record_for_torchrun(exc)
        default(exc_type, exc, tb)

    sys.excepthook = hook
