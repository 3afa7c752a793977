"""tdt_loss.tdt_loss agrees with the TDT forward recursion written plainly, and with NeMo's own code."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdt_loss
from tests.reference_tdt_loss import lse, reference_tdt_loss

DURATIONS = [0, 1, 2, 3, 4]


def reference_rnnt_loss(acts, labels, act_lens, label_lens, blank, n_durations):
    """Plain RNN-T on the token logits (what NeMo's TDT computes with probability omega)."""
    losses = []
    for b in range(acts.shape[0]):
        T, U = int(act_lens[b]), int(label_lens[b])
        tok = torch.log_softmax(acts[b, :, :, : acts.shape[-1] - n_durations], dim=-1)
        alpha = {}
        for t in range(T):
            for u in range(U + 1):
                terms = []
                if t > 0:
                    terms.append(alpha[(t - 1, u)] + tok[t - 1, u, blank])
                if u > 0:
                    terms.append(alpha[(t, u - 1)] + tok[t, u - 1, int(labels[b, u - 1])])
                alpha[(t, u)] = lse(terms) if terms else torch.zeros((), dtype=acts.dtype)
        losses.append(-(alpha[(T - 1, U)] + tok[T - 1, U, blank]))
    return torch.stack(losses)


# ---- inputs ------------------------------------------------------------------------------------------


def make_batch(act_lens, label_lens, vocab=6, durations=DURATIONS, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    B, T, U = len(act_lens), max(act_lens), max(label_lens)
    acts = torch.randn(B, T, U + 1, vocab + 1 + len(durations), generator=g, dtype=dtype) * 2
    labels = torch.randint(0, vocab, (B, U), generator=g)
    return (acts.requires_grad_(), labels, torch.tensor(act_lens), torch.tensor(label_lens))


def both_losses(acts, labels, act_lens, label_lens, durations=DURATIONS, sigma=0.0):
    blank = acts.shape[-1] - len(durations) - 1
    ours = tdt_loss.tdt_loss(
        acts, labels, act_lens, label_lens, blank=blank, durations=durations, sigma=sigma
    )
    ref = reference_tdt_loss(acts, labels, act_lens, label_lens, blank, durations, sigma)
    # Gradients of the utterances that have a path; one with none (infinite loss) must get zero.
    finite = torch.isfinite(ref)
    (g_ours,) = torch.autograd.grad(
        ours[finite].sum(), acts, allow_unused=True, materialize_grads=True
    )
    (g_ref,) = (
        torch.autograd.grad(ref[finite].sum(), acts, allow_unused=True, materialize_grads=True)
        if finite.any()
        else (torch.zeros_like(acts),)
    )
    return ours, ref, g_ours, g_ref


# ---- tests -------------------------------------------------------------------------------------------


def test_loss_and_gradients_match_reference_with_padding_and_empty_transcript():
    ours, ref, g_ours, g_ref = both_losses(*make_batch([7, 4, 6, 1], [3, 0, 5, 2]))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-5, rtol=0)


def test_sigma_under_normalisation_matches_reference():
    ours, ref, g_ours, g_ref = both_losses(*make_batch([6, 5], [2, 4], seed=1), sigma=0.05)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-5, rtol=0)


def test_batch_where_every_transcript_is_empty():
    ours, ref, g_ours, g_ref = both_losses(*make_batch([5, 3], [0, 0], seed=2))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 4)), min_size=1, max_size=3),
    durations=st.sampled_from([[0, 1], [0, 1, 2, 3, 4], [0, 2, 3], [1, 2], [0, 1, 3, 8]]),
    sigma=st.sampled_from([0.0, 0.05]),
    seed=st.integers(0, 10_000),
)
def test_matches_reference_for_any_lengths_and_duration_set(lens, durations, sigma, seed):
    act_lens, label_lens = zip(*lens)
    ours, ref, g_ours, g_ref = both_losses(
        *make_batch(list(act_lens), list(label_lens), durations=durations, seed=seed),
        durations=durations,
        sigma=sigma,
    )
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(ours))  # the same utterances have no path
    torch.testing.assert_close(ours[finite], ref[finite], atol=1e-5, rtol=0)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-5, rtol=0)


def test_values_in_padding_do_not_change_loss_and_get_no_gradient():
    acts, labels, act_lens, label_lens = make_batch([6, 3], [4, 1], seed=3)
    blank = acts.shape[-1] - len(DURATIONS) - 1
    base = tdt_loss.tdt_loss(acts, labels, act_lens, label_lens, blank=blank, durations=DURATIONS)
    (grad,) = torch.autograd.grad(base.sum(), acts)
    noisy = acts.detach().clone()
    noisy[1, 3:] = 1e3
    noisy[1, :, 2:] = -1e3
    labels2 = labels.clone()
    labels2[1, 1:] = 5
    again = tdt_loss.tdt_loss(
        noisy, labels2, act_lens, label_lens, blank=blank, durations=DURATIONS
    )
    torch.testing.assert_close(again, base.detach(), atol=1e-9, rtol=0)
    assert grad[1, 3:].abs().max() == 0 and grad[1, :, 2:].abs().max() == 0


def test_omega_one_computes_the_plain_rnnt_loss():
    acts, labels, act_lens, label_lens = make_batch([5, 4], [3, 1], seed=4)
    blank = acts.shape[-1] - len(DURATIONS) - 1
    ours = tdt_loss.tdt_loss(
        acts, labels, act_lens, label_lens, blank=blank, durations=DURATIONS, omega=1.0
    )
    ref = reference_rnnt_loss(acts, labels, act_lens, label_lens, blank, len(DURATIONS))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_no_frames_gives_infinite_loss_like_nemo_and_no_gradient():
    acts, labels, _, label_lens = make_batch([3, 3], [1, 1], seed=5)
    blank = acts.shape[-1] - len(DURATIONS) - 1
    out = tdt_loss.tdt_loss(
        acts, labels, torch.tensor([3, 0]), label_lens, blank=blank, durations=DURATIONS
    )
    assert torch.isfinite(out[0]) and out[1] == math.inf
    (grad,) = torch.autograd.grad(out[1], acts)
    assert not grad.any()


@pytest.mark.parametrize(
    "reduction,expected",
    [
        ("sum", lambda x, ll: x.sum()),
        ("mean", lambda x, ll: x.sum() / len(x)),
        ("mean_batch", lambda x, ll: x.mean()),
        ("mean_volume", lambda x, ll: x.sum() / ll.sum()),
    ],
)
def test_reductions_follow_nemo(reduction, expected):
    acts, labels, act_lens, label_lens = make_batch([5, 4, 2], [3, 1, 1], seed=6)
    blank = acts.shape[-1] - len(DURATIONS) - 1
    per = tdt_loss.tdt_loss(acts, labels, act_lens, label_lens, blank=blank, durations=DURATIONS)
    red = tdt_loss.tdt_loss(
        acts, labels, act_lens, label_lens, blank=blank, durations=DURATIONS, reduction=reduction
    )
    torch.testing.assert_close(red, expected(per, label_lens.double()))


def test_bfloat16_input_is_computed_in_float32():
    acts, labels, act_lens, label_lens = make_batch([5, 3], [2, 1], seed=7, dtype=torch.float32)
    blank = acts.shape[-1] - len(DURATIONS) - 1
    full = tdt_loss.tdt_loss(acts, labels, act_lens, label_lens, blank=blank, durations=DURATIONS)
    half = tdt_loss.tdt_loss(
        acts.bfloat16(), labels, act_lens, label_lens, blank=blank, durations=DURATIONS
    )
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.1, rtol=0.02)


def test_agrees_with_nemo_tdt_pytorch_run_on_cpu(monkeypatch):
    """NeMo's own TDTLossPytorch (its loops and its -1000 'log zero'), with its .cuda() calls made no-ops."""
    from nemo.collections.asr.losses.rnnt_pytorch import TDTLossPytorch

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    acts, labels, act_lens, label_lens = make_batch(
        [5, 3, 4], [2, 0, 3], seed=8, dtype=torch.float32
    )
    blank = acts.shape[-1] - len(DURATIONS) - 1
    nemo = TDTLossPytorch(blank=blank, durations=DURATIONS, reduction=None, sigma=0.05)
    expected = nemo(acts=acts, labels=labels, act_lens=act_lens, label_lens=label_lens)
    ours = tdt_loss.tdt_loss(
        acts, labels, act_lens, label_lens, blank=blank, durations=DURATIONS, sigma=0.05
    )
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-5)


def test_bad_blank_index_is_rejected_with_the_shapes():
    acts, labels, act_lens, label_lens = make_batch([3], [1])
    with pytest.raises(ValueError, match="blank"):
        tdt_loss.tdt_loss(acts, labels, act_lens, label_lens, blank=0, durations=DURATIONS)


# ---- the CUDA loss: TDT_LOSS and the start-up check -----------------------------------------------


def _dispatch(backend="numba", **kwargs):
    return tdt_loss.DeviceDispatchTDTLoss(8, DURATIONS, sigma=0.02, cuda_backend=backend, **kwargs)


def test_start_up_check_passes_when_the_loss_agrees_with_the_float64_reference():
    # On a CPU device the check exercises its whole comparison with tdt_loss in float32.
    assert tdt_loss.check_cuda_loss(_dispatch(), "cpu") < 1e-4


def test_start_up_check_names_the_install_line_when_numba_cannot_be_built(monkeypatch):
    monkeypatch.setattr(tdt_loss.DeviceDispatchTDTLoss, "uses_numba", lambda self, device: True)

    def no_numba(*args, **kwargs):
        raise ImportError("numba-cuda is not installed")

    monkeypatch.setattr(tdt_loss, "_numba_tdt_loss", no_numba)
    with pytest.raises(tdt_loss.TDTLossCheckFailed) as err:
        tdt_loss.check_cuda_loss(_dispatch(), "cpu")
    message = str(err.value)
    assert "NeMo's numba TDT loss kernels failed" in message
    assert "numba-cuda is not installed" in message
    assert tdt_loss.GPU_INSTALL_LINE in message and "TDT_LOSS=torch" in message
    assert "\n" not in message


def test_start_up_check_refuses_a_loss_that_computes_wrong_numbers(monkeypatch):
    class Wrong(torch.nn.Module):
        reduction = "none"

        def forward(self, acts, labels, act_lens, label_lens):
            return acts.sum(dim=(1, 2, 3)) * 0.0 + 1.0

    class Wrapper:
        _loss = Wrong()

    monkeypatch.setattr(tdt_loss.DeviceDispatchTDTLoss, "uses_numba", lambda self, device: True)
    monkeypatch.setattr(tdt_loss, "_numba_tdt_loss", lambda *args, **kwargs: Wrapper())
    with pytest.raises(tdt_loss.TDTLossCheckFailed, match="TDT loss kernels .* disagree with"):
        tdt_loss.check_cuda_loss(_dispatch(), "cpu")


def test_start_up_check_runs_the_rnnt_kernels_too_and_names_them_when_they_fail(monkeypatch):
    built = []

    def numba_loss(blank, kwargs, reduction):
        built.append(kwargs["omega"])
        if kwargs["omega"] == 1.0:
            raise RuntimeError("NVVM: UNSUPPORTED_PTX_VERSION")  # the RNN-T kernels fail to JIT

        class Right(torch.nn.Module):  # the TDT kernels work: tdt_loss itself stands in for them
            reduction = "none"

            def forward(self, acts, labels, act_lens, label_lens):
                return tdt_loss.tdt_loss(
                    acts, labels, act_lens, label_lens, blank=blank, durations=DURATIONS, sigma=0.02
                )

        class Wrapper:
            _loss = Right()

        return Wrapper()

    monkeypatch.setattr(tdt_loss.DeviceDispatchTDTLoss, "uses_numba", lambda self, device: True)
    monkeypatch.setattr(tdt_loss, "_numba_tdt_loss", numba_loss)
    with pytest.raises(
        tdt_loss.TDTLossCheckFailed, match=r"numba RNN-T \(omega\) loss kernels failed"
    ):
        tdt_loss.check_cuda_loss(_dispatch(), "cpu")
    assert built == [0.0, 1.0]


def test_omega_1_is_the_plain_rnnt_loss_on_the_token_logits():
    g = torch.Generator().manual_seed(3)
    acts = torch.randn(1, 6, 3, 8 + 1 + len(DURATIONS), generator=g, dtype=torch.float64)
    labels = torch.tensor([[1, 2]])
    args = (acts, labels, torch.tensor([6]), torch.tensor([2]))
    rnnt = tdt_loss.tdt_loss(*args, blank=8, durations=DURATIONS, sigma=0.02, omega=1.0)
    tdt = tdt_loss.tdt_loss(*args, blank=8, durations=DURATIONS, sigma=0.02, omega=0.0)
    assert not torch.allclose(rnnt, tdt)
    # the duration logits play no part in the RNN-T loss
    shifted = acts.clone()
    shifted[..., 9:] += torch.randn(shifted[..., 9:].shape, generator=g, dtype=torch.float64)
    again = tdt_loss.tdt_loss(
        shifted,
        labels,
        torch.tensor([6]),
        torch.tensor([2]),
        blank=8,
        durations=DURATIONS,
        omega=1.0,
    )
    assert torch.allclose(again, rnnt)


def test_tdt_loss_torch_never_builds_the_numba_loss():
    loss = _dispatch("torch")
    assert loss.cuda_loss is None and not loss.uses_numba("cuda")
    assert _dispatch("numba").uses_numba("cuda") and not _dispatch("numba").uses_numba("cpu")
    with pytest.raises(ValueError, match="TDT_LOSS='warp'"):
        _dispatch("warp")


def test_numpy_without_row_stack_gets_the_alias_numba_cuda_registers_once(monkeypatch, caplog):
    import numpy as np

    monkeypatch.delattr(np, "row_stack", raising=False)
    with caplog.at_level("WARNING", logger="tdt_loss"):
        assert tdt_loss.restore_numpy_aliases() is True
        assert tdt_loss.restore_numpy_aliases() is False
    assert np.row_stack is np.vstack
    warned = [r.getMessage() for r in caplog.records if "row_stack" in r.getMessage()]
    assert len(warned) == 1 and "numba-cuda" in warned[0]


@pytest.mark.parametrize("labels_len", [0, 3])
def test_the_arc_log_probabilities_gradient_is_autograds_of_log_softmax(labels_len):
    # The fused backward against numerical differentiation, every output's gradient used at once
    # (blank, each next label, the durations), and with no label at all.
    g = torch.Generator().manual_seed(3)
    acts = torch.randn(2, 4, labels_len + 1, 7 + 3, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (2, labels_len), generator=g)
    acts.requires_grad_(True)

    def outputs(a):
        return tdt_loss._ArcLogProbs.apply(a, labels, 6, 3)

    assert torch.autograd.gradcheck(outputs, (acts,))
    blank, label, dur = outputs(acts)
    tokens = torch.log_softmax(acts[..., :7], dim=-1)
    assert torch.allclose(blank, tokens[..., 6])
    assert torch.allclose(
        label,
        tokens[:, :, :labels_len]
        .gather(3, labels[:, None, :, None].expand(-1, 4, -1, 1))
        .squeeze(3),
    )
    assert torch.allclose(dur, torch.log_softmax(acts[..., 7:], dim=-1))
