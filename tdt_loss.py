"""TDT (Token-and-Duration Transducer) loss in vectorized pure torch, for CPU, with NeMo's semantics.

NeMo 3.0's ``tdt`` loss (numba) raises on CPU, and its ``tdt_pytorch`` loss hard-codes ``.cuda()``
and loops over every (b, t, u) in Python. ``tdt_loss`` computes the same quantity on any device with
one Python step per encoder frame; ``attach_tdt_loss(model)`` installs it on a NeMo TDT model so the
loss dispatches by device: CUDA tensors go to NeMo's numba kernel, everything else comes here.

Usage:
    import tdt_loss
    tdt_loss.attach_tdt_loss(model)      # after restore_from / from_pretrained / change_vocabulary
    python scripts/bench_tdt_loss.py     # speed against a plain per-(t, u) loop

Semantics (NeMo's ``compute_tdt_alphas_kernel`` and ``GPUTDT``), for one utterance with T encoder
frames and U labels y_1..y_U, joint logits z[t, u] = [V+1 token logits (blank = V, the last), D
duration logits]:
    p_tok = log_softmax(token logits) - sigma          (sigma: logit under-normalisation)
    p_dur = log_softmax(duration logits)
    alpha[0, 0] = 0
    alpha[t, u] = logsumexp of
        alpha[t-d, u]   + p_tok[t-d, u, blank] + p_dur[t-d, u, d]    over durations d >= 1 (blank)
        alpha[t-d, u-1] + p_tok[t-d, u-1, y_u] + p_dur[t-d, u-1, d]  over all durations d (label)
    for 0 <= t < T; log P(y|x) = logsumexp over d >= 1 of alpha[T-d, U] + p_tok[T-d, U, blank] + p_dur[T-d, U, d]
With probability ``omega`` a call computes the plain RNN-T loss on the token logits instead
(no sigma, blank advances one frame, labels none), as NeMo does. The loss of an utterance is
-log P(y|x); an utterance with no path (e.g. T = 0) gets +inf, like NeMo.

How it is vectorized: frames are visited in order; for frame t all arcs that arrive from earlier
frames (every duration >= 1, blank and label) are a few batched ops over (duration, batch, u), with
the arc scores pre-shifted by their duration outside the loop. The duration-0 label arcs chain along u inside one
frame; that chain is a linear recurrence in the log semiring, solved in closed form with a cumulative
sum and ``torch.logcumsumexp``: alpha[t, u] = S[u] + logcumsumexp_k(c[k] - S[k]) with S the running
sum of the duration-0 label scores. Gradients come from autograd.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

# Finite stand-in for log(0): keeps logsumexp and its gradient free of NaN (exp(-inf - -inf)).
NEG = -1e30
REDUCTIONS = (None, "none", "sum", "mean", "mean_batch", "mean_volume")


def _arc_scores(acts: torch.Tensor, labels: torch.Tensor, blank: int, durations: Sequence[int],
                sigma: float, use_rnnt: bool):
    """Time-major [T, B, U1] blank-arc and [T, B, U1-1] label-arc scores, each a list of (duration, scores)."""
    n_dur = len(durations)
    token_lp = torch.log_softmax(acts[..., : acts.shape[-1] - n_dur], dim=-1)
    u1 = acts.shape[2]
    blank_lp = token_lp[..., blank]                                                   # [B, T, U1]
    index = labels[:, None, : u1 - 1, None].expand(-1, acts.shape[1], -1, 1)
    label_lp = torch.gather(token_lp[:, :, : u1 - 1, :], 3, index).squeeze(3)        # [B, T, U1-1]
    tm = lambda x: x.permute(1, 0, 2)  # noqa: E731  (time-major: frame t is a contiguous slab)
    if use_rnnt:
        return [(1, tm(blank_lp))], [(0, tm(label_lp))]
    dur_lp = torch.log_softmax(acts[..., acts.shape[-1] - n_dur:], dim=-1)
    blank_arcs = [(d, tm(blank_lp - sigma + dur_lp[..., i])) for i, d in enumerate(durations) if d > 0]
    label_arcs = [(d, tm(label_lp - sigma + dur_lp[:, :, : u1 - 1, i])) for i, d in enumerate(durations)]
    return blank_arcs, label_arcs


def _lse(terms: list[torch.Tensor]) -> torch.Tensor:
    return terms[0] if len(terms) == 1 else torch.logsumexp(torch.stack(terms), dim=0)


def _delayed(arcs, steps: list[int], T: int, like: torch.Tensor) -> torch.Tensor | None:
    """[T, len(steps), B, W]: entry [t, k] = scores of the arc of duration steps[k] leaving frame
    t - steps[k] (NEG where that frame is before 0 or no arc has that duration). None without arcs."""
    by_duration = dict(arcs)
    if not any(d in by_duration for d in steps):
        return None
    rows = []
    for d in steps:
        w = by_duration.get(d)
        if w is None or d >= T:
            rows.append(torch.full_like(like, NEG))
        else:
            rows.append(torch.cat([torch.full_like(w[:d], NEG), w[: T - d]], dim=0))
    return torch.stack(rows, dim=1)


def _log_likelihood(blank_arcs, label_arcs, act_lens: torch.Tensor, label_lens: torch.Tensor) -> torch.Tensor:
    """log P(y|x) per utterance [B] from time-major arc scores (see the module docstring)."""
    first = blank_arcs[0][1]
    T, B, U1 = first.shape
    dtype, device = first.dtype, first.device
    start = torch.cat([torch.zeros(B, 1, dtype=dtype, device=device),
                       torch.full((B, U1 - 1), NEG, dtype=dtype, device=device)], dim=1)
    never = torch.full((B, U1), NEG, dtype=dtype, device=device)
    zero_label = [w for d, w in label_arcs if d == 0]
    if zero_label and U1 > 1:
        # S[t, :, u] = sum of the duration-0 label scores along u at frame t: the in-frame chain.
        chain = torch.cat([torch.zeros(T, B, 1, dtype=dtype, device=device), zero_label[0].cumsum(dim=2)], dim=2)
    else:
        chain = None
    # Arcs that arrive at frame t from frame t - d, all durations d >= 1 side by side, so one step of
    # the loop is a handful of batched ops over (duration, batch, u) whatever the number of durations.
    steps = sorted({d for d, _ in blank_arcs + label_arcs if d > 0})
    blank_in = _delayed(blank_arcs, steps, T, first)                                    # [T, D, B, U1]
    label_in = _delayed(label_arcs, steps, T, first[:, :, 1:]) if U1 > 1 else None      # [T, D, B, U1-1]

    alphas: list[torch.Tensor] = []
    for t in range(T):
        if t == 0:
            c = start
        else:
            history = torch.stack([alphas[t - d] if d <= t else never for d in steps])   # [D, B, U1]
            c = torch.logsumexp(history + blank_in[t], dim=0)
            if label_in is not None:
                arrive = torch.logsumexp(history[:, :, :-1] + label_in[t], dim=0)
                c = torch.cat([c[:, :1], torch.logaddexp(c[:, 1:], arrive)], dim=1)
        if chain is not None:
            c = chain[t] + torch.logcumsumexp(c - chain[t], dim=1)
        alphas.append(c)
    alpha = torch.stack(alphas)                                                        # [T, B, U1]

    batch = torch.arange(B, device=device)
    ends = []
    for d, w in blank_arcs:
        t_last = act_lens - d
        ok = t_last >= 0
        t_idx = t_last.clamp(min=0)
        end = alpha[t_idx, batch, label_lens] + w[t_idx, batch, label_lens]
        ends.append(torch.where(ok, end, torch.full_like(end, NEG)))
    return _lse(ends)


def tdt_loss(acts: torch.Tensor, labels: torch.Tensor, act_lens: torch.Tensor, label_lens: torch.Tensor, *,
             blank: int, durations: Sequence[int], sigma: float = 0.0, omega: float = 0.0,
             reduction: str | None = None) -> torch.Tensor:
    """NeMo's TDT loss of joint logits ``acts`` [B, T, U+1, V+1+D] (blank = ``blank`` = V).

    ``labels`` [B, >=U] int, ``act_lens`` / ``label_lens`` [B]. ``reduction`` None / "none" gives the
    per-utterance losses [B] (what NeMo's RNNTLoss wrapper asks for); "sum", "mean" (sum / B, as
    NeMo's TDTLossNumba), "mean_batch" and "mean_volume" reduce. Half-precision inputs are computed
    in float32. Gradients flow to ``acts`` through autograd.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {REDUCTIONS}")
    durations = [int(d) for d in durations]
    if not durations or sorted(durations) != durations or durations[0] < 0 or not any(d > 0 for d in durations):
        raise ValueError(f"durations={durations}: expected ascending non-negative durations with one >= 1, "
                         "e.g. [0, 1, 2, 3, 4] (the model's loss.tdt_kwargs.durations)")
    if acts.dim() != 4 or acts.shape[-1] <= len(durations) or blank != acts.shape[-1] - len(durations) - 1:
        raise ValueError(f"acts of shape {tuple(acts.shape)} with blank={blank} and {len(durations)} durations: "
                         "expected [B, T, U+1, V+1+D] with blank = V (the last token logit)")
    if acts.dtype in (torch.float16, torch.bfloat16):
        acts = acts.float()
    act_lens = act_lens.long().to(acts.device)
    label_lens = label_lens.long().to(acts.device)
    labels = labels.long().to(acts.device)
    if acts.shape[0] == 0:
        per_utt = acts.sum(dim=(1, 2, 3))
    else:
        use_rnnt = omega > 0 and random.random() < omega
        blank_arcs, label_arcs = _arc_scores(acts, labels, blank, durations, sigma, use_rnnt)
        ll = _log_likelihood(blank_arcs, label_arcs, act_lens, label_lens)
        # No path at all (a log-likelihood at the NEG floor) is an infinite loss, as in NeMo.
        per_utt = torch.where(ll > NEG / 2, -ll, torch.full_like(ll, float("inf")))
    if reduction in (None, "none"):
        return per_utt
    if reduction == "sum":
        return per_utt.sum()
    if reduction in ("mean", "mean_batch"):
        return per_utt.sum() / max(per_utt.shape[0], 1)
    return per_utt.sum() / label_lens.sum().clamp(min=1)


class DeviceDispatchTDTLoss(torch.nn.Module):
    """The inner loss of NeMo's ``RNNTLoss`` wrapper: CUDA inputs -> NeMo's numba TDT, others -> ``tdt_loss``.

    It keeps the interface NeMo's wrapper relies on: ``forward(acts, labels, act_lens, label_lens)``
    and a settable ``reduction`` attribute (the wrapper sets it to None and reduces itself).
    """

    def __init__(self, blank: int, durations: Sequence[int], *, sigma: float = 0.0, omega: float = 0.0,
                 fastemit_lambda: float = 0.0, clamp: float = -1.0, reduction: str | None = None,
                 cuda_loss: torch.nn.Module | None = None):
        super().__init__()
        self.blank = blank
        self.durations = [int(d) for d in durations]
        self.sigma = float(sigma)
        self.omega = float(omega)
        self.fastemit_lambda = float(fastemit_lambda)
        self.clamp = float(clamp)
        self.reduction = reduction
        self.cuda_loss = cuda_loss

    def forward(self, acts, labels, act_lens, label_lens):
        if acts.is_cuda:
            if self.cuda_loss is None:
                raise RuntimeError("CUDA tensors reached the TDT loss, but NeMo's numba TDT loss was not built; "
                                   "install numba-cuda (requirements-gpu.txt) and call attach_tdt_loss again")
            self.cuda_loss.reduction = self.reduction
            return self.cuda_loss(acts=acts, labels=labels, act_lens=act_lens, label_lens=label_lens)
        if self.fastemit_lambda != 0.0 or self.clamp > 0:
            raise NotImplementedError(
                f"the CPU TDT loss has no FastEmit or gradient clamp (fastemit_lambda={self.fastemit_lambda}, "
                f"clamp={self.clamp}); set model.loss.tdt_kwargs.fastemit_lambda=0 and clamp=-1 for CPU runs")
        return tdt_loss(acts, labels, act_lens, label_lens, blank=self.blank, durations=self.durations,
                        sigma=self.sigma, omega=self.omega, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"blank={self.blank}, durations={self.durations}, sigma={self.sigma}, omega={self.omega}"


def attach_tdt_loss(model) -> torch.nn.Module:
    """(Re)build ``model.loss`` from ``model.cfg.loss`` with the blank the joint really has, dispatching by device.

    Call it after every change of the joint: NeMo 3.0's ``change_vocabulary`` replaces a TDT loss
    with a default RNN-T loss whose blank index counts the duration outputs as tokens. The blank is
    ``joint.num_classes_with_blank - 1 - joint.num_extra_outputs`` = the vocabulary size; durations,
    sigma and omega come from ``cfg.loss.tdt_kwargs``. A fused joint gets the new loss as well.
    Returns the new ``RNNTLoss`` wrapper.
    """
    from nemo.collections.asr.losses.rnnt import RNNTLoss

    loss_name, loss_kwargs = model.extract_rnnt_loss_cfg(model.cfg.get("loss", None))
    if loss_name != "tdt":
        raise ValueError(f"model.cfg.loss.loss_name={loss_name!r}: expected 'tdt' (a Parakeet-TDT model); "
                         "check INIT_MODEL / MODEL_CONFIG")
    from omegaconf import DictConfig, OmegaConf

    # Plain containers: NeMo's numba loss keeps `durations` and indexes it in its CUDA wrapper.
    kwargs = OmegaConf.to_container(loss_kwargs, resolve=True) if isinstance(loss_kwargs, DictConfig) \
        else dict(loss_kwargs or {})
    durations = list(kwargs.get("durations") or [])
    if len(durations) != model.joint.num_extra_outputs:
        raise ValueError(f"model.cfg.loss.tdt_kwargs.durations={durations} but the joint has "
                         f"{model.joint.num_extra_outputs} duration outputs; they must match")
    blank = model.joint.num_classes_with_blank - 1 - model.joint.num_extra_outputs
    try:
        wrapper = RNNTLoss(num_classes=blank, loss_name="tdt", loss_kwargs=dict(kwargs),
                           reduction=model.cfg.get("rnnt_reduction", "mean_batch"))
        cuda_loss = wrapper._loss
    except ImportError:  # no numba: CPU-only machines can still train with the torch loss
        wrapper = RNNTLoss(num_classes=blank, loss_name="pytorch", reduction=model.cfg.get("rnnt_reduction", "mean_batch"))
        cuda_loss = None
    wrapper._loss = DeviceDispatchTDTLoss(
        blank, durations, sigma=kwargs.get("sigma", 0.0), omega=kwargs.get("omega", 0.0),
        fastemit_lambda=kwargs.get("fastemit_lambda", 0.0), clamp=kwargs.get("clamp", -1.0), cuda_loss=cuda_loss)
    model.loss = wrapper
    if model.joint.fuse_loss_wer:
        model.joint.set_loss(wrapper)
    return wrapper
