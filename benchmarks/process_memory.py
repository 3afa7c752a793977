"""What the benchmarks read from /proc (Linux): a process tree, its PSS, and status fields.

PSS (proportional set size) counts a page shared by n processes as 1/n in each, so the PSS of a
tree is its real footprint: forked workers' inherited pages and a memory-mapped file count once.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it that is alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def pss_bytes(pid: int) -> int:
    """PSS of one process (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A kB field of /proc/<pid>/status in bytes: VmHWM (peak RSS of this process image; getrusage
    would include the parent's pages at fork), VmRSS, RssAnon, ... (0 when absent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0
