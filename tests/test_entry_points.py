"""Every entry point behaves the same way before any work: --help prints usage and runs nothing, a bad
or misspelt knob is one line and exit code 2, inputs are checked before a model is built or
downloaded, a run never writes into another run's CHECKPOINT_DIR, and an unreachable W&B server
turns the run offline instead of ending it. Each test runs the real script as a user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import config
import run_logging
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import free_port, tiny_train_env

REPO = Path(__file__).resolve().parents[1]

# (script, the config.STEPS name whose knobs its --help lists)
STEP_SCRIPTS = [
    ("scripts/make_demo_corpus.py", "demo_corpus"),
    ("scripts/extract_audio.py", "extract_audio"),
    ("build_manifest.py", "build_manifest"),
    ("scripts/make_train_val.py", "make_train_val"),
    ("scripts/train_tokenizer.py", "train_tokenizer"),
    ("scripts/build_training_cache.py", "build_cache"),
    ("train.py", "train"),
    ("scripts/evaluate.py", "evaluate"),
    ("scripts/export_nemo.py", "export_nemo"),
    ("scripts/transcribe.py", "transcribe"),
    ("scripts/manifest_report.py", "manifest_report"),
    ("scripts/preflight.py", "preflight"),
]
OTHER_SCRIPTS = sorted(
    str(p.relative_to(REPO))
    for p in (REPO / "scripts").glob("*.py")
    if "def main" in p.read_text() and str(p.relative_to(REPO)) not in dict(STEP_SCRIPTS)
)


def clean_env(tmp_path: Path, **extra: str) -> dict:
    """The caller's environment without any knob, with DATA_DIR in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in config.KNOBS}
    env.update(DATA_DIR=str(tmp_path / "data"), PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def run(args: list[str], env: dict, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_every_user_step_is_covered():
    assert sorted(step for _, step in STEP_SCRIPTS) == sorted(config.STEPS)


@pytest.mark.parametrize("script, step", STEP_SCRIPTS)
def test_help_prints_usage_and_the_knobs_the_step_reads_and_runs_nothing(tmp_path, script, step):
    proc = run([sys.executable, str(REPO / script), "--help"], clean_env(tmp_path), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")
    for knob in config.KNOBS.values():
        listed = f"  {knob.name}=" in proc.stdout
        reads = config.STEP_READS_AS.get(step, step) in knob.steps
        assert listed == reads, f"{knob.name} in the --help of {script}"
    assert list(tmp_path.iterdir()) == [], "--help created files"


@pytest.mark.parametrize("script", OTHER_SCRIPTS)
def test_every_other_script_has_a_help_that_runs_nothing(tmp_path, script):
    proc = run([sys.executable, str(REPO / script), "--help"], clean_env(tmp_path), tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["scripts/demo.sh", "scripts/slurm_train.sh"])
def test_shell_entry_points_have_a_help_that_runs_nothing(tmp_path, script):
    env = clean_env(tmp_path, DEMO_DIR=str(tmp_path / "demo"), PY=sys.executable)
    for flag in ("--help", "-h"):
        proc = run(["bash", str(REPO / script), flag], env, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "make demo" in proc.stdout if "demo" in script else "sbatch" in proc.stdout
        assert "MAX_STEPS=" in proc.stdout  # the knobs it sets or passes on
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "script",
    [s for s, _ in STEP_SCRIPTS]
    + ["config.py", "scripts/demo_summary.py", "scripts/run_report.py"],
)
@pytest.mark.parametrize("knob", ["VOCAB_SIZE=12k", "MAX_STEP=10"])
def test_a_bad_or_misspelt_knob_is_one_line_and_exit_code_2_in_every_script(tmp_path, script, knob):
    name, value = knob.split("=")
    proc = run([sys.executable, str(REPO / script)], clean_env(tmp_path, **{name: value}), tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and name in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if name == "MAX_STEP":
        assert "MAX_STEP is not a setting; did you mean MAX_STEPS?" in errors[0]


# ---- train.py: inputs checked before the model, one run per directory -----------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("entry")
    return root, make_training_data(root, per_lang=8, vocab_size=64)


def train(env: dict, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([sys.executable, str(REPO / "train.py")], env, cwd, timeout)


def test_a_wrong_train_manifest_is_reported_before_a_model_is_built_or_downloaded(tiny, tmp_path):
    root, data = tiny
    env = tiny_train_env(
        data, DATA_DIR=str(tmp_path), TRAIN_MANIFEST_PATH=str(tmp_path / "nope.parquet")
    )
    env["INIT_MODEL"] = "nvidia/parakeet-tdt-0.6b-v2"
    proc = train(env, tmp_path)
    assert proc.returncode == 2
    assert "error: TRAIN_MANIFEST_PATH=" in proc.stderr and "nope.parquet" in proc.stderr
    assert "downloading" not in proc.stderr and "building a fresh model" not in proc.stderr


def test_an_init_model_that_cannot_be_fetched_names_itself_and_the_nemo_way(tiny, tmp_path):
    root, data = tiny
    env = tiny_train_env(data, DATA_DIR=str(tmp_path), EVAL_EVERY_STEPS="0")
    env.update(
        INIT_MODEL="nvidia/parakeet-tdt-0.6b-v2",
        HF_ENDPOINT=f"http://127.0.0.1:{free_port()}",  # a node without internet: refused
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
    )
    proc = train(env, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and "INIT_MODEL=nvidia/parakeet-tdt-0.6b-v2 cannot be fetched" in errors[0]
    )
    assert "INIT_MODEL=/path/to/model.nemo" in errors[0]
    assert "Traceback" not in proc.stderr


def test_a_fresh_run_refuses_a_checkpoint_dir_holding_another_run(tiny, tmp_path):
    root, data = tiny
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    other = {"global_step": 364}
    for step in (3, 364):
        torch.save(other, ckpt / f"step_{step:08d}.ckpt")
    (ckpt / "run.json").write_text('{"name": "run-of-yesterday", "wandb_id": "abc"}')
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    proc = train(tiny_train_env(data, DATA_DIR=str(tmp_path)), tmp_path)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "holds run 'run-of-yesterday'" in errors[0] and "step_00000364.ckpt" in errors[0]
    assert "RESUME_FROM=last" in errors[0] and "its own CHECKPOINT_DIR" in errors[0]
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before  # nothing touched


def test_a_checkpoint_of_another_directory_is_not_resumed_into_a_third_runs_directory(
    tiny, tmp_path
):
    root, data = tiny
    (tmp_path / "a").mkdir()
    torch.save({"global_step": 2}, tmp_path / "a" / "step_00000002.ckpt")
    (tmp_path / "checkpoints").mkdir()
    torch.save({"global_step": 9}, tmp_path / "checkpoints" / "step_00000009.ckpt")
    env = tiny_train_env(
        data, DATA_DIR=str(tmp_path), RESUME_FROM=str(tmp_path / "a" / "step_00000002.ckpt")
    )
    proc = train(env, tmp_path)
    assert proc.returncode == 2 and "would overwrite and mix with its checkpoints" in proc.stderr


def test_resuming_a_checkpoint_past_max_steps_is_an_error_and_at_max_steps_says_done(
    tiny, tmp_path
):
    root, data = tiny
    (tmp_path / "checkpoints").mkdir()
    torch.save({"global_step": 6}, tmp_path / "checkpoints" / "step_00000006.ckpt")
    env = tiny_train_env(data, DATA_DIR=str(tmp_path), RESUME_FROM="last", MAX_STEPS="4")
    proc = train(env, tmp_path)
    assert proc.returncode == 2
    assert "at optimizer step 6, past MAX_STEPS=4: nothing would be trained" in proc.stderr
    proc = train({**env, "MAX_STEPS": "6"}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to train" in proc.stderr and "the run is complete" in proc.stderr
    assert "building a fresh model" not in proc.stderr


def test_resume_from_best_is_refused_with_the_way_to_branch(tiny, tmp_path):
    root, data = tiny
    proc = train(tiny_train_env(data, DATA_DIR=str(tmp_path), RESUME_FROM="best"), tmp_path)
    assert proc.returncode == 2 and "RESUME_FROM=best" in proc.stderr
    assert "RESUME_FROM=last" in proc.stderr


# ---- W&B that cannot be reached -----------------------------------------------------------------


@pytest.mark.slow
def test_an_online_run_without_a_reachable_wandb_server_trains_on_offline(tiny, tmp_path):
    root, data = tiny
    env = tiny_train_env(
        data, DATA_DIR=str(tmp_path), MAX_STEPS="2", EVAL_EVERY_STEPS="0", WANDB_RUN_NAME="r"
    )
    del env["WANDB_MODE"]  # resolves to online: a key is set
    env.update(WANDB_API_KEY="k" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    proc = train(env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot reach the W&B server" in proc.stderr and "wandb sync" in proc.stderr
    assert list((tmp_path / "wandb_logs" / "r" / "wandb").glob("offline-run-*"))
    assert (tmp_path / "checkpoints" / "step_00000002.nemo").exists()
    assert time.monotonic() - started < 180


def test_a_wandb_server_that_accepts_and_never_answers_counts_as_unreachable_within_the_wait():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    started = time.monotonic()
    problem = run_logging.wandb_reachable(f"http://127.0.0.1:{server.getsockname()[1]}", 1.0)
    assert problem is not None and "timed out" in problem
    assert time.monotonic() - started < 5
    server.close()


def test_a_wandb_server_that_answers_any_status_is_reachable(tmp_path):
    import http.server

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.handle_request, daemon=True).start()
    assert run_logging.wandb_reachable(f"http://127.0.0.1:{server.server_port}", 5.0) is None
    server.server_close()


def test_train_py_asks_for_expandable_cuda_segments_unless_set():
    code = "import os, train; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert out.stdout.strip() == "expandable_segments:True", out.stderr[-2000:]
    env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:512"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert out.stdout.strip() == "max_split_size_mb:512"


def test_plain_python_train_py_with_several_gpus_visible_warns_to_use_torchrun(monkeypatch):
    import train

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(config, "ACCELERATOR", "auto")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    one_process = {"world_size": 1}
    assert train.single_process_hint(one_process).startswith(
        "8 GPUs are visible but train.py runs as one process on one of them: start it with "
        "torchrun --nproc_per_node 8 train.py"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert train.single_process_hint(one_process) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert train.single_process_hint(one_process) is None


def test_smoke_test_interrupted_leaves_no_process_behind(tmp_path):
    import signal

    from tests.torchrun_jobs import job_processes

    data = make_training_data(tmp_path, per_lang=8, vocab_size=64)
    env = tiny_train_env(data, DATA_DIR=str(tmp_path / "data"), SMOKE_DIR=str(tmp_path / "smoke"))
    env.pop("NUM_WORKERS")
    script = subprocess.Popen(
        ["bash", "scripts/smoke_test.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )

    def train_py_running() -> bool:
        # The script's own subshells (realpath, mktemp) share its environment before its trap is
        # set, so only a process running train.py shows the script is past that point.
        for pid in job_processes(env):
            try:
                if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    deadline = time.monotonic() + 120
    while not train_py_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert train_py_running(), "train.py did not start"
    script.send_signal(signal.SIGTERM)
    out, _ = script.communicate(timeout=120)
    deadline = time.monotonic() + 30
    while job_processes(env) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(env) == [], out
    assert script.returncode == 143 and "interrupted: stopped train.py" in out, out
