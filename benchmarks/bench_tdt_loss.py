"""Speed of the TDT loss of tdt_loss.py against a plain per-(t, u) loop and, on CUDA, NeMo's numba kernel.

Usage:
    python benchmarks/bench_tdt_loss.py                       # B=4, T=60, U=20, V=256: a tiny-model micro-batch
    python benchmarks/bench_tdt_loss.py --batch 8 --frames 250 --labels 80 --vocab 1024 --skip-loop
    python benchmarks/bench_tdt_loss.py --cuda --batch 4 --frames 250 --labels 100 --vocab 12000 --skip-loop

The loop baseline is ``reference_tdt_loss`` of tests/reference_tdt_loss.py, the recursion written
plainly (the same math NeMo's tdt_pytorch loops over, without its .cuda() calls), which
tests/test_tdt_loss.py checks tdt_loss.py against.
Both run in this process; the ratio is printed.
With --cuda, forward + backward of tdt_loss on the GPU (what TDT_LOSS=torch runs) is timed against
NeMo's numba TDT kernel (TDT_LOSS=numba, requirements-gpu.txt) on the same logits, after both are
checked to agree (tdt_loss.check_cuda_loss).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

import tdt_loss

DURATIONS = [0, 1, 2, 3, 4]
REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "reference_tdt_loss.py"


def load_reference_tdt_loss():
    """The test suite's plain recursion, loaded by path: tests/ is not an installed package."""
    spec = importlib.util.spec_from_file_location("reference_tdt_loss", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_tdt_loss


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--frames", type=int, default=60, help="encoder frames T")
    parser.add_argument("--labels", type=int, default=20, help="tokens U")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--skip-loop", action="store_true", help="do not time the (slow) plain loop"
    )
    parser.add_argument(
        "--cuda", action="store_true", help="time tdt_loss against NeMo's numba kernel on CUDA"
    )
    args = parser.parse_args()
    if args.cuda:
        return bench_cuda(args)

    torch.manual_seed(0)
    B, T, U, V = args.batch, args.frames, args.labels, args.vocab
    acts = torch.randn(B, T, U + 1, V + 1 + len(DURATIONS), requires_grad=True)
    labels = torch.randint(0, V, (B, U))
    act_lens = torch.full((B,), T)
    label_lens = torch.full((B,), U)

    def ours():
        loss = tdt_loss.tdt_loss(
            acts, labels, act_lens, label_lens, blank=V, durations=DURATIONS, sigma=0.05
        )
        loss.sum().backward()

    t_ours = timed(ours, args.repeats)
    print(f"B={B} T={T} U={U} V={V}: tdt_loss forward+backward {t_ours * 1e3:.1f} ms")
    if not args.skip_loop:
        reference_tdt_loss = load_reference_tdt_loss()

        def loop():
            reference_tdt_loss(
                acts, labels, act_lens, label_lens, V, DURATIONS, 0.05
            ).sum().backward()

        t_loop = timed(loop, max(1, args.repeats // 5))
        print(
            f"plain per-(t, u) loop forward+backward {t_loop * 1e3:.1f} ms  "
            f"-> tdt_loss is {t_loop / t_ours:.0f}x faster"
        )
    return 0


def bench_cuda(args) -> int:
    """tdt_loss on CUDA (TDT_LOSS=torch) against NeMo's numba kernel (TDT_LOSS=numba), forward + backward."""
    if not torch.cuda.is_available():
        print("--cuda needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    B, T, U, V = args.batch, args.frames, args.labels, args.vocab
    numba = tdt_loss.DeviceDispatchTDTLoss(V, DURATIONS, sigma=0.05, cuda_backend="numba")
    numba.cuda_loss = tdt_loss._numba_tdt_loss(
        V, {"durations": DURATIONS, "sigma": 0.05, "omega": 0.0}, "none"
    )._loss
    torch_loss = tdt_loss.DeviceDispatchTDTLoss(V, DURATIONS, sigma=0.05, cuda_backend="torch")
    for loss in (numba, torch_loss):
        print(
            f"cuda={loss.cuda_backend}: agrees with tdt_loss in float64 on CPU "
            f"(largest difference {tdt_loss.check_cuda_loss(loss, device):.2g})"
        )
    torch.manual_seed(0)
    acts = torch.randn(B, T, U + 1, V + 1 + len(DURATIONS), device=device, requires_grad=True)
    labels = torch.randint(0, V, (B, U), device=device)
    act_lens = torch.full((B,), T, device=device)
    label_lens = torch.full((B,), U, device=device)

    def run(loss):
        def step():
            loss(acts, labels, act_lens, label_lens).sum().backward()
            acts.grad = None
            torch.cuda.synchronize()

        return step

    t_numba = timed(run(numba), args.repeats)
    t_torch = timed(run(torch_loss), args.repeats)
    print(
        f"B={B} T={T} U={U} V={V} on {torch.cuda.get_device_name(device)}: numba {t_numba * 1e3:.1f} ms, "
        f"tdt_loss {t_torch * 1e3:.1f} ms forward+backward -> TDT_LOSS=torch takes {t_torch / t_numba:.1f}x "
        "the time of TDT_LOSS=numba"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
