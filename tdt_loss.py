"""TDT (Token-and-Duration Transducer) loss in vectorized pure torch, for CPU, with NeMo's semantics.

NeMo 3.0's ``tdt`` loss (numba) raises on CPU, and its ``tdt_pytorch`` loss hard-codes ``.cuda()``
and loops over every (b, t, u) in Python. ``tdt_loss`` computes the same quantity on any device with
one Python step per encoder frame; ``attach_tdt_loss(model)`` installs it on a NeMo TDT model so the
loss dispatches by device: CUDA tensors go to NeMo's numba kernel (or here too with TDT_LOSS=torch),
everything else comes here. ``check_cuda_loss`` runs the CUDA path once on a known problem, so a broken
GPU install stops a job in its first seconds (train.py calls it at start-up).

Usage:
    import tdt_loss
    tdt_loss.attach_tdt_loss(model)      # after restore_from / from_pretrained / change_vocabulary
    python benchmarks/bench_tdt_loss.py     # speed against a plain loop; on CUDA also against numba

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

import logging
import os
import random
from collections.abc import Sequence

import torch

# Finite stand-in for log(0): keeps logsumexp and its gradient free of NaN (exp(-inf - -inf)).
NEG = -1e30
REDUCTIONS = (None, "none", "sum", "mean", "mean_batch", "mean_volume")


class _ArcLogProbs(torch.autograd.Function):
    """The log-probabilities the recursion reads, from the joint's logits ``acts`` [B, T, U1, V1+D]:
    blank's [B, T, U1], each next label's [B, T, U1-1] (over the V1 token logits) and the
    durations' [B, T, U1, D] (over the last D).

    Only those entries of the token log-softmax are ever read, so the forward keeps one log-sum-exp
    per (b, t, u) instead of the whole log-softmax, and the backward writes the gradient of ``acts``
    in one pass: -softmax x (the incoming gradients summed over the entries read), plus each
    entry's own gradient where it was read (the gradient NeMo's kernels compute too). Autograd
    through log_softmax, gather and slicing would keep the whole log-softmax and build the
    gradient from several full-size temporaries, which is most of a CPU step's loss."""

    @staticmethod
    def forward(ctx, acts, labels, blank: int, n_dur: int):
        v1 = acts.shape[-1] - n_dur
        u1 = acts.shape[2]
        tokens = acts[..., :v1]
        lse = torch.logsumexp(tokens, dim=-1)  # [B, T, U1]
        index = labels[:, None, : u1 - 1, None].expand(-1, acts.shape[1], -1, 1)
        blank_lp = tokens[..., blank] - lse
        label_lp = (
            torch.gather(tokens[:, :, : u1 - 1, :], 3, index).squeeze(3) - lse[:, :, : u1 - 1]
        )
        dur_lp = torch.log_softmax(acts[..., v1:], dim=-1)
        ctx.save_for_backward(acts, lse, index, dur_lp)
        ctx.blank, ctx.v1 = blank, v1
        return blank_lp, label_lp, dur_lp

    @staticmethod
    def backward(ctx, g_blank, g_label, g_dur):
        acts, lse, index, dur_lp = ctx.saved_tensors
        v1, u1 = ctx.v1, acts.shape[2]
        read = torch.zeros_like(lse) if g_blank is None else g_blank.clone()
        if g_label is not None:
            read[:, :, : u1 - 1] += g_label
        # Over every column at once (contiguous, one pass); the duration columns are rewritten below.
        grad = torch.sub(acts, lse.unsqueeze(-1))
        grad.exp_().mul_(read.neg_().unsqueeze(-1))
        tokens = grad[..., :v1]
        if g_blank is not None:
            tokens[..., ctx.blank] += g_blank
        if g_label is not None:
            tokens[:, :, : u1 - 1].scatter_add_(3, index, g_label.unsqueeze(3))
        if g_dur is None:
            grad[..., v1:] = 0
        else:
            grad[..., v1:] = g_dur - dur_lp.exp() * g_dur.sum(dim=-1, keepdim=True)
        return grad, None, None, None


def _arc_scores(
    acts: torch.Tensor,
    labels: torch.Tensor,
    blank: int,
    durations: Sequence[int],
    sigma: float,
    use_rnnt: bool,
):
    """Time-major [T, B, U1] blank-arc and [T, B, U1-1] label-arc scores, each a list of (duration, scores)."""
    u1 = acts.shape[2]
    blank_lp, label_lp, dur_lp = _ArcLogProbs.apply(acts, labels, blank, len(durations))
    tm = lambda x: x.permute(1, 0, 2)  # noqa: E731  (time-major: frame t is a contiguous slab)
    if use_rnnt:
        return [(1, tm(blank_lp))], [(0, tm(label_lp))]
    blank_arcs = [
        (d, tm(blank_lp - sigma + dur_lp[..., i])) for i, d in enumerate(durations) if d > 0
    ]
    label_arcs = [
        (d, tm(label_lp - sigma + dur_lp[:, :, : u1 - 1, i])) for i, d in enumerate(durations)
    ]
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


def _log_likelihood(
    blank_arcs, label_arcs, act_lens: torch.Tensor, label_lens: torch.Tensor
) -> torch.Tensor:
    """log P(y|x) per utterance [B] from time-major arc scores (see the module docstring)."""
    first = blank_arcs[0][1]
    T, B, U1 = first.shape
    dtype, device = first.dtype, first.device
    start = torch.cat(
        [
            torch.zeros(B, 1, dtype=dtype, device=device),
            torch.full((B, U1 - 1), NEG, dtype=dtype, device=device),
        ],
        dim=1,
    )
    never = torch.full((B, U1), NEG, dtype=dtype, device=device)
    zero_label = [w for d, w in label_arcs if d == 0]
    if zero_label and U1 > 1:
        # S[t, :, u] = sum of the duration-0 label scores along u at frame t: the in-frame chain.
        chain = torch.cat(
            [torch.zeros(T, B, 1, dtype=dtype, device=device), zero_label[0].cumsum(dim=2)], dim=2
        )
    else:
        chain = None
    # Arcs that arrive at frame t from frame t - d, all durations d >= 1 side by side, so one step of
    # the loop is a handful of batched ops over (duration, batch, u) whatever the number of durations.
    steps = sorted({d for d, _ in blank_arcs + label_arcs if d > 0})
    blank_in = _delayed(blank_arcs, steps, T, first)  # [T, D, B, U1]
    label_in = (
        _delayed(label_arcs, steps, T, first[:, :, 1:]) if U1 > 1 else None
    )  # [T, D, B, U1-1]

    alphas: list[torch.Tensor] = []
    for t in range(T):
        if t == 0:
            c = start
        else:
            history = torch.stack([alphas[t - d] if d <= t else never for d in steps])  # [D, B, U1]
            c = torch.logsumexp(history + blank_in[t], dim=0)
            if label_in is not None:
                arrive = torch.logsumexp(history[:, :, :-1] + label_in[t], dim=0)
                c = torch.cat([c[:, :1], torch.logaddexp(c[:, 1:], arrive)], dim=1)
        if chain is not None:
            c = chain[t] + torch.logcumsumexp(c - chain[t], dim=1)
        alphas.append(c)
    alpha = torch.stack(alphas)  # [T, B, U1]

    batch = torch.arange(B, device=device)
    ends = []
    for d, w in blank_arcs:
        t_last = act_lens - d
        ok = t_last >= 0
        t_idx = t_last.clamp(min=0)
        end = alpha[t_idx, batch, label_lens] + w[t_idx, batch, label_lens]
        ends.append(torch.where(ok, end, torch.full_like(end, NEG)))
    return _lse(ends)


def tdt_loss(
    acts: torch.Tensor,
    labels: torch.Tensor,
    act_lens: torch.Tensor,
    label_lens: torch.Tensor,
    *,
    blank: int,
    durations: Sequence[int],
    sigma: float = 0.0,
    omega: float = 0.0,
    reduction: str | None = None,
) -> torch.Tensor:
    """NeMo's TDT loss of joint logits ``acts`` [B, T, U+1, V+1+D] (blank = ``blank`` = V).

    ``labels`` [B, >=U] int, ``act_lens`` / ``label_lens`` [B]. ``reduction`` None / "none" gives the
    per-utterance losses [B] (what NeMo's RNNTLoss wrapper asks for); "sum", "mean" (sum / B, as
    NeMo's TDTLossNumba), "mean_batch" and "mean_volume" reduce. Half-precision inputs are computed
    in float32. Gradients flow to ``acts`` through autograd.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {REDUCTIONS}")
    durations = [int(d) for d in durations]
    if (
        not durations
        or sorted(durations) != durations
        or durations[0] < 0
        or not any(d > 0 for d in durations)
    ):
        raise ValueError(
            f"durations={durations}: expected ascending non-negative durations with one >= 1, "
            "e.g. [0, 1, 2, 3, 4] (the model's loss.tdt_kwargs.durations)"
        )
    if (
        acts.dim() != 4
        or acts.shape[-1] <= len(durations)
        or blank != acts.shape[-1] - len(durations) - 1
    ):
        raise ValueError(
            f"acts of shape {tuple(acts.shape)} with blank={blank} and {len(durations)} durations: "
            "expected [B, T, U+1, V+1+D] with blank = V (the last token logit)"
        )
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


# What a GPU machine installs for NeMo's numba TDT kernel (docs/operations.md, "GPU set-up"): torch 2.13.0 from the
# registry is built for CUDA 13, so numba-cuda needs its cu13 extra (CUDA 13 bindings, libNVVM, nvJitLink).
GPU_INSTALL_LINE = ".venv/bin/pip install -r requirements-gpu.txt  # numba-cuda[cu13]==0.30.4"
BACKENDS = ("numba", "torch")


class TDTLossCheckFailed(RuntimeError):
    """The CUDA TDT loss failed, or disagreed with ``tdt_loss``, on a small known problem."""


class DeviceDispatchTDTLoss(torch.nn.Module):
    """The inner loss of NeMo's ``RNNTLoss`` wrapper, chosen by device and ``cuda_backend``.

    CUDA inputs go to NeMo's numba TDT kernel (``cuda_backend="numba"``) or to ``tdt_loss``
    (``"torch"``, the TDT_LOSS knob); inputs on any other device go to ``tdt_loss``. It keeps the
    interface NeMo's wrapper relies on: ``forward(acts, labels, act_lens, label_lens)`` and a
    settable ``reduction`` attribute (the wrapper sets it to None and reduces itself).
    """

    def __init__(
        self,
        blank: int,
        durations: Sequence[int],
        *,
        sigma: float = 0.0,
        omega: float = 0.0,
        fastemit_lambda: float = 0.0,
        clamp: float = -1.0,
        reduction: str | None = None,
        cuda_loss: torch.nn.Module | None = None,
        cuda_backend: str = "numba",
        cuda_loss_error: str | None = None,
    ):
        super().__init__()
        if cuda_backend not in BACKENDS:
            raise ValueError(f"TDT_LOSS={cuda_backend!r}: expected one of {', '.join(BACKENDS)}")
        self.blank = blank
        self.durations = [int(d) for d in durations]
        self.sigma = float(sigma)
        self.omega = float(omega)
        self.fastemit_lambda = float(fastemit_lambda)
        self.clamp = float(clamp)
        self.reduction = reduction
        self.cuda_loss = cuda_loss
        self.cuda_backend = cuda_backend
        self.cuda_loss_error = cuda_loss_error  # why cuda_loss could not be built, if it could not

    def uses_numba(self, device: torch.device | str) -> bool:
        """True when inputs on ``device`` go to NeMo's numba kernel."""
        return torch.device(device).type == "cuda" and self.cuda_backend == "numba"

    def forward(self, acts, labels, act_lens, label_lens):
        if self.uses_numba(acts.device):
            if self.cuda_loss is None:
                raise TDTLossCheckFailed(
                    f"CUDA tensors reached the TDT loss, but NeMo's numba TDT loss could not be built "
                    f"({self.cuda_loss_error}); install it with: {GPU_INSTALL_LINE}, or set TDT_LOSS=torch"
                )
            self.cuda_loss.reduction = self.reduction
            return self.cuda_loss(
                acts=acts, labels=labels, act_lens=act_lens, label_lens=label_lens
            )
        if self.fastemit_lambda != 0.0 or self.clamp > 0:
            raise NotImplementedError(
                f"tdt_loss has no FastEmit or gradient clamp (fastemit_lambda={self.fastemit_lambda}, "
                f"clamp={self.clamp}); set model.loss.tdt_kwargs.fastemit_lambda=0 and clamp=-1, or use "
                "TDT_LOSS=numba on CUDA"
            )
        return tdt_loss(
            acts,
            labels,
            act_lens,
            label_lens,
            blank=self.blank,
            durations=self.durations,
            sigma=self.sigma,
            omega=self.omega,
            reduction=self.reduction,
        )

    def extra_repr(self) -> str:
        return (
            f"blank={self.blank}, durations={self.durations}, sigma={self.sigma}, omega={self.omega}, "
            f"cuda={self.cuda_backend}"
        )


def restore_numpy_aliases() -> bool:
    """Give numpy back ``row_stack`` (``vstack`` under its old name) where numpy >= 2.5 removed it.

    numba-cuda 0.30.4 registers a CUDA overload for ``np.row_stack`` without checking that it
    exists, when its CUDA target first loads (the first kernel compiled): under numpy 2.5 every
    numba CUDA kernel, NeMo's TDT loss included, fails with "module 'numpy' has no attribute
    'row_stack'". The alias is the same function numpy 2.4 had. Returns True when it was restored
    (one warning per process on global rank 0).
    """
    import numpy as np

    if hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger("tdt_loss").warning(
            f"numpy {np.__version__} has no row_stack, which numba-cuda registers: restored as "
            f"numpy.vstack for NeMo's numba loss (numpy<2.5 needs no alias)"
        )
    return True


def _numba_tdt_loss(blank: int, kwargs: dict, reduction: str):
    """NeMo's ``RNNTLoss`` wrapper around its numba TDT loss (ImportError without numba)."""
    from nemo.collections.asr.losses.rnnt import RNNTLoss

    restore_numpy_aliases()

    return RNNTLoss(
        num_classes=blank, loss_name="tdt", loss_kwargs=dict(kwargs), reduction=reduction
    )


def attach_tdt_loss(model, cuda_backend: str | None = None) -> torch.nn.Module:
    """(Re)build ``model.loss`` from ``model.cfg.loss`` with the blank the joint really has, dispatching by device.

    Call it after every change of the joint: NeMo 3.0's ``change_vocabulary`` replaces a TDT loss
    with a default RNN-T loss whose blank index counts the duration outputs as tokens. The blank is
    ``joint.num_classes_with_blank - 1 - joint.num_extra_outputs`` = the vocabulary size; durations,
    sigma and omega come from ``cfg.loss.tdt_kwargs``. A fused joint gets the new loss as well.
    ``cuda_backend`` (default TDT_LOSS) picks what runs on CUDA: "numba" (NeMo's kernel) or "torch".
    Returns the new ``RNNTLoss`` wrapper.
    """
    from nemo.collections.asr.losses.rnnt import RNNTLoss

    import config

    cuda_backend = cuda_backend or config.TDT_LOSS
    loss_name, loss_kwargs = model.extract_rnnt_loss_cfg(model.cfg.get("loss", None))
    if loss_name != "tdt":
        raise ValueError(
            f"model.cfg.loss.loss_name={loss_name!r}: expected 'tdt' (a Parakeet-TDT model); "
            "check INIT_MODEL / MODEL_CONFIG"
        )
    from omegaconf import DictConfig, OmegaConf

    # Plain containers: NeMo's numba loss keeps `durations` and indexes it in its CUDA wrapper.
    kwargs = (
        OmegaConf.to_container(loss_kwargs, resolve=True)
        if isinstance(loss_kwargs, DictConfig)
        else dict(loss_kwargs or {})
    )
    durations = list(kwargs.get("durations") or [])
    if len(durations) != model.joint.num_extra_outputs:
        raise ValueError(
            f"model.cfg.loss.tdt_kwargs.durations={durations} but the joint has "
            f"{model.joint.num_extra_outputs} duration outputs; they must match"
        )
    blank = model.joint.num_classes_with_blank - 1 - model.joint.num_extra_outputs
    reduction = model.cfg.get("rnnt_reduction", "mean_batch")
    cuda_loss = error = None
    if cuda_backend == "numba":
        try:
            wrapper = _numba_tdt_loss(blank, kwargs, reduction)
            cuda_loss = wrapper._loss
        except (
            ImportError
        ) as exc:  # no numba: CPU runs and TDT_LOSS=torch still train with tdt_loss
            error = f"{type(exc).__name__}: {exc}"
    if cuda_loss is None:
        wrapper = RNNTLoss(num_classes=blank, loss_name="pytorch", reduction=reduction)
    wrapper._loss = DeviceDispatchTDTLoss(
        blank,
        durations,
        sigma=kwargs.get("sigma", 0.0),
        omega=kwargs.get("omega", 0.0),
        fastemit_lambda=kwargs.get("fastemit_lambda", 0.0),
        clamp=kwargs.get("clamp", -1.0),
        cuda_loss=cuda_loss,
        cuda_backend=cuda_backend,
        cuda_loss_error=error,
    )
    model.loss = wrapper
    if model.joint.fuse_loss_wer:
        model.joint.set_loss(wrapper)
    return wrapper


# NeMo's TDT loss runs one of two kernel families per call: the TDT kernels, and with probability
# omega the plain RNN-T ones (gpu_rnnt.GPUTDT.cost_and_grad). Each omega below forces one family.
KERNEL_FAMILIES = (("TDT", 0.0), ("RNN-T (omega)", 1.0))


def check_cuda_loss(
    loss: DeviceDispatchTDTLoss,
    device: torch.device | str,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-3,
) -> float:
    """Run ``loss``'s CUDA path once per kernel family on a small random problem; compare each with
    ``tdt_loss`` in float64 on CPU.

    The problem (2 utterances, 8 frames, up to 3 labels, 160 tokens, the loss's durations and sigma)
    is solved on ``device`` by what ``loss`` would run there (NeMo's numba kernels for
    TDT_LOSS=numba) and by ``tdt_loss``, twice: with omega 0 (the TDT kernels) and omega 1 (the plain
    RNN-T kernels, which training with the model's omega > 0 runs on a share of its calls, so they
    compile here rather than minutes into the run). Per-utterance losses and the gradients with
    respect to the logits must agree within ``rtol``/``atol``. Returns the largest absolute
    difference. Any failure (numba missing, no libNVVM, a driver too old for the CUDA bindings, a
    kernel that does not compile, wrong numbers) raises TDTLossCheckFailed naming the kernel family,
    the install line and TDT_LOSS=torch.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    # More tokens than a CUDA block of NeMo's log-softmax reduction has threads (128), as every
    # real vocabulary: its loop over a column's later chunks runs too, and no thread is idle.
    V, T, U = 160, 8, 3
    acts = torch.randn(2, T, U + 1, V + 1 + len(loss.durations), generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (2, U), generator=g)
    act_lens, label_lens = torch.tensor([T, T - 3]), torch.tensor([U, U - 1])
    largest = 0.0
    for family, omega in KERNEL_FAMILIES:
        ref_acts = acts.clone().requires_grad_(True)
        ref = tdt_loss(
            ref_acts,
            labels,
            act_lens,
            label_lens,
            blank=V,
            durations=loss.durations,
            sigma=loss.sigma,
            omega=omega,
        )
        ref.sum().backward()
        probe = DeviceDispatchTDTLoss(
            V, loss.durations, sigma=loss.sigma, omega=omega, cuda_backend=loss.cuda_backend
        )
        numba = probe.uses_numba(device)
        what = f"NeMo's numba {family} loss kernels" if numba else f"tdt_loss ({family})"
        try:
            if numba:
                # The wrapper reduces, not its inner loss (DeviceDispatchTDTLoss sets that to
                # None); NeMo's RNNTLoss refuses to be built with reduction "none".
                probe.cuda_loss = _numba_tdt_loss(
                    V,
                    {"durations": loss.durations, "sigma": loss.sigma, "omega": omega},
                    "mean_batch",
                )._loss
            got_acts = acts.float().to(device).requires_grad_(True)
            got = probe(got_acts, labels.to(device), act_lens.to(device), label_lens.to(device))
            got.sum().backward()
            got, grad = got.detach().double().cpu(), got_acts.grad.double().cpu()
        except Exception as exc:  # noqa: BLE001  (any failure here means the install is broken)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise TDTLossCheckFailed(
                f"{what} failed on {device} ({type(exc).__name__}: {first}); install the CUDA loss "
                f"with: {GPU_INSTALL_LINE}, or set TDT_LOSS=torch to train with tdt_loss.py on CUDA"
            ) from exc
        diff = max(
            float((got - ref.detach()).abs().max()), float((grad - ref_acts.grad).abs().max())
        )
        if not (
            torch.allclose(got, ref.detach(), rtol=rtol, atol=atol)
            and torch.allclose(grad, ref_acts.grad, rtol=rtol, atol=atol)
        ):
            raise TDTLossCheckFailed(
                f"{what} on {device} disagree with tdt_loss on a known problem (losses "
                f"{got.tolist()} vs {ref.detach().tolist()}, largest difference {diff:.3g}); "
                f"reinstall with: {GPU_INSTALL_LINE}, or set TDT_LOSS=torch"
            )
        largest = max(largest, diff)
    return largest
