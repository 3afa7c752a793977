"""Speed of the TDT loss of tdt_loss.py against a plain per-(t, u) loop and, on CUDA, NeMo's numba kernel.

Usage:
    python benchmarks/bench_tdt_loss.py                       # B=4, T=60, U=20, V=256: a tiny-model micro-batch
    python benchmarks/bench_tdt_loss.py --batch 8 --frames 250 --labels 80 --vocab 1024 --skip-loop
    python benchmarks/bench_tdt_loss.py --cuda --batch 4 --frames 250 --labels 100 --vocab 12000 --skip-loop

The loop baseline is ``reference_tdt_loss`` below, the recursion written plainly (the same math NeMo's
tdt_pytorch loops over, without its .cuda() calls); tests/test_tdt_loss.py checks tdt_loss.py against it.
Both run in this process; the ratio is printed.
With --cuda, forward + backward of tdt_loss on the GPU (what TDT_LOSS=torch runs) is timed against
NeMo's numba TDT kernel (TDT_LOSS=numba, requirements-gpu.txt) on the same logits, after both are
checked to agree (tdt_loss.check_cuda_loss).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import tdt_loss

DURATIONS = [0, 1, 2, 3, 4]


# ---- the reference: the forward-variable recursion, one (b, t, u) at a time -------------------------


def lse(terms):
    """log(sum(exp(terms))) of a list of 0-d tensors."""
    return torch.logsumexp(torch.stack(terms), dim=0)


def reference_tdt_loss(acts, labels, act_lens, label_lens, blank, durations, sigma=0.0):
    """-log P(y|x) per utterance. alpha[(t, u)] is None where no path arrives (no log(0) arithmetic)."""
    n_dur = len(durations)
    losses = []
    for b in range(acts.shape[0]):
        T, U = int(act_lens[b]), int(label_lens[b])
        tok = torch.log_softmax(acts[b, :, :, : acts.shape[-1] - n_dur], dim=-1) - sigma
        dur = torch.log_softmax(acts[b, :, :, acts.shape[-1] - n_dur :], dim=-1)
        alpha = {(0, 0): torch.zeros((), dtype=acts.dtype)}
        for t in range(T):
            for u in range(U + 1):
                if (t, u) == (0, 0):
                    continue
                terms = []
                for i, d in enumerate(durations):
                    if t - d < 0:
                        continue
                    if (
                        d > 0 and alpha.get((t - d, u)) is not None
                    ):  # blank: stays at u, moves d frames
                        terms.append(alpha[(t - d, u)] + tok[t - d, u, blank] + dur[t - d, u, i])
                    if u > 0 and alpha.get((t - d, u - 1)) is not None:  # label y_u, moves d frames
                        y = int(labels[b, u - 1])
                        terms.append(
                            alpha[(t - d, u - 1)] + tok[t - d, u - 1, y] + dur[t - d, u - 1, i]
                        )
                alpha[(t, u)] = lse(terms) if terms else None
        final = [
            alpha[(T - d, U)] + tok[T - d, U, blank] + dur[T - d, U, i]
            for i, d in enumerate(durations)
            if d > 0 and T - d >= 0 and alpha.get((T - d, U)) is not None
        ]
        losses.append(-lse(final) if final else torch.tensor(math.inf, dtype=acts.dtype))
    return torch.stack(losses)


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
