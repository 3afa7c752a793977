"""benchmarks/step_profile.py: a profiled step's events sorted into the parts of the step."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks import step_profile


class ToyTDTLoss(torch.autograd.Function):
    """A custom autograd Function, as NeMo's numba TDT loss is: it records no forward op."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x * x).sum()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class ToyEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.read = False

    def forward(self, x):
        out = self.layers(x)
        if self.read:
            float(out.sum())  # a host read of a device value: a sync on a GPU
        return out


class ToyTransducer(nn.Module):
    """The attributes step_profile.model_parts looks for, each a small module."""

    def __init__(self):
        super().__init__()
        self.preprocessor = nn.Identity()
        self.encoder = ToyEncoder()
        self.decoder = nn.Embedding(10, 64)
        self.joint = nn.Linear(64, 16)

    def step(self, x, tokens, frozen_encoder=False, read_in_encoder=False):
        x = self.preprocessor(x)
        self.encoder.read = read_in_encoder
        with torch.no_grad() if frozen_encoder else torch.enable_grad():
            enc = self.encoder(x)
        pred = self.decoder(tokens)
        logits = self.joint(enc[:, None, :] + pred[None, :, :])
        return ToyTDTLoss.apply(logits)


def profile_step(model, **kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, tokens = torch.randn(32, 64), torch.randint(0, 10, (5,))
    with step_profile.PartMarks(model), torch.profiler.profile() as prof:
        loss = model.step(x, tokens, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step_profile.step_table(prof.events(), wall_s=1.0, device="cpu"), prof


def test_each_parts_backward_is_given_to_the_part_whose_forward_made_it():
    table, _ = profile_step(ToyTransducer())
    for part in ("encoder", "prediction network", "joint"):
        assert table.rows[f"{part} forward"].host_us > 0, part
        assert table.rows[f"{part} backward"].host_us > 0, part
    # the custom Function's backward has no forward op: it goes by its name to the loss
    assert table.rows["TDT loss backward"].host_us > 0
    # a gradient added into .grad has no forward op either: its own row
    assert table.rows[step_profile.GRAD_ROW].calls > 0
    assert table.rows[step_profile.OPTIMIZER_ROW].host_us > 0


def test_a_frozen_encoder_has_no_backward_row():
    table, _ = profile_step(ToyTransducer(), frozen_encoder=True)
    assert table.rows["encoder forward"].host_us > 0
    assert "encoder backward" not in table.rows
    assert table.rows["joint backward"].host_us > 0


def test_every_events_self_time_is_in_exactly_one_row():
    table, prof = profile_step(ToyTransducer())
    total = sum(e.self_cpu_time_total for e in prof.events())
    assert abs(table.host_us - total) < 1e-6 * max(total, 1.0)


def test_host_reads_are_counted_where_they_happen_and_adamws_are_not():
    quiet, _ = profile_step(ToyTransducer())
    reading, _ = profile_step(ToyTransducer(), read_in_encoder=True)
    # AdamW reads its step counters (host tensors on a GPU too): not syncs
    assert quiet.syncs == 0 and quiet.scalar_reads > 0
    assert reading.syncs == 1 and reading.syncs_by_part == {"encoder forward": 1}


def test_the_table_lists_the_parts_in_step_order_with_their_shares():
    table, _ = profile_step(ToyTransducer())
    text = step_profile.format_table(table, "title")
    lines = text.splitlines()
    assert lines[0] == "title"
    names = [line[:40].strip() for line in lines[2:]]
    assert names.index("encoder forward") < names.index("joint forward")
    assert names.index("joint backward") < names.index("encoder backward")
    assert lines[-2].startswith("total (self times)") and "device" not in lines[1]


def test_marks_are_removed_on_exit():
    model = ToyTransducer()
    with step_profile.PartMarks(model):
        pass
    with torch.profiler.profile() as prof:
        model.step(torch.randn(4, 64), torch.randint(0, 10, (2,)))
    assert not any(e.name.startswith(step_profile.MARK) for e in prof.events())
