"""Speed of the CPU TDT loss (tdt_loss.py) against a plain per-(t, u) loop, forward + backward.

Usage:
    python scripts/bench_tdt_loss.py                       # B=4, T=60, U=20, V=256: a tiny-model micro-batch
    python scripts/bench_tdt_loss.py --batch 8 --frames 250 --labels 80 --vocab 1024 --skip-loop

The loop baseline is the reference recursion of tests/test_tdt_loss.py (the same math NeMo's
tdt_pytorch loops over, without its .cuda() calls). Both run in this process; the ratio is printed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tdt_loss  # noqa: E402

DURATIONS = [0, 1, 2, 3, 4]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--frames", type=int, default=60, help="encoder frames T")
    parser.add_argument("--labels", type=int, default=20, help="tokens U")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-loop", action="store_true", help="do not time the (slow) plain loop")
    args = parser.parse_args()

    torch.manual_seed(0)
    B, T, U, V = args.batch, args.frames, args.labels, args.vocab
    acts = torch.randn(B, T, U + 1, V + 1 + len(DURATIONS), requires_grad=True)
    labels = torch.randint(0, V, (B, U))
    act_lens = torch.full((B,), T)
    label_lens = torch.full((B,), U)

    def ours():
        loss = tdt_loss.tdt_loss(acts, labels, act_lens, label_lens, blank=V, durations=DURATIONS, sigma=0.05)
        loss.sum().backward()

    t_ours = timed(ours, args.repeats)
    print(f"B={B} T={T} U={U} V={V}: tdt_loss forward+backward {t_ours * 1e3:.1f} ms")
    if not args.skip_loop:
        from tests.test_tdt_loss import reference_tdt_loss

        def loop():
            reference_tdt_loss(acts, labels, act_lens, label_lens, V, DURATIONS, 0.05).sum().backward()

        t_loop = timed(loop, max(1, args.repeats // 5))
        print(f"plain per-(t, u) loop forward+backward {t_loop * 1e3:.1f} ms  -> tdt_loss is {t_loop / t_ours:.0f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
