"""Cross-rank collectives that also work in a single process (where they return the input)."""

from __future__ import annotations

from typing import Any

import torch


def is_distributed() -> bool:
    """True inside an initialised torch.distributed process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


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
