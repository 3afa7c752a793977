"""scripts/preflight.py: each check's verdicts, run as a user runs it (one process and torchrun on
CPU over a tiny corpus with its training cache), and its pure parts (driver rule, rank merge,
checkpoint space) directly."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest

import asr_model
import config
from scripts import preflight
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import run_torchrun, tiny_train_env, torchrun_command

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "preflight.py"
TINY = REPO / "configs" / "tiny_tdt.yaml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    data = make_training_data(root, per_lang=16, vocab_size=64)
    env = tiny_train_env(data, DATA_DIR=str(root / "data"), MODEL_CONFIG=str(TINY))
    build_caches(env)
    return root, data, env


def build_caches(env: dict) -> None:
    """scripts/build_training_cache.py run as a user runs it, in ``env``."""
    built = subprocess.run(
        [sys.executable, "scripts/build_training_cache.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    # NeMo's OneLogger telemetry, off in this app, says so when NeMo is imported: not to the user
    for note in ("No exporters were provided", "OneLogger: Setting error_handling_strategy"):
        assert note not in built.stdout + built.stderr, note


def preflight_run(env: dict, *args: str, torchrun: bool = False) -> tuple[int, dict[str, str], str]:
    """(exit code, {check: its line}, output) of scripts/preflight.py."""
    cmd = torchrun_command(SCRIPT) if torchrun else [sys.executable, str(SCRIPT)]
    result = subprocess.run(
        [*cmd, "--data-seconds", "10", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    lines = {}
    for line in result.stdout.splitlines():
        found = re.match(r"^(ok|warn|fail|skip)\s+(\S+)\s", line)
        if found:
            lines[found.group(2)] = line
    return result.returncode, lines, out


def verdict(line: str) -> str:
    return line.split()[0]


def test_a_cpu_node_with_its_data_in_place_passes_and_says_what_it_skipped(corpus):
    """With the augmentation a job may run with (speed factors, generated noise): the data check
    reads through it."""
    _, _, env = corpus
    env = dict(env, SPEED_PERTURB="0.9,1.0,1.1", NOISE_PROB="0.5")
    code, lines, out = preflight_run(env, "--consume-audio-per-second", "0.01")
    assert code == 0, out[-3000:]
    assert {name: verdict(line) for name, line in lines.items()} == {
        "gpu": "skip",
        "schedule": "ok",
        "inputs": "ok",
        "augmentation": "ok",
        "model": "ok",
        "tdt-loss": "skip",
        "caches": "ok",
        "step": "ok",
        "max-batch": "skip",
        "all-reduce": "skip",
        "data": "ok",
        "checkpoints": "ok",
        "wandb": "ok",
    }, out[-3000:]
    assert re.search(r"phase 1 [\d.]+ s, phase 2 [\d.]+ s a micro-batch", lines["step"])
    assert "MAX_BATCH_DURATION=6's padding bound:" in lines["step"]
    assert re.search(r"\d+ audio s/s per rank \(NUM_WORKERS=1, cold", lines["data"])
    assert "of the training sampler, augmented as configured" in lines["data"]
    assert "speed factors 0.9,1,1.1; noise on 50% of utterances" in lines["augmentation"]
    assert "generated noise" in lines["augmentation"]
    assert "4 skipped (gpu, tdt-loss, max-batch, all-reduce)" in out


@pytest.mark.parametrize("refused", ["noise_dir", "resume_past_max_steps"])
def test_a_setting_train_py_refuses_fails_preflight_with_the_same_message(
    corpus, tmp_path, refused
):
    _, _, env = corpus
    if refused == "noise_dir":
        missing = tmp_path / "noise_not_mounted"
        env = dict(env, NOISE_PROB="0.5", NOISE_DIR=str(missing), MAX_STEPS="1")
        check, refusal = "augmentation", f"NOISE_DIR={missing} is not a directory"
    else:  # a step checkpoint past MAX_STEPS: MAX_STEPS lowered by mistake
        directory = tmp_path / "checkpoints"
        directory.mkdir()
        import torch

        torch.save({"global_step": 9, "state_dict": {}}, directory / "step_00000009.ckpt")
        env = dict(env, CHECKPOINT_DIR=str(directory), RESUME_FROM="last", MAX_STEPS="4")
        check, refusal = "inputs", "at optimizer step 9, past MAX_STEPS=4"
    code, lines, out = preflight_run(env, "--consume-audio-per-second", "0.01")
    assert code == 1, out[-3000:]
    assert verdict(lines[check]) == "fail" and refusal in lines[check], lines[check]
    assert f"failed ({check})" in out
    trained = subprocess.run(
        [sys.executable, "train.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert trained.returncode == 2 and refusal in trained.stderr, trained.stderr[-3000:]


def test_slow_data_and_an_unreachable_wandb_warn_without_failing(corpus):
    _, _, env = corpus
    env = dict(env, NUM_WORKERS="0", WANDB_MODE="online", WANDB_BASE_URL="http://127.0.0.1:9")
    code, lines, out = preflight_run(env, "--consume-audio-per-second", "1e9")
    assert code == 0, out[-3000:]
    assert verdict(lines["data"]) == "warn" and "raise NUM_WORKERS" in lines["data"], lines["data"]
    assert verdict(lines["wandb"]) == "warn" and "log offline" in lines["wandb"], lines["wandb"]


def test_unreadable_audio_fails_the_data_check_and_the_exit_code(corpus, tmp_path):
    root, data, env = corpus
    moved = tmp_path / "shards"
    shutil.move(root / "shards", moved)
    try:
        code, lines, out = preflight_run(env, "--consume-audio-per-second", "0.01")
    finally:
        shutil.move(moved, root / "shards")
    assert code == 1, out[-3000:]
    assert verdict(lines["data"]) == "fail" and "DATA_DIR" in lines["data"], lines["data"]
    assert "1 failed (data)" in out


def test_without_a_training_cache_the_data_check_reads_a_sample_of_the_manifest(corpus, tmp_path):
    _, data, env = corpus
    manifest = tmp_path / "other.parquet"
    shutil.copy(data["manifest"], manifest)
    code, lines, out = preflight_run(
        dict(env, TRAIN_MANIFEST_PATH=str(manifest)), "--consume-audio-per-second", "0.01"
    )
    assert code == 0, out[-3000:]
    assert verdict(lines["caches"]) == "warn" and "build_training_cache.py" in lines["caches"]
    assert verdict(lines["data"]) == "ok", lines["data"]
    assert "of other.parquet at random, no training cache" in lines["data"]


def test_without_a_training_cache_unreachable_audio_fails_the_data_check(corpus, tmp_path):
    root, data, env = corpus
    manifest = tmp_path / "other.parquet"
    shutil.copy(data["manifest"], manifest)
    moved = tmp_path / "shards"
    shutil.move(root / "shards", moved)
    try:
        code, lines, out = preflight_run(dict(env, TRAIN_MANIFEST_PATH=str(manifest)))
    finally:
        shutil.move(moved, root / "shards")
    assert code == 1, out[-3000:]
    assert verdict(lines["data"]) == "fail" and "DATA_DIR" in lines["data"], lines["data"]


def test_too_little_data_for_the_ranks_is_a_fail_line_with_the_fix(corpus):
    _, _, env = corpus
    code, lines, out = preflight_run(dict(env, GRAD_ACCUM="1000"))
    assert code == 1, out[-3000:]
    assert verdict(lines["data"]) == "fail", lines["data"]
    assert (
        "fewer than the 1000 of one optimizer step (world size 1 x GRAD_ACCUM=1000)"
        in lines["data"]
    )
    assert "-> set GRAD_ACCUM=" in lines["data"] and " or EPOCH_SIZE=" in lines["data"]
    # fewer utterances than micro-batches needed: no MAX_BATCH_DURATION can give one step
    assert "MAX_BATCH_DURATION=" not in lines["data"], lines["data"]
    assert "unexpected error" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_under_torchrun_the_all_reduce_is_measured_and_every_rank_reports(corpus):
    _, _, env = corpus
    code, lines, out = preflight_run(
        env, "--consume-audio-per-second", "0.01", "--data-files", "16", torchrun=True
    )
    assert code == 0, out[-3000:]
    assert verdict(lines["all-reduce"]) == "ok", out[-3000:]
    assert re.search(r"gloo over 2 ranks: [\d.]+ GB/s bus bandwidth", lines["all-reduce"])
    assert "[2 ok]" in lines["step"]


RANK_1_WITHOUT_MODEL = textwrap.dedent(
    """
    import os, sys
    import asr_model
    from scripts import preflight
    if os.environ["RANK"] == "1":
        def broken(*args, **kwargs):
            raise RuntimeError("rank 1 cannot build its model")
        asr_model.build_model = broken
    sys.exit(preflight.main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_a_rank_that_fails_a_check_is_named_in_the_report_instead_of_hanging_the_others(
    corpus, tmp_path
):
    _, _, env = corpus
    probe = tmp_path / "probe_preflight.py"
    probe.write_text(RANK_1_WITHOUT_MODEL)
    # Shorter than the test's limit: a collective left waiting would end the job, not the report.
    env = dict(env, COLLECTIVE_TIMEOUT_MINUTES="3", PYTHONPATH=str(REPO))
    result = run_torchrun(probe, env, REPO, timeout=170, log_path=tmp_path / "preflight.log")
    lines = dict(
        (found.group(2), found.group(0))
        for found in re.finditer(r"^(ok|warn|fail|skip)\s+(\S+)\s.*$", result.stdout, re.M)
    )
    assert "model" in lines, result.stdout[-3000:]
    assert lines["model"].startswith("fail  model        rank 1: RuntimeError: rank 1 cannot"), (
        lines["model"]
    )
    assert "[1 ok, 1 fail]" in lines["model"]
    assert verdict(lines["all-reduce"]) == "skip", lines["all-reduce"]
    assert "not measured: rank(s) 1 cannot take part" in lines["all-reduce"]
    assert verdict(lines["step"]) == "skip" and "[1 ok, 1 skip]" in lines["step"], lines["step"]
    assert result.returncode != 0


def test_the_step_line_says_its_padded_seconds_are_a_bound_not_a_batch_over_the_limit():
    """8 copies of a 3.925 s utterance: 31.4 s padded, more than MAX_BATCH_DURATION=20, which the
    phrase says every real batch's audio stays within."""
    import max_batch

    shape = max_batch.BatchShape(durations=[3.925] * 8, tokens=[12] * 8)
    phrase = preflight.heaviest_batch_phrase(shape, 20.0)
    assert phrase.startswith("MAX_BATCH_DURATION=20's padding bound: 8 x the longest utterance")
    assert "(3.9 s) = 31.4 s padded, 12 tokens each" in phrase
    assert "at most 20 s of audio" in phrase


def test_driver_rule_follows_torchs_cuda_major():
    assert preflight.driver_verdict(13000, "13.0") == ("ok", "")
    verdict_, advice = preflight.driver_verdict(12080, "13.0")
    assert verdict_ == "fail" and "CUDA 12.8" in advice and ">= 580" in advice
    assert preflight.driver_verdict(12040, "12.4")[0] == "ok"
    assert preflight.driver_verdict(None, None)[0] == "fail"


def test_the_drivers_cuda_version_comes_from_the_bindings_then_nvml_then_libcuda(monkeypatch):
    import ctypes
    import types

    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = types.SimpleNamespace(cuDriverGetVersion=lambda: (0, 13000))
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12080
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert preflight.driver_cuda_version() == (13000, "cuda.bindings")
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # not installed
    assert preflight.driver_cuda_version() == (12080, "NVML")
    monkeypatch.setitem(sys.modules, "pynvml", None)

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    version, why = preflight.driver_cuda_version()
    assert version is None
    assert why == "cuda.bindings: ModuleNotFoundError; NVML: ModuleNotFoundError; libcuda: OSError"
    assert (
        preflight.cuda_version_text(13000) == "13.0"
        and preflight.cuda_version_text(12080) == "12.8"
    )


def test_merge_keeps_the_worst_rank_and_the_split():
    Check = preflight.Check
    merged = preflight.merge(
        [
            [Check("data", "ok", "900 audio s/s"), Check("gpu", "ok", "H100")],
            [
                Check("data", "warn", "300 audio s/s", "raise NUM_WORKERS"),
                Check("gpu", "ok", "H100"),
            ],
        ]
    )
    assert [c.name for c in merged] == ["data", "gpu"]
    assert merged[0].verdict == "warn"
    assert merged[0].figure == "rank 1: 300 audio s/s [1 ok, 1 warn]"
    assert merged[0].line().endswith("-> raise NUM_WORKERS")


def test_checkpoint_space_fails_below_one_save_and_warns_below_the_next_ones(tmp_path, monkeypatch):
    model = asr_model.build_model(
        init_model="", model_config=TINY, tokenizer_dir=make_training_data(tmp_path)["tokenizer"]
    )
    node = preflight.Node(model=model)
    monkeypatch.setattr(config, "CHECKPOINT_DIR", tmp_path / "checkpoints")
    monkeypatch.setattr(config, "KEEP_CHECKPOINTS", 2)
    import checkpoints
    from training_step import TrainingModule

    size = checkpoints.estimated_checkpoint_bytes(TrainingModule(model))
    usage = namedtuple("usage", "total used free")
    for free, expected in ((size // 2, "fail"), (2 * size, "warn"), (10 * size, "ok")):
        monkeypatch.setattr(shutil, "disk_usage", lambda _p, f=free: usage(10**12, 0, f))
        check = preflight.check_checkpoints(node)
        assert check.verdict == expected, check.line()
    assert "room for 10, the next 3 wanted" in check.figure


def test_gpus_torch_cannot_use_fail_and_a_cpu_run_skips_the_gpu_check(monkeypatch):
    import torch

    node = preflight.Node(device=torch.device("cpu"))
    smi = ["NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB, 0 MiB"]
    monkeypatch.setattr(preflight, "nvidia_smi", lambda: smi)
    monkeypatch.setattr(config, "ACCELERATOR", "auto")
    check = preflight.check_gpu(node)
    assert check.verdict == "fail" and "lists 1 GPU(s)" in check.figure, check.line()
    assert "requirements-gpu.txt" in check.advice
    monkeypatch.setattr(config, "ACCELERATOR", "cpu")
    assert preflight.check_gpu(node).verdict == "skip"
    monkeypatch.setattr(preflight, "nvidia_smi", lambda: [])
    monkeypatch.setattr(config, "ACCELERATOR", "gpu")
    check = preflight.check_gpu(node)
    assert check.verdict == "fail" and "no GPU" in check.advice, check.line()


def test_a_warmup_longer_than_the_run_warns_in_the_schedule_check(monkeypatch):
    monkeypatch.setattr(config, "WARMUP_STEPS", 5000)
    monkeypatch.setattr(config, "MAX_STEPS", 3)
    check = preflight.check_schedule()
    assert check.verdict == "warn"
    assert "WARMUP_STEPS=5000 is longer than phase 1 (3 optimizer steps" in check.figure


def test_the_header_names_the_precision_a_cpu_step_runs_with(monkeypatch):
    import dataclasses
    from types import SimpleNamespace

    import torch

    import config
    from scripts import preflight

    knob = config.KNOBS["PRECISION"]
    monkeypatch.setitem(config.KNOBS, "PRECISION", dataclasses.replace(knob, source="default"))
    monkeypatch.setattr(config, "PRECISION", "bf16-mixed")
    node = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    assert "PRECISION=32-true (the CPU's; PRECISION=bf16-mixed is for GPUs)" in preflight.header(
        node
    )
    monkeypatch.setitem(config.KNOBS, "PRECISION", dataclasses.replace(knob, source="env"))
    assert preflight.header(node).endswith("PRECISION=bf16-mixed")


def test_a_validation_manifest_with_nothing_to_score_fails_the_caches_check(corpus, tmp_path):
    import pyarrow.parquet as pq

    _, data, env = corpus
    table = pq.read_table(data["manifest"])
    val = tmp_path / "val.parquet"
    # every row holding more tokens than its audio has encoder frames: read, then all dropped
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("duration"), "duration", [[0.01] * table.num_rows]
        ),
        val,
    )
    env = dict(env, VAL_MANIFEST_PATH=str(val), EVAL_EVERY_STEPS="5")
    build_caches(env)
    code, lines, out = preflight_run(env, "--consume-audio-per-second", "0.01")
    assert code == 1, out[-3000:]
    line = lines["caches"]
    assert verdict(line) == "fail", line
    assert f"VAL_MANIFEST_PATH={val} has no utterance to score ({table.num_rows} rows read" in line
    assert "EVAL_EVERY_STEPS=0" in out
