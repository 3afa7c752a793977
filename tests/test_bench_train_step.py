"""benchmarks/bench_train_step.py: a whole run times both phases on both sides and prints the ratio."""

from __future__ import annotations

import json

import pytest

import config
from benchmarks import bench_train_step as bench
from tests.tiny_training_data import make_training_data


@pytest.mark.slow
def test_bench_times_both_phases_against_nemo_and_prints_the_ratio(tmp_path, monkeypatch, capsys):
    data = make_training_data(tmp_path, per_lang=4, langs=("hi", "en"), vocab_size=64)
    monkeypatch.setattr(config, "TOKENIZER_DIR", data["tokenizer"])
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 20.0)
    assert bench.main(["--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    # at MAX_BATCH_DURATION 20: two copies of the 20 s longest reach the most padded frames packed
    assert "B parameters" in out and "2 utterances, 40.0 s of audio, longest 20.0 s" in out
    for phase in (1, 2):
        assert (
            f"phase {phase} project: median step" in out
            and f"phase {phase} nemo   : median step" in out
        )
        assert f"phase {phase} ratio project / NeMo step time:" in out


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch):
    data = make_training_data(tmp_path, per_lang=4, langs=("hi", "en"), vocab_size=64)
    monkeypatch.setattr(config, "TOKENIZER_DIR", data["tokenizer"])
    monkeypatch.setattr(config, "MAX_BATCH_DURATION", 10.0)
    return tmp_path


@pytest.mark.slow
def test_profile_prints_where_an_optimizer_step_of_several_micro_batches_goes(tiny_bench, capsys):
    trace = tiny_bench / "trace.json"
    args = ["--profile", "--warmup", "1", "--grad-accum", "2", "--trace", str(trace)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "where one phase-2 optimizer step's time goes (2 micro-batch(es) of" in out
    for row in ("encoder forward", "encoder backward", "joint backward", "TDT loss backward"):
        assert f"\n{row} " in out, row
    assert "optimizer (AdamW step, zero_grad)" in out and "wall " in out
    events = json.loads(trace.read_text())["traceEvents"]
    # both micro-batches are in the trace: the encoder ran twice
    assert sum(e.get("name") == "part: encoder" for e in events) == 2


@pytest.mark.slow
def test_levers_time_each_on_against_off_and_compare_the_loss(tiny_bench, capsys):
    args = ["--levers", "sdpa,fused-adamw", "--steps", "1", "--warmup", "0", "--rounds", "2"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if "on/off" in line}
    assert set(lines) == {"sdpa", "fused-adamw"}
    for line in lines.values():
        assert "paired rounds" in line and line.count(",") >= 1
    # SDPA computes the same attention: in float32 the loss agrees far below bf16's resolution
    diff = float(lines["sdpa"].rsplit("relative difference ", 1)[1].rstrip(")"))
    assert diff < 1e-4


def test_the_prediction_says_it_is_one_and_follows_the_flop_count(tiny_bench, capsys):
    assert bench.main(["--predict-mfu", "40", "--peak-tflops", "1000"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "PREDICTED (not measured)" in line]
    assert len(lines) == 2
    for line in lines:
        gflop = float(line.split(": ")[1].split(" GFLOP")[0])
        step_s = float(line.split("a step, ")[1].split(" s/step")[0])
        # step time = FLOPs / (MFU x peak)
        assert gflop > 0 and step_s == pytest.approx(gflop * 1e9 / (0.4 * 1000e12), rel=0.01)


@pytest.mark.parametrize("utterances,seconds", [(1, 3.0), (3, 7.3), (4, 20.0)])
def test_the_encoder_flop_count_is_the_count_torchs_flop_counter_makes(
    tmp_path, utterances, seconds
):
    """The reference is torch's own FlopCounterMode over the encoder's forward (every matmul and
    convolution, relative-position scores T x (2T - 1) and one position table per batch)."""
    from pathlib import Path

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import asr_model

    data = make_training_data(tmp_path, per_lang=3, vocab_size=64)
    model = asr_model.build_model(
        "", Path(config.REPO_DIR) / "configs" / "tiny_tdt.yaml", data["tokenizer"]
    ).eval()
    samples = int(seconds * config.TARGET_SAMPLE_RATE)
    with torch.no_grad():
        features, lengths = model.preprocessor(
            input_signal=torch.randn(utterances, samples),
            length=torch.full((utterances,), samples),
        )
        with FlopCounterMode(display=False) as counter:
            model.encoder(audio_signal=features, length=lengths)
    mel_frames = samples // model.preprocessor.featurizer.hop_length + 1
    assert mel_frames == features.shape[-1]
    counted = bench.encoder_forward_flops(model.encoder, utterances, mel_frames)
    assert counted == counter.get_total_flops()


@pytest.mark.slow
def test_keep_base_times_steps_with_the_frozen_copy_against_without(
    tiny_bench, capsys, monkeypatch
):
    """The copy the run would make (float32 for L2-SP), its size, and paired rounds of phase-2
    steps with it against without; the shell's DISTILL_WEIGHT of 0 is left as it was."""
    monkeypatch.setattr(config, "L2SP_WEIGHT", 1.0)
    args = ["--keep-base", "--steps", "1", "--warmup", "0", "--rounds", "2"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert (
        "the base kept: a frozen copy of " in out and "(float32 weights), DISTILL_WEIGHT=1" in out
    )
    (line,) = [line for line in out.splitlines() if line.startswith("keep-base: on/off")]
    assert "paired rounds" in line and "peak" in line
    assert config.DISTILL_WEIGHT == 0.0


@pytest.mark.slow
def test_frozen_base_times_steps_of_the_adapters_against_the_whole_model(tiny_bench, capsys):
    """The frozen base the run would make, what it trains against the whole model (its
    gradients and AdamW moments, 12 bytes a parameter), and paired rounds of phase-2 steps."""
    import re

    args = ["--frozen-base", "8", "--steps", "1", "--warmup", "0", "--rounds", "2"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    found = re.search(r"trains ([\d,]+) parameters .* against ([\d,]+): gradients", out)
    frozen, whole = (int(n.replace(",", "")) for n in found.groups())
    assert 0 < frozen < whole / 2
    (line,) = [line for line in out.splitlines() if line.startswith("frozen-base: frozen/whole")]
    assert "paired rounds" in line and "peak" in line
