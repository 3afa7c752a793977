"""The TDT loss written plainly: the forward-variable recursion, one (b, t, u) at a time. The tests
check tdt_loss.py against it, and benchmarks/bench_tdt_loss.py times it as the loop baseline."""

from __future__ import annotations

import math

import torch


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
