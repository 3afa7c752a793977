"""Where is my job? Have every rank of your train.py jobs on this node, and each rank's DataLoader
workers, print every thread's stack to the job's log; the job trains on.

Usage (on the node the job runs on):
    python scripts/dump_stacks.py              # signal them, one at a time; says which and where to look
    python scripts/dump_stacks.py --list       # only list them
    python scripts/dump_stacks.py 4711         # only the job of launcher (or torchrun, or rank) 4711

A process is signalled (SIGUSR2) only when it runs the script, belongs to you and answers SIGUSR2
with its stacks (``process_control.install_stack_dump``, which every rank installs at start-up and its
DataLoader workers inherit). So torchrun's agent and ``scripts/launch.py`` are never signalled (the
agent would die of it, and every rank with it), nor is a rank still importing its modules. The
processes are signalled one after the other, ``--pause`` seconds apart, so their stacks do not
interleave in the log.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from process_control import STACK_DUMP_SIGNAL

PROC = Path("/proc")
# The interpreter's options that take the next argument as their value (python -X dev train.py).
PYTHON_OPTIONS_WITH_VALUE = {"-X", "-W", "--check-hash-based-pycs"}


@dataclass
class JobProcess:
    pid: int
    parent: int
    rank: str  # RANK of its environment ("" when started without torchrun)
    answers: bool  # whether it catches SIGUSR2 now
    stderr: str  # where its stacks go


def script_of(cmdline: list[str]) -> str | None:
    """The file name of the Python script a command line runs (``python -u /x/train.py --a`` ->
    ``train.py``), or None when it runs a module (``-m``), a command (``-c``) or no Python at all."""
    if not cmdline or not Path(cmdline[0]).name.startswith("python"):
        return None
    args = iter(cmdline[1:])
    for arg in args:
        if arg.startswith(("-m", "-c")):
            return None
        if arg in PYTHON_OPTIONS_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-"):
            return Path(arg).name
    return None


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt of /proc/<pid>/status)."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def read_process(pid: int, script: str) -> JobProcess | None:
    """``pid`` as a JobProcess when it is one of this user's processes running ``script``."""
    path = PROC / str(pid)
    try:
        if path.stat().st_uid != os.getuid():
            return None
        cmdline = [a.decode(errors="replace") for a in (path / "cmdline").read_bytes().split(b"\0")]
        if script_of(cmdline[:-1] if cmdline[-1:] == [""] else cmdline) != script:
            return None
        stat = (path / "stat").read_text().rsplit(")", 1)[1].split()
        if stat[0] == "Z":
            return None
        environ = dict(
            item.decode(errors="replace").partition("=")[::2]
            for item in (path / "environ").read_bytes().split(b"\0")
            if b"=" in item
        )
        try:
            stderr = os.readlink(path / "fd" / "2")
        except OSError:
            stderr = "?"
        return JobProcess(
            pid, int(stat[1]), environ.get("RANK", ""), catches(pid, STACK_DUMP_SIGNAL), stderr
        )
    except (OSError, IndexError, ValueError):
        return None  # gone meanwhile, or not ours to read


def parent_of(pid: int) -> int:
    try:
        return int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def descends_from(pid: int, roots: set[int]) -> bool:
    while pid > 1:
        if pid in roots:
            return True
        pid = parent_of(pid)
    return False


def find_processes(script: str = "train.py", roots: set[int] | None = None) -> list[JobProcess]:
    """This user's processes on this node that run ``script`` (ranks and their forked DataLoader
    workers), limited to ``roots`` and what they started when given, sorted by pid."""
    found = []
    for path in PROC.iterdir():
        if not path.name.isdigit() or int(path.name) == os.getpid():
            continue
        proc = read_process(int(path.name), script)
        if proc is not None and (not roots or descends_from(proc.pid, roots)):
            found.append(proc)
    return sorted(found, key=lambda p: p.pid)


def describe(proc: JobProcess, by_pid: dict[int, JobProcess]) -> str:
    parent = by_pid.get(proc.parent)
    rank = f"rank {proc.rank}" if proc.rank else "single process"
    role = f"forked by pid {parent.pid} ({rank}): a DataLoader worker" if parent else rank
    return f"pid {proc.pid:>7}  {role:<50} stderr: {proc.stderr}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "pids",
        nargs="*",
        type=int,
        help="only these processes and those they started: a launch.py, torchrun or rank pid "
        "(default: every job of yours on this node)",
    )
    parser.add_argument("--list", action="store_true", help="list the processes, signal none")
    parser.add_argument(
        "--script",
        default="train.py",
        help="the file name of the script the ranks run, for a train.py wrapper (default: train.py)",
    )
    parser.add_argument(
        "--pause",
        type=float,
        default=0.5,
        help="seconds between two processes, so that their stacks do not interleave (0.5)",
    )
    args = parser.parse_args(argv)

    found = find_processes(args.script, set(args.pids) or None)
    answering = [p for p in found if p.answers]
    by_pid = {p.pid: p for p in found}
    starting = len(found) - len(answering)
    if starting:
        print(
            f"{starting} {args.script} process(es) do not answer {STACK_DUMP_SIGNAL.name} yet "
            f"(still starting up): left alone"
        )
    if not answering:
        where = f" under pid {', '.join(map(str, args.pids))}" if args.pids else ""
        print(
            f"no {args.script} process of yours on this node{where} answers "
            f"{STACK_DUMP_SIGNAL.name}: run this on the node the job runs on",
            file=sys.stderr,
        )
        return 1
    verb = "would signal" if args.list else "signalling"
    print(f"{verb} {len(answering)} process(es) with {STACK_DUMP_SIGNAL.name}:", flush=True)
    for proc in answering:
        if not args.list:
            try:
                os.kill(proc.pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:
                continue
        print(describe(proc, by_pid), flush=True)
        if not args.list:
            time.sleep(args.pause)
    if not args.list:
        print("their stacks are in the job's log (the stderr named above); the job goes on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
