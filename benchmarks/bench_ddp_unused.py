"""What DDP's find_unused_parameters=True costs a phase-2 step, in a 2-process run on this machine.

Usage:
    python benchmarks/bench_ddp_unused.py                                        # MODEL_CONFIG (tiny)
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml python benchmarks/bench_ddp_unused.py --seconds 2 --steps 4

Two processes (gloo on CPU, NCCL with one GPU each where there are two) wrap the same model twice:
DDP with find_unused_parameters=True (what train.py uses: the encoder is frozen after the wrap) and
with False. Rounds alternate the two; a step is forward + backward of ``TrainingModule.compute_loss``
on a fixed batch of ``--batch`` utterances of ``--seconds`` seconds with every parameter trainable
(phase 2), gradients all-reduced, then zeroed. The optimizer step is left out: it is the same work
either way. Printed: the median step of each setting, their difference and ratio, the number of
autograd nodes DDP's search walks and the time of that search alone (the work find_unused_parameters
adds to every forward; it also adds an all-reduce of a used-parameter bitmap to every backward).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class _Loss(torch.nn.Module):
    """``TrainingModule.compute_loss`` as a module DDP can wrap."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, batch):
        return self.module.compute_loss(batch)


def _graph_nodes(loss: torch.Tensor) -> int:
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return len(seen)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)
    import asr_model
    import max_batch
    from benchmarks import bench_train_step as bench
    from training_step import TrainingModule

    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    tokenizer_dir = bench.synthetic_tokenizer(args.vocab_size, Path(args.work_dir))
    torch.manual_seed(0)
    model = asr_model.build_model(tokenizer_dir=tokenizer_dir).to(device)
    module = TrainingModule(model).to(device)
    shape = max_batch.BatchShape(
        [args.seconds] * args.batch, [max(2, int(5 * args.seconds))] * args.batch
    )
    batch = max_batch.make_batch(shape, model.tokenizer, seed=rank)
    batch = batch._replace(
        **{k: getattr(batch, k).to(device) for k in ("signal", "signal_len", "tokens", "token_len")}
    )
    wrappers = {
        flag: torch.nn.parallel.DistributedDataParallel(
            _Loss(module),
            device_ids=[device.index] if use_cuda else None,
            find_unused_parameters=flag,
            gradient_as_bucket_view=True,
            broadcast_buffers=False,
        )
        for flag in (True, False)
    }
    times = {True: [], False: []}
    nodes = 0
    for round_ in range(args.rounds):
        for flag, ddp in wrappers.items():
            for step in range(args.steps + 1):
                if use_cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                loss = ddp(batch)
                loss.backward()
                if use_cuda:
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - start
                nodes = nodes or _graph_nodes(loss)
                module.zero_grad(set_to_none=True)
                if step > 0:  # the first of each run re-warms caches after the other setting
                    times[flag].append(elapsed)
    # The search alone: DDP's C++ walk of the autograd graph from the loss, which find_unused_parameters
    # adds after every forward (timed by calling it again on a finished forward, then backward once).
    ddp = wrappers[True]
    loss = ddp(batch)
    search = []
    for _ in range(20):
        start = time.perf_counter()
        ddp.reducer.prepare_for_backward([loss])
        search.append(time.perf_counter() - start)
    loss.backward()
    module.zero_grad(set_to_none=True)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        on = statistics.median(times[True])
        off = statistics.median(times[False])
        Path(out).write_text(
            f"model: {n_params / 1e6:.1f} M parameters on {device.type}, {world} processes, batch "
            f"{args.batch} x {args.seconds:g} s, {len(times[True])} steps per setting\n"
            f"autograd nodes searched per forward with find_unused_parameters=True: {nodes}, "
            f"the search alone {1e3 * statistics.median(search):.3f} ms\n"
            f"find_unused_parameters=True : median forward+backward {on * 1e3:9.1f} ms\n"
            f"find_unused_parameters=False: median forward+backward {off * 1e3:9.1f} ms\n"
            f"difference {1e3 * (on - off):+.1f} ms per micro-batch, ratio True / False {on / off:.3f}\n"
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4, help="utterances per micro-batch")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per utterance")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--vocab-size", type=int, default=1000, help="pieces of the synthetic tokenizer"
    )
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "bench_train_step"))
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.txt")
        mp.spawn(_worker, args=(2, port, args, out), nprocs=2, join=True)
        print(Path(out).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
