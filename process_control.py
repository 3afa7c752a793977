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
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal

log = logging.getLogger("process_control")

# EX_TEMPFAIL (sysexits.h): the run saved its state and stopped on request; run it again to continue.
PREEMPTED_EXIT_CODE = 75
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


def reset() -> None:
    """Forget a received stop request (for a second run in the same process)."""
    global _requested, _training
    _requested, _training = None, False


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
