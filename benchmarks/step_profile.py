"""Where one optimizer step's time goes: a torch.profiler trace of it, sorted into the step's parts.

Usage (inside a benchmark):
    marks = PartMarks(model)                 # record_function ranges around each part's forward
    with marks, torch.profiler.profile(activities=activities(device)) as prof:
        ...one optimizer step...
    table = step_table(prof.events(), wall_s=..., device=device)
    print(format_table(table, ...))

The parts and how an event of the trace is given to one:
- forward: the innermost ``PartMarks`` range it runs in (the mel front end, SpecAugment, the encoder,
  the prediction network, the joint, the TDT loss); the joint's range holds NeMo's fused loop, the
  loss's range inside it the loss itself.
- backward: autograd's ``evaluate_function: <Node>`` events carry the sequence number of the
  forward op that made their node (per forward thread); the backward of an op goes to that op's
  part. A node made outside every range (a custom autograd Function such as NeMo's numba loss records
  no forward op) goes by its name: the TDT/RNN-T loss functions to the loss, autograd's
  AccumulateGrad (adding each parameter's gradient into ``.grad``) to a row of its own, the rest to
  "other backward".
- the optimizer: torch's own ``Optimizer.step#...`` and ``Optimizer.zero_grad#...`` ranges;
  the step boundary (``MARKED_METHODS``): what the training module does between the last backward
  and the optimizer (the ranks' flags, the gradient norm, clipping).
- host syncs: the host blocked on the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``, a blocking ``cudaMemcpy``), counted with ``aten::_local_scalar_dense``
  (``.item()``, ``int(tensor)``, ``.tolist()`` of a device tensor): on a CPU each costs nothing, but
  the count is the number of times a GPU step would drain its queue (AdamW's reads of its step
  counters left out: those are host tensors on a GPU too). ``syncs_by_part`` says where they are.
- allocator: ``cudaMalloc``, ``cudaFree``, ``cudaHostAlloc``, ``cudaMallocAsync``.
Every event's self time goes to exactly one row, so the rows add up to the trace's total: host time
(self CPU time) on any device, and on CUDA the device time (self device time of the kernels an op
launched) beside it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, record_function

MARK = "part: "
SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)
SCALAR_READ = "aten::_local_scalar_dense"
ALLOCATOR_CALLS = frozenset({"cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMallocAsync"})
LOSS_NAMES = ("tdt", "rnnt")  # custom autograd Functions of the loss, by name
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
OPTIMIZER_ROW = "optimizer (AdamW step, zero_grad)"
GRAD_ROW = "gradients into .grad (AccumulateGrad)"
# (attribute of the training module, its row): the work between backward and the optimizer.
MARKED_METHODS = (
    ("on_before_optimizer_step", "step boundary (flags, gradient norm)"),
    ("configure_gradient_clipping", "step boundary (flags, gradient norm)"),
)
PART_ORDER = (
    "mel front end",
    "SpecAugment",
    "encoder",
    "prediction network",
    "joint",
    "TDT loss",
)


def model_parts(model) -> dict[str, torch.nn.Module]:
    """The modules of a NeMo transducer whose forward ``PartMarks`` marks, by row name."""
    parts = {
        "mel front end": getattr(model, "preprocessor", None),
        "SpecAugment": getattr(model, "spec_augmentation", None),
        "encoder": getattr(model, "encoder", None),
        "prediction network": getattr(model, "decoder", None),
        "joint": getattr(model, "joint", None),
        "TDT loss": getattr(model, "loss", None),
    }
    return {name: module for name, module in parts.items() if module is not None}


class PartMarks:
    """While entered: a ``record_function`` range named ``MARK + part`` around every forward of each
    of ``model_parts(model)``, and around the ``MARKED_METHODS`` of ``module`` when given."""

    def __init__(self, model, module=None):
        self.model, self.module = model, module
        self._handles: list = []
        self._open: dict[int, list] = {}
        self._patched: list[str] = []

    def _pre(self, name):
        def hook(mod, args, kwargs=None):
            rf = record_function(MARK + name)
            rf.__enter__()
            self._open.setdefault(id(mod), []).append(rf)

        return hook

    def _post(self, mod, args, output):
        stack = self._open.get(id(mod))
        if stack:
            stack.pop().__exit__(None, None, None)

    def __enter__(self):
        for name, mod in model_parts(self.model).items():
            self._handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self._handles.append(mod.register_forward_hook(self._post))
        if self.module is not None:
            for attr, label in MARKED_METHODS:
                method = getattr(self.module, attr)

                def marked(*args, _method=method, _label=label, **kwargs):
                    with record_function(MARK + _label):
                        return _method(*args, **kwargs)

                setattr(self.module, attr, marked)
                self._patched.append(attr)
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for stack in self._open.values():
            while stack:
                stack.pop().__exit__(None, None, None)
        for attr in self._patched:
            delattr(self.module, attr)  # the instance attribute; the class's method shows again
        self._patched.clear()


def activities(device: torch.device) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


@dataclass
class Row:
    host_us: float = 0.0
    device_us: float = 0.0
    calls: int = 0


@dataclass
class StepTable:
    rows: dict[str, Row] = field(default_factory=dict)
    wall_s: float = 0.0
    device: str = "cpu"
    syncs: int = 0  # host syncs (on a GPU): blocking calls and scalar reads
    scalar_reads: int = 0
    syncs_by_part: dict[str, int] = field(default_factory=dict)  # where the syncs happen

    def row(self, name: str) -> Row:
        return self.rows.setdefault(name, Row())

    @property
    def host_us(self) -> float:
        return sum(r.host_us for r in self.rows.values())

    @property
    def device_us(self) -> float:
        return sum(r.device_us for r in self.rows.values())


def _self_device_us(event) -> float:
    value = getattr(event, "self_device_time_total", None)
    if value is None:  # older torch
        value = getattr(event, "self_cuda_time_total", 0.0)
    return float(value or 0.0)


def _mark_of(event) -> str | None:
    """The innermost part range (or optimizer range) an event runs in, itself included."""
    node = event
    while node is not None:
        name = node.name
        if name.startswith(MARK):
            return name[len(MARK) :]
        if name.startswith(OPTIMIZER_PREFIXES):
            return OPTIMIZER_ROW
        node = node.cpu_parent
    return None


def _backward_root(event):
    node = event
    while node is not None:
        if node.name.startswith("autograd::engine::evaluate_function: "):
            return node
        node = node.cpu_parent
    return None


def step_table(events, *, wall_s: float, device: torch.device | str) -> StepTable:
    """Sort the events of a profiled optimizer step (``prof.events()``) into rows (see the module
    docstring); ``wall_s``: the step's wall time, measured around it with the device synchronized."""
    events = list(events)
    table = StepTable(wall_s=wall_s, device=torch.device(device).type)
    # Forward ops that create autograd nodes: (thread, sequence number) -> their part.
    forward_part: dict[tuple[int, int], str] = {}
    for e in events:
        if e.sequence_nr >= 0 and _backward_root(e) is None:
            mark = _mark_of(e)
            if mark in PART_ORDER:
                forward_part.setdefault((e.thread, e.sequence_nr), mark)

    def part_of(e) -> str:
        root = _backward_root(e)
        if root is not None:
            part = forward_part.get((getattr(root, "fwd_thread", root.thread), root.sequence_nr))
            if part is None and any(n in root.name.lower() for n in LOSS_NAMES):
                part = "TDT loss"
            if part is None and root.name.endswith("AccumulateGrad"):
                return GRAD_ROW
            return f"{part} backward" if part else "other backward"
        mark = _mark_of(e)
        return f"{mark} forward" if mark in PART_ORDER else (mark or "other")

    for e in events:
        name = e.name
        host, dev = float(e.self_cpu_time_total), _self_device_us(e)
        if name in SYNC_CALLS or name == SCALAR_READ:
            key = "host syncs"
            where = part_of(e)
            # On CUDA a scalar read waits in the cudaStreamSynchronize under it, counted itself. On
            # a CPU every read of a tensor counts, but AdamW's: it reads its step counters, which
            # live on the host on a GPU too (unless fused or capturable), so they never wait there.
            if name in SYNC_CALLS or (table.device == "cpu" and where != OPTIMIZER_ROW):
                table.syncs += 1
                table.syncs_by_part[where] = table.syncs_by_part.get(where, 0) + 1
            if name == SCALAR_READ:
                table.scalar_reads += 1
        elif name in ALLOCATOR_CALLS:
            key = "allocator"
        elif name.startswith(MARK):
            key = name[len(MARK) :]
            key = f"{key} forward" if key in PART_ORDER else key
        else:
            key = part_of(e)
        row = table.row(key)
        row.host_us += host
        row.device_us += dev
        row.calls += 1
    if table.device == "cuda":
        # Kernels carry their own events too (device type CUDA); their time is already counted on
        # the op that launched them (self device time), so those rows are dropped.
        table.rows = {k: r for k, r in table.rows.items() if r.host_us > 0 or k != "other"}
    return table


def ordered_rows(table: StepTable) -> list[str]:
    """Row names in the order a step runs: each part forward, each part backward, the step's end."""
    order = [f"{p} forward" for p in PART_ORDER] + [f"{p} backward" for p in reversed(PART_ORDER)]
    order += [
        "other backward",
        GRAD_ROW,
        "step boundary (flags, gradient norm)",
        OPTIMIZER_ROW,
        "host syncs",
        "allocator",
    ]
    known = [name for name in order if name in table.rows]
    return known + sorted(name for name in table.rows if name not in order)


def format_table(table: StepTable, title: str) -> str:
    """The table as text: one row per part, host (and device) milliseconds and their shares."""
    cuda = table.device == "cuda"
    host_total, device_total = table.host_us or 1.0, table.device_us or 1.0
    head = f"{'part':<40} {'host ms':>10} {'share':>7}"
    if cuda:
        head += f" {'device ms':>10} {'share':>7}"
    lines = [title, head]
    for name in ordered_rows(table):
        row = table.rows[name]
        label = name
        if name == "host syncs":
            label = f"host syncs ({table.syncs}; {table.scalar_reads} scalar reads)"
        elif name == "allocator":
            label = f"allocator ({row.calls} calls)"
        line = f"{label:<40} {row.host_us / 1e3:>10.1f} {row.host_us / host_total:>7.1%}"
        if cuda:
            line += f" {row.device_us / 1e3:>10.1f} {row.device_us / device_total:>7.1%}"
        lines.append(line)
    total = f"{'total (self times)':<40} {table.host_us / 1e3:>10.1f} {'':>7}"
    if cuda:
        total += f" {table.device_us / 1e3:>10.1f}"
    lines.append(total)
    tail = f"wall {table.wall_s * 1e3:.1f} ms"
    if cuda and table.wall_s > 0:
        busy = table.device_us / 1e6 / table.wall_s
        tail += f"; device busy {busy:.1%} of it (kernels), idle {max(0.0, 1 - busy):.1%}"
    lines.append(tail)
    if table.syncs_by_part:
        where = sorted(table.syncs_by_part.items(), key=lambda kv: -kv[1])
        lines.append("host syncs by part: " + ", ".join(f"{k} {v}" for k, v in where))
    return "\n".join(lines)


@contextlib.contextmanager
def profiled(device: torch.device, trace_path=None):
    """A torch.profiler session on ``device`` whose chrome trace, when ``trace_path`` is given, is
    written there on exit."""
    with torch.profiler.profile(activities=activities(device), record_shapes=False) as prof:
        yield prof
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
