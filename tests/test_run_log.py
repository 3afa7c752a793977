"""What a user reads in the log of a real run: train.py under `torchrun --nproc_per_node 2` on CPU
with its output going to a file, as under SLURM or `> train.log` (not a terminal), then resumed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import tiny_train_env, torchrun_command

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def run_to_file(env: dict, log_path: Path) -> str:
    """train.py under torchrun with stdout and stderr going to ``log_path``; the log's text."""
    with open(log_path, "w") as out:
        code = subprocess.call(
            torchrun_command(REPO / "train.py"),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT_S,
        )
    text = log_path.read_text()
    assert code == 0, text[-4000:]
    return text


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runlog")
    data = make_training_data(root, per_lang=16, vocab_size=64)
    # A warmup far longer than the run, and the default UNFREEZE_STEP (40000) past MAX_STEPS.
    env = tiny_train_env(
        data,
        DATA_DIR=str(root / "data"),
        MAX_STEPS="3",
        GRAD_ACCUM="1",
        WARMUP_STEPS="5000",
        CHECKPOINT_EVERY="3",
        EVAL_EVERY_STEPS="0",
    )
    env.pop("UNFREEZE_STEP", None)
    first = run_to_file(env, root / "first.log")
    resumed = run_to_file(dict(env, RESUME_FROM="last", MAX_STEPS="5"), root / "resumed.log")
    return first, resumed


def test_a_warmup_longer_than_the_run_is_one_warning_naming_both_knobs(logs):
    first, _ = logs
    assert re.search(
        r"WARNING train: WARMUP_STEPS=5000 is longer than phase 1 \(3 optimizer steps: "
        r"UNFREEZE_STEP=40000, MAX_STEPS=3\).*set WARMUP_STEPS=1 ",
        first,
    ), first[-3000:]


def test_an_encoder_that_never_unfreezes_is_said(logs):
    first, _ = logs
    assert "WARNING train: UNFREEZE_STEP=40000 >= MAX_STEPS=3: the encoder stays frozen" in first


def test_a_log_file_holds_no_progress_bar_redraws_or_terminal_codes(logs):
    for text in logs:  # the first job and the resumed one
        assert "\r" not in text and "\x1b" not in text, repr(text[-2000:])


def test_a_log_file_gets_a_plain_progress_line_at_the_last_step(logs):
    first, _ = logs
    assert re.search(
        r"INFO callbacks: step 3/3 \(100%\) \| micro-batch 3 .*steps/s, ETA 0:00:00", first
    )


def test_a_cpu_run_says_it_keeps_freed_host_memory_for_reuse(logs):
    first, _ = logs  # ACCELERATOR=cpu, HOST_MEMORY_REUSE at its default (auto)
    assert "INFO train: step speed: freed host memory kept for reuse (HOST_MEMORY_REUSE)" in first


def test_a_run_says_the_augmentation_in_force(logs):
    first, resumed = logs  # SPEED_PERTURB and NOISE_PROB at their defaults: off
    for text in (first, resumed):
        assert "INFO train: augmentation: no speed perturbation; no noise" in text
