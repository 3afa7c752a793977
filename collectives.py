"""Cross-rank collectives that also work in a single process (where they return the input).

``rank_local()`` makes this process act as a single process while a block runs, whatever process
group is initialised: preflight runs its per-GPU checks (optimizer steps in a one-device Trainer)
that way, so a rank that fails such a check cannot leave the others waiting in a collective it
never reaches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_rank_local_depth = 0


def is_distributed() -> bool:
    """True inside an initialised torch.distributed process group, outside ``rank_local()``."""
    return (
        _rank_local_depth == 0
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


@contextlib.contextmanager
def rank_local() -> Iterator[None]:
    """Within the block, ``is_distributed()`` is False: every collective of this module, and every
    cross-rank sync that asks ``is_distributed()``, stays on this rank."""
    global _rank_local_depth
    _rank_local_depth += 1
    try:
        yield
    finally:
        _rank_local_depth -= 1


def all_reduce_tensor(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``values`` reduced over every rank (sum or max); unchanged in a single process."""
    if is_distributed():
        values = values.clone()
        torch.distributed.all_reduce(
            values,
            op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX,
        )
    return values


def all_gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...]; [obj] in a single process. Every rank must call it."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
