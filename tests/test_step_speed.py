"""step_speed.py: each step-speed knob changes how the step runs, not what it computes, and a model
can go back to its own settings."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

import asr_model
import config
import step_speed
from dataset import collate_asr_batch
from step_speed import SpeedSettings
from tests.tiny_training_data import make_training_data
from training_step import TrainingModule

TINY = config.REPO_DIR / "configs" / "tiny_tdt.yaml"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    data = make_training_data(
        tmp_path_factory.mktemp("speed"), per_lang=4, langs=("hi", "en"), vocab_size=64
    )
    return data["tokenizer"]


@pytest.fixture(scope="module")
def fused_config(tmp_path_factory):
    """The tiny model with NeMo's fused joint + loss, sub-batches of 4 (as Parakeet's config)."""
    cfg = OmegaConf.load(TINY)
    cfg.model.joint.fuse_loss_wer = True
    cfg.model.joint.fused_batch_size = 4
    path = tmp_path_factory.mktemp("cfg") / "tiny_fused.yaml"
    OmegaConf.save(cfg, path)
    return path


def build(tokenizer_dir, model_config=TINY):
    torch.manual_seed(0)
    return asr_model.build_model(
        init_model="", model_config=model_config, tokenizer_dir=tokenizer_dir
    )


def batch_of(n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    items = [
        {
            "signal": 0.05 * torch.randn(int((1.0 + 0.3 * i) * 16000), generator=g),
            "tokens": torch.randint(1, vocab, (3 + i % 4,), generator=g),
            "duration": 1.0 + 0.3 * i,
            "lang": "hi",
            "index": i,
        }
        for i in range(n)
    ]
    return collate_asr_batch(items)


def eval_loss(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return asr_model.training_loss(model, batch, encoder_frozen=True)


def encoded(model, batch):
    model.eval()
    with torch.no_grad():
        out, lengths = model.forward(
            input_signal=batch.signal, input_signal_length=batch.signal_len
        )
    return out, lengths


def test_sdpa_computes_the_same_encoder_output_through_torchs_attention(tokenizer_dir, monkeypatch):
    model = build(tokenizer_dir)
    batch = batch_of(3, 60)
    plain, lengths = encoded(model, batch)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    changes = step_speed.apply_to_model(model, SpeedSettings(sdpa="1"))
    fused, _ = encoded(model, batch)
    # softmax(QK^T/sqrt(d) + positional scores) V, one call per layer and forward
    assert len(calls) == model.encoder.n_layers and changes
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(fused[i, :, :n], plain[i, :, :n], rtol=1e-5, atol=1e-5)
    # back to the model's own setting (its config says false): NeMo's path, no SDPA call
    calls.clear()
    assert step_speed.apply_to_model(model, SpeedSettings()) == []
    encoded(model, batch)
    assert calls == [] and not any(m.use_pytorch_sdpa for m in step_speed.attention_modules(model))


def test_a_larger_fused_batch_gives_the_same_loss_in_fewer_sub_batches(tokenizer_dir, fused_config):
    model = build(tokenizer_dir, fused_config)
    batch = batch_of(7, 60)
    sub_batches = []
    handle = model.loss.register_forward_hook(lambda *a: sub_batches.append(1))
    own = eval_loss(model, batch)
    assert len(sub_batches) == 2  # 7 utterances in sub-batches of 4: 4 + 3
    sub_batches.clear()
    step_speed.apply_to_model(model, SpeedSettings(fused_batch_size=16))
    larger = eval_loss(model, batch)
    assert len(sub_batches) == 1 and model.joint.fused_batch_size == 16
    torch.testing.assert_close(larger, own, rtol=1e-5, atol=1e-6)
    handle.remove()
    step_speed.apply_to_model(model, SpeedSettings())
    assert model.joint.fused_batch_size == 4


def test_a_fused_batch_size_for_an_unfused_joint_is_refused_in_one_line(tokenizer_dir):
    model = build(tokenizer_dir)  # tiny_tdt.yaml: fuse_loss_wer false
    with pytest.raises(config.ConfigError, match="JOINT_FUSED_BATCH_SIZE=8") as err:
        step_speed.apply_to_model(model, SpeedSettings(fused_batch_size=8))
    assert "\n" not in str(err.value)


def adamw_step(fused: bool, params, grads):
    opt = torch.optim.AdamW(
        params,
        lr=1e-2,
        betas=(0.9, 0.98),
        weight_decay=1e-3,
        **step_speed.adamw_options(SpeedSettings(fused_adamw=fused)),
    )
    for _ in range(3):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return opt


def test_fused_adamw_makes_the_same_update(tokenizer_dir):
    torch.manual_seed(0)
    start = [torch.randn(5, 7), torch.randn(11)]
    grads = [torch.randn_like(t) for t in start]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    adamw_step(False, plain, grads)
    opt = adamw_step(True, fused, grads)
    assert opt.param_groups[0]["fused"] is True
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("saved_fused,own_fused", [(False, True), (True, False)])
def test_a_resumed_optimizer_keeps_the_jobs_own_kernel_choice(saved_fused, own_fused):
    """FUSED_ADAMW may change on a requeue: the loaded state must not switch the kernel back."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4))]
    saved = adamw_step(saved_fused, params, [torch.randn(4)])
    opt = torch.optim.AdamW(
        params, lr=1e-2, **step_speed.adamw_options(SpeedSettings(fused_adamw=own_fused))
    )
    step_speed.keep_kernel_choice(opt)
    opt.load_state_dict(saved.state_dict())
    assert bool(opt.param_groups[0]["fused"]) is own_fused
    assert float(opt.state[params[0]]["step"]) == 3.0  # the moments and the count came along
    params[0].grad = torch.ones(4)
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 4.0


def test_the_training_module_builds_its_adamw_from_the_knob(tokenizer_dir, monkeypatch):
    monkeypatch.setattr(config, "FUSED_ADAMW", "1")
    module = TrainingModule(build(tokenizer_dir))
    optimizer = module.configure_optimizers()["optimizer"]
    assert all(group["fused"] for group in optimizer.param_groups)


def test_compiling_the_encoder_layers_keeps_the_checkpoints_names(tokenizer_dir):
    model = build(tokenizer_dir)
    names = list(model.state_dict())
    changes = step_speed.apply_to_model(model, SpeedSettings(compile_encoder=True))
    assert all(layer._compiled_call_impl is not None for layer in model.encoder.layers)
    assert list(model.state_dict()) == names and "compiled" in changes[0]
    step_speed.apply_to_model(model, SpeedSettings())
    assert all(layer._compiled_call_impl is None for layer in model.encoder.layers)


def test_matmul_precision_is_set_for_the_process():
    before = torch.get_float32_matmul_precision()
    try:
        step_speed.apply_to_process(
            SpeedSettings(matmul_precision="high", host_memory_reuse="0"), on_cpu=True
        )
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


# Steps of a few large tensors (160 MiB), made and freed, in a fresh process: the page faults of the
# steps after the first ten (the heap takes a few steps to settle into the blocks a step needs).
REFAULTS = """
import resource, sys, torch, step_speed
from step_speed import SpeedSettings
on_cpu = sys.argv[2] == "cpu"
changes = step_speed.apply_to_process(SpeedSettings(host_memory_reuse=sys.argv[1]), on_cpu=on_cpu)
def step():
    a = torch.ones(16 * 2**20); b = a * 2; c = torch.ones(8 * 2**20)
    return float(b[0] + c[0])
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5, bool(changes))
"""


@pytest.mark.parametrize(
    "setting, device, reused",
    [("auto", "cpu", True), ("auto", "gpu", False), ("1", "gpu", True), ("0", "cpu", False)],
)
def test_freed_host_memory_is_reused_without_faulting_it_in_again(setting, device, reused):
    """HOST_MEMORY_REUSE: the large blocks torch frees serve the next step's tensors as they are
    (auto: when the step runs on the CPU); otherwise the kernel takes them back and each of their
    4 kB pages faults in again every step (40,960 for 160 MiB)."""
    out = subprocess.run(
        [sys.executable, "-c", REFAULTS, setting, device],
        cwd=config.REPO_DIR,
        capture_output=True,
        text=True,
    )
    faults, logged = out.stdout.split()
    assert logged == str(reused), out.stderr[-2000:]
    if reused:
        assert int(faults) < 2_000
    else:
        assert int(faults) > 10_000


def test_levers_name_the_setting_they_turn_on():
    base = SpeedSettings()
    assert base.with_lever("sdpa").sdpa == "1"
    assert base.with_lever("fused-batch-size=12").fused_batch_size == 12
    assert base.with_lever("fused-adamw").fused_adamw
    with pytest.raises(ValueError, match="unknown lever 'fast'"):
        base.with_lever("fast")


def test_the_knobs_are_read_from_the_environment(monkeypatch):
    env = {
        "USE_PYTORCH_SDPA": "1",
        "JOINT_FUSED_BATCH_SIZE": "16",
        "FUSED_ADAMW": "1",
        "COMPILE_ENCODER": "0",
        "MATMUL_PRECISION": "high",
    }
    knobs = config.read_config(env)
    for name, value in env.items():
        monkeypatch.setattr(config, name, knobs[name].value)
    assert SpeedSettings.from_config() == SpeedSettings("1", 16, True, False, "high")
    with pytest.raises(config.ConfigError, match="USE_PYTORCH_SDPA"):
        config.read_config({"USE_PYTORCH_SDPA": "yes"})


def test_a_requeue_may_change_how_the_step_runs():
    import checkpoints

    timeline = checkpoints.timeline_settings()
    for name in (
        "USE_PYTORCH_SDPA",
        "JOINT_FUSED_BATCH_SIZE",
        "FUSED_ADAMW",
        "COMPILE_ENCODER",
        "MATMUL_PRECISION",
        "HOST_MEMORY_REUSE",
    ):
        assert name in config.KNOBS and name not in timeline, name
