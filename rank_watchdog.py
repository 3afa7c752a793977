"""A watchdog thread per rank that says which rank stopped and where this one waits.

After ``seconds`` (WATCHDOG_SECONDS) without progress (a finished micro-batch, reported through
``alive``), the rank logs where its main thread waits (a collective, the DataLoader, a save) and what
every rank last told the process group's store: the thread writes its rank's step and last progress
there every ``period`` seconds, so a rank that stopped answering (SIGSTOP, a stuck file system, a
dead node) is named as such, apart from ranks that are alive and waiting. Every thread of the rank,
then each of its DataLoader workers (``process_control.add_helpers``), prints its stack to stderr:
a rank that waits on its DataLoader shows where its workers are stuck. Repeated every ``seconds``
while it lasts; the job itself ends at COLLECTIVE_TIMEOUT_MINUTES. Single process: no store, the
report says so.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback

import process_control

log = logging.getLogger("rank_watchdog")


def default_store():
    """The default process group's key-value store, or None (single process, no store)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:
        pass
    return None


class RankWatchdog:
    """The watchdog of one rank; ``seconds`` <= 0 turns it off."""

    def __init__(self, seconds: int):
        self.seconds = int(seconds)
        self.period = max(0.5, min(2.0, self.seconds / 4))
        self._last = time.monotonic()
        self._last_wall = time.time()
        self._step = 0
        self._stop: threading.Event | None = None
        self._store = None
        self._rank = 0
        self._world = 1

    def start(self, rank: int, world_size: int, step: int) -> None:
        """Start the thread (at the start of training) watching the calling thread."""
        if self.seconds <= 0:
            return
        self._rank, self._world, self._step = rank, world_size, step
        # Counted from here: a rank stuck before its first micro-batch is reported too.
        self._last, self._last_wall = time.monotonic(), time.time()
        self._store = default_store()
        self._stop = threading.Event()
        main = threading.main_thread()
        threading.Thread(target=self._watch, args=(main,), name="watchdog", daemon=True).start()

    def alive(self, step: int) -> None:
        """The rank made progress; ``step`` is its optimizer step now."""
        self._last, self._last_wall = time.monotonic(), time.time()
        self._step = step

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _pulse(self) -> None:
        if self._store is None:
            return
        try:
            self._store.set(
                f"watchdog/{self._rank}", f"{self._step} {self._last_wall:.3f} {time.time():.3f}"
            )
        except Exception:  # the store is gone (the job is ending): nothing to report to
            self._store = None

    def ranks_report(self) -> str:
        """Every rank's state from the store, the ranks that stopped answering first."""
        if self._store is None:
            return "no other ranks (single process)"
        now = time.time()
        rows = []
        for rank in range(self._world):
            key = f"watchdog/{rank}"
            try:
                if not self._store.check([key]):
                    rows.append((0, 0.0, f"rank {rank}: never reported"))
                    continue
                step, progress, pulse = self._store.get(key).decode().split()
            except Exception as exc:
                return f"rank states unavailable ({exc})"
            silent = now - float(pulse)
            idle = now - float(progress)
            if silent > 3 * self.period:
                rows.append(
                    (0, -silent, f"rank {rank}: NOT RESPONDING for {silent:.0f} s (step {step})")
                )
            else:
                rows.append(
                    (1, -idle, f"rank {rank}: alive, no progress for {idle:.0f} s (step {step})")
                )
        rows.sort()
        return "; ".join(text for _, _, text in rows[:8]) + (
            f" (+{len(rows) - 8} more)" if len(rows) > 8 else ""
        )

    def _watch(self, main: threading.Thread) -> None:
        while not self._stop.wait(self.period):
            self._pulse()
            idle = time.monotonic() - self._last
            if idle < self.seconds:
                continue
            frame = sys._current_frames().get(main.ident)
            where = "".join(traceback.format_stack(frame, limit=6)) if frame else "unknown"
            helpers = process_control.live_helpers()
            log.warning(
                "watchdog: rank %d has finished no micro-batch for %.0f s (optimizer step %d); %s; "
                "this rank waits in:\n%severy thread of this rank%s prints its stack next",
                self._rank,
                idle,
                self._step,
                self.ranks_report(),
                where,
                f", then each of its DataLoader workers (pids {', '.join(map(str, helpers))}),"
                if helpers
                else "",
            )
            # The main thread's wait can be another thread's doing (a queue's feeder thread, a
            # save), and a DataLoader wait a worker's: their stacks say which.
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            process_control.dump_helper_stacks(helpers)
            self._last = time.monotonic()  # report again after another WATCHDOG_SECONDS
