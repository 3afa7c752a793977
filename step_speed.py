"""How fast one training step runs: the step-speed knobs, applied to a model, its optimizer and the
process.

Each setting changes how the step's arithmetic is scheduled, not what it computes: the loss and the
update stay the same up to floating-point rounding (bf16 noise under bf16-mixed). That is why a
requeue may change them (checkpoints.REQUEUE_NEUTRAL_SETTINGS) and why their defaults are chosen by
measurement alone (``benchmarks/bench_train_step.py --levers`` times each on and off in one run).

- USE_PYTORCH_SDPA: every attention module of the encoder computes softmax(QK^T + positional scores)V
  with ``torch.nn.functional.scaled_dot_product_attention`` (NeMo's ``use_pytorch_sdpa`` path)
  instead of three separate kernels; "auto" keeps what the model's config says.
- JOINT_FUSED_BATCH_SIZE: utterances per sub-batch of NeMo's fused joint + loss; 0 keeps the
  model's config value.
- FUSED_ADAMW: AdamW's single fused kernel for the whole update.
- COMPILE_ENCODER: each encoder layer compiled by ``torch.compile`` (dynamic shapes), in place, so
  parameter names, state dicts and checkpoints are unchanged.
- MATMUL_PRECISION: ``torch.set_float32_matmul_precision`` for the float32 parts.
- HOST_MEMORY_REUSE: glibc's malloc keeps the host memory torch frees for its next tensors (no mmap
  of its own per large block, no trimming of the heap) instead of handing it back to the kernel and
  faulting it in again page by page at the next step; "auto" is on when the step runs on the CPU,
  where its largest tensors (the joint's logits and their gradient) are host memory.

``TrainingModule`` applies the settings to the model it trains (``apply_to_model``) and to its AdamW
(``adamw_options``); train.py applies ``apply_to_process`` once.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

import config

# The benchmark's levers: name -> the setting that turns it on (off is the model's own).
LEVERS = {
    "sdpa": {"sdpa": "1"},
    "fused-adamw": {"fused_adamw": True},
    "compile": {"compile_encoder": True},
    "tf32": {"matmul_precision": "high"},
    "host-memory-reuse": {"host_memory_reuse": "1"},
}

# glibc's mallopt parameters and their defaults (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_reusing = False  # whether reuse_host_memory turned reuse on in this process


@dataclass(frozen=True)
class SpeedSettings:
    """The step-speed knobs as values (``from_config`` reads them); the defaults are the model's own
    behaviour: nothing changed."""

    sdpa: str = "auto"  # "auto" (the model's config), "1" or "0"
    fused_batch_size: int = 0  # 0: the model's config
    fused_adamw: bool = False
    compile_encoder: bool = False
    matmul_precision: str = "highest"
    host_memory_reuse: str = "auto"  # "auto" (on for a CPU step), "1" or "0"

    @classmethod
    def from_config(cls) -> SpeedSettings:
        return cls(
            sdpa=config.USE_PYTORCH_SDPA,
            fused_batch_size=config.JOINT_FUSED_BATCH_SIZE,
            fused_adamw=config.FUSED_ADAMW == "1",
            compile_encoder=config.COMPILE_ENCODER == "1",
            matmul_precision=config.MATMUL_PRECISION,
            host_memory_reuse=config.HOST_MEMORY_REUSE,
        )

    def resolved(self, *, on_cpu: bool) -> SpeedSettings:
        """These settings with HOST_MEMORY_REUSE's auto made the value it takes (``on_cpu``: the
        step runs on the CPU), so a lever that is already on compares equal."""
        return dataclasses.replace(
            self, host_memory_reuse="1" if self.reuses_host_memory(on_cpu) else "0"
        )

    def reuses_host_memory(self, on_cpu: bool) -> bool:
        """Whether HOST_MEMORY_REUSE is on for a step on the CPU (``on_cpu``) or a GPU."""
        return on_cpu if self.host_memory_reuse == "auto" else self.host_memory_reuse == "1"

    def with_lever(self, lever: str) -> SpeedSettings:
        """These settings with benchmark lever ``lever`` (LEVERS, or ``fused-batch-size=N``) on."""
        if lever.startswith("fused-batch-size="):
            return dataclasses.replace(self, fused_batch_size=int(lever.split("=", 1)[1]))
        if lever not in LEVERS:
            raise ValueError(
                f"unknown lever {lever!r}: expected one of {', '.join(LEVERS)} or fused-batch-size=N"
            )
        return dataclasses.replace(self, **LEVERS[lever])


def attention_modules(model) -> list[torch.nn.Module]:
    """The encoder's multi-head attention modules (those NeMo's ``use_pytorch_sdpa`` switches)."""
    from nemo.collections.asr.parts.submodules.multi_head_attention import MultiHeadAttention

    encoder = getattr(model, "encoder", None)
    if encoder is None:
        return []
    return [m for m in encoder.modules() if isinstance(m, MultiHeadAttention)]


def model_sdpa(model) -> bool:
    """What the model's own config says of use_pytorch_sdpa (False when it says nothing)."""
    cfg = getattr(model, "cfg", None)
    encoder_cfg = cfg.get("encoder", None) if cfg is not None else None
    return bool(encoder_cfg.get("use_pytorch_sdpa", False)) if encoder_cfg is not None else False


def model_fused_batch_size(model) -> int | None:
    """The fused_batch_size of the model's config, None when its joint runs unfused."""
    cfg = getattr(model, "cfg", None)
    joint_cfg = cfg.get("joint", None) if cfg is not None else None
    if joint_cfg is None or not joint_cfg.get("fuse_loss_wer", False):
        return None
    return joint_cfg.get("fused_batch_size", None)


def apply_to_model(model, settings: SpeedSettings) -> list[str]:
    """Set the encoder's attention path, the joint's sub-batch and the encoder layers' compilation of
    ``model`` as ``settings`` say, from whatever they were before (so a model can go back to its own
    settings: ``SpeedSettings()``). Returns what differs from the model's config, for the log."""
    changed = []
    attention = attention_modules(model)
    own_sdpa = model_sdpa(model)
    sdpa = own_sdpa if settings.sdpa == "auto" else settings.sdpa == "1"
    if sdpa:
        from nemo.collections.asr.parts.submodules.multi_head_attention import (
            RelPositionMultiHeadAttentionLongformer,
        )

        local = [m for m in attention if isinstance(m, RelPositionMultiHeadAttentionLongformer)]
        if local:
            raise config.ConfigError(
                f"USE_PYTORCH_SDPA={settings.sdpa}: this model's encoder uses local attention "
                f"({type(local[0]).__name__}), which NeMo runs without scaled_dot_product_attention; "
                "set USE_PYTORCH_SDPA=auto"
            )
    for m in attention:
        m.use_pytorch_sdpa = sdpa
    if attention and sdpa != own_sdpa:
        changed.append(f"encoder attention through torch SDPA {'on' if sdpa else 'off'}")

    joint = getattr(model, "joint", None)
    own_fused = model_fused_batch_size(model)
    if joint is not None and getattr(joint, "fuse_loss_wer", False):
        size = settings.fused_batch_size or own_fused or joint.fused_batch_size
        joint.set_fused_batch_size(int(size))
        if settings.fused_batch_size and settings.fused_batch_size != own_fused:
            changed.append(f"joint sub-batches of {size} utterances (the model's: {own_fused})")
    elif settings.fused_batch_size:
        raise config.ConfigError(
            f"JOINT_FUSED_BATCH_SIZE={settings.fused_batch_size}: this model's joint does not run "
            "fused with its loss (joint.fuse_loss_wer is false), so it has no sub-batches; set "
            "JOINT_FUSED_BATCH_SIZE=0"
        )

    layers = list(getattr(getattr(model, "encoder", None), "layers", None) or [])
    for layer in layers:
        if settings.compile_encoder and layer._compiled_call_impl is None:
            layer.compile(dynamic=True)
        elif not settings.compile_encoder:
            layer._compiled_call_impl = None
    if settings.compile_encoder and layers:
        changed.append(f"{len(layers)} encoder layers compiled (torch.compile, dynamic shapes)")
    return changed


def adamw_options(settings: SpeedSettings) -> dict:
    """AdamW's keyword arguments for ``settings``: ``fused=True`` with FUSED_ADAMW, else nothing
    (torch's own choice, the multi-tensor kernels on CUDA)."""
    return {"fused": True} if settings.fused_adamw else {}


def keep_kernel_choice(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` keep its own kernel choice (fused, foreach) when it loads a state dict.

    torch's ``load_state_dict`` takes every key of the saved parameter groups, ``fused`` included:
    a job resumed with FUSED_ADAMW=1 from a checkpoint saved without it would run unfused, and the
    other way round. The saved groups get this optimizer's choice before the load, and the step
    counters the place that choice keeps them (on the parameter's device when fused, which torch's
    load then does; a float32 host tensor otherwise)."""

    def own_kernels(opt, state_dict):
        for saved, own in zip(state_dict["param_groups"], opt.param_groups):
            saved["fused"], saved["foreach"] = own.get("fused"), own.get("foreach")
            if own.get("fused") or own.get("capturable"):
                continue
            for index in saved["params"]:
                step = state_dict["state"].get(index, {}).get("step")
                if torch.is_tensor(step):
                    state_dict["state"][index]["step"] = step.to("cpu", torch.float32)
        return state_dict

    optimizer.register_load_state_dict_pre_hook(own_kernels)


def reuse_host_memory(on: bool) -> bool:
    """Have glibc's malloc keep freed memory for reuse (``on``: no mmap of its own per large block,
    no trimming of the heap's top), or, where this process turned that on, behave as by default
    again. A process that never turned it on is left untouched: setting either parameter stops
    glibc adapting its mmap threshold by itself. Forked processes (DataLoader workers) inherit it.
    Returns whether reuse is on now (False where the C library has no ``mallopt``: not glibc).

    A large block that malloc maps by itself is unmapped when freed, so every step's tensors of
    tens or hundreds of MB are faulted in again a 4 kB page at a time; kept in the heap they are
    reused as they are. The process keeps what it once held mapped until it ends, and the heap's
    fragments may hold more than one step's peak (steps of 160 MB of tensors settled at 650 MB of
    RSS; the demo's finetune peaked at 1,533 MiB with it, 1,614 without)."""
    global _reusing
    if on == _reusing:
        return _reusing
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if on:
        _reusing = bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_MMAP_MAX, 0))
    else:
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        _reusing = False
    return _reusing


def apply_to_process(settings: SpeedSettings, *, on_cpu: bool) -> list[str]:
    """The process-wide part: float32 matmul precision and host memory reuse (``on_cpu``: the step
    runs on the CPU). Returns what differs from the process's defaults, for the log."""
    torch.set_float32_matmul_precision(settings.matmul_precision)
    if reuse_host_memory(settings.reuses_host_memory(on_cpu)):
        return ["freed host memory kept for reuse (HOST_MEMORY_REUSE)"]
    return []


def describe(settings: SpeedSettings, changes: list[str]) -> str:
    """One line for the start-up log: what runs differently from the model's and the process's own
    settings (``changes``: what ``apply_to_model`` and ``apply_to_process`` returned)."""
    parts = list(changes)
    if settings.fused_adamw:
        parts.append("fused AdamW")
    if settings.matmul_precision != "highest":
        parts.append(f"float32 matmuls at precision {settings.matmul_precision}")
    return "; ".join(parts) if parts else "as the model's config says"
