"""Host memory of resuming a step checkpoint on every rank of a node: each rank reading its own copy
(Lightning's TorchCheckpointIO) against the memory-mapped load train.py uses
(checkpoints.AtomicCheckpointIO), side by side in one run.

Usage:
    python benchmarks/bench_resume_memory.py                          # the full-size model, 2 ranks
    MODEL_CONFIG=configs/tiny_tdt.yaml python benchmarks/bench_resume_memory.py --ranks 4

It builds MODEL_CONFIG once and writes a step checkpoint of its shape with AdamW's two moments per
parameter (7.6 GB at full size; ``--dir`` holds it), then starts ``--ranks`` processes at once per
way. Each loads the checkpoint as a resume does and reads every tensor of it (Lightning then copies
them into the model and the optimizer). Reported per way: the peak of the processes' summed PSS
(shared pages, such as one file mapped by all ranks, count once across them) and of their private
anonymous memory (RssAnon). The difference is what a node saves at ``--ranks`` x the checkpoint.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.process_memory import pss_bytes, status_bytes


def write_checkpoint(path: Path) -> int:
    """A step checkpoint of MODEL_CONFIG's shape: weights plus AdamW's moments; its size."""
    import asr_model
    import config

    tokenizer = Path(config.TOKENIZER_DIR)
    if not (tokenizer / "tokenizer.model").exists():
        from benchmarks.bench_train_step import synthetic_tokenizer

        tokenizer = synthetic_tokenizer(config.VOCAB_SIZE, path.parent / "tokenizer")
    model = asr_model.build_model(tokenizer_dir=tokenizer)
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    moments = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
        for i, p in enumerate(model.parameters())
    }
    torch.save(
        {"state_dict": weights, "optimizer_states": [{"state": moments, "param_groups": []}]},
        path,
    )
    del model, weights, moments
    return path.stat().st_size


def _load(way: str, path: str, ready, go, out) -> None:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    import checkpoints

    io = TorchCheckpointIO() if way == "copy" else checkpoints.AtomicCheckpointIO()
    ready.wait()
    go.wait()
    checkpoint = io.load_checkpoint(path)
    total = 0.0
    tensors = list(checkpoint["state_dict"].values())
    for state in checkpoint["optimizer_states"][0]["state"].values():
        tensors += [t for t in state.values() if t.dim()]
    for t in tensors:
        total += float(t.float().sum())  # every page read, as the restore copies it
    out.put((os.getpid(), total))
    time.sleep(1.0)  # stay alive with the checkpoint held while the parent samples


def measure(way: str, path: Path, ranks: int) -> tuple[float, float, float]:
    """(peak summed PSS, peak summed RssAnon, seconds) of ``ranks`` processes loading ``path``."""
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Barrier(ranks + 1), ctx.Barrier(ranks + 1), ctx.Queue()
    procs = [ctx.Process(target=_load, args=(way, str(path), ready, go, out)) for _ in range(ranks)]
    for p in procs:
        p.start()
    ready.wait()
    os.system("sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null")  # a cold page cache if allowed
    started = time.monotonic()
    go.wait()
    peak_pss = peak_anon = 0
    done = 0
    while done < ranks:
        pids = [p.pid for p in procs if p.is_alive()]
        peak_pss = max(peak_pss, sum(pss_bytes(pid) for pid in pids))
        anon = 0
        for pid in pids:
            try:
                anon += status_bytes("RssAnon", pid)
            except OSError:
                pass
        peak_anon = max(peak_anon, anon)
        while not out.empty():
            out.get()
            done += 1
        time.sleep(0.05)
    seconds = time.monotonic() - started
    for p in procs:
        p.join()
    return peak_pss / 2**30, peak_anon / 2**30, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_resume")
    args = parser.parse_args(argv)
    os.environ.setdefault("MODEL_CONFIG", "configs/parakeet_tdt_0.6b.yaml")
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "step_00000001.ckpt"
    if not path.exists():
        print(f"writing a checkpoint of {os.environ['MODEL_CONFIG']} to {path} ...", flush=True)
        write_checkpoint(path)
    size = path.stat().st_size / 2**30
    print(f"checkpoint {path}: {size:.2f} GiB; {args.ranks} ranks load it at once")
    results = {way: measure(way, path, args.ranks) for way in ("copy", "mapped")}
    print(f"{'way':<8} {'peak PSS (node)':>16} {'peak private':>13} {'seconds':>8}")
    for way, (pss, anon, seconds) in results.items():
        print(f"{way:<8} {pss:>13.2f} GiB {anon:>9.2f} GiB {seconds:>8.1f}")
    print(
        f"mapped / copy: PSS {results['mapped'][0] / results['copy'][0]:.2f}x, private memory "
        f"{results['mapped'][1] / max(results['copy'][1], 1e-9):.2f}x "
        f"(copy holds about ranks x checkpoint = {args.ranks * size:.1f} GiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
