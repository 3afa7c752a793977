"""One directory, one run, one timeline: tiny single-process train.py runs on CPU (a few optimizer
steps each) that resume into the wrong directory, rewind inside their own, branch into a new one
and are requeued, and start over where no checkpoint can be read."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoints
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import tiny_train_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def train(env: dict, **knobs: str) -> subprocess.CompletedProcess:
    """train.py in one process with ``env`` and ``knobs``; its output is in ``.stdout``."""
    return subprocess.run(
        [sys.executable, str(REPO / "train.py")],
        cwd=REPO,
        env={**env, **knobs},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )


def steps(directory: Path) -> list[int]:
    return [checkpoints.checkpoint_number(p) for p in checkpoints.step_checkpoints(directory)]


def run_name(path: Path) -> str:
    return torch.load(path, weights_only=False, mmap=True)["run_record"]["run"]["name"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A run from scratch in DATA_DIR=<root>/scratch: optimizer steps 1, 2, 3, each saved."""
    root = tmp_path_factory.mktemp("timeline")
    data = make_training_data(root, per_lang=8, vocab_size=64)
    env = tiny_train_env(
        data,
        NUM_WORKERS="0",
        AUDIO_CHECK_SAMPLES="0",
        EVAL_EVERY_STEPS="0",
        CHECKPOINT_EVERY="1",
        MAX_STEPS="3",
        DATA_DIR=str(root / "scratch"),
    )
    done = train(env)
    assert done.returncode == 0, done.stdout[-3000:]
    return root, data, env


def fresh_copy(first_run, name: str) -> tuple[Path, dict]:
    """The first run's data directory copied to <root>/<name>, and the environment that points at it."""
    root, _, env = first_run
    shutil.copytree(root / "scratch", root / name)
    return root / name / "checkpoints", {**env, "DATA_DIR": str(root / name)}


def test_a_resume_into_another_runs_directory_is_refused_naming_the_changes_and_directories(
    first_run,
):
    root, data, env = first_run
    directory = root / "scratch" / "checkpoints"
    record = (directory / "run.json").read_text()
    own_tokenizer = root / "ft_tokenizer"
    shutil.copytree(data["tokenizer"], own_tokenizer, dirs_exist_ok=True)
    done = train(
        env,
        TOKENIZER_DIR=str(own_tokenizer),
        WANDB_RUN_NAME="ft",
        RESUME_FROM="last",
        MAX_STEPS="4",
    )
    assert done.returncode == 2, done.stdout[-3000:]
    error = next(line for line in done.stdout.splitlines() if line.startswith("error:"))
    assert f"TOKENIZER_DIR '{data['tokenizer']}' -> '{own_tokenizer}'" in error
    assert "WANDB_RUN_NAME '' -> 'ft'" in error and "INIT_MODEL" not in error
    assert str(directory) in error and "RESUME_CHANGES=TOKENIZER_DIR,WANDB_RUN_NAME" in error
    assert (directory / "run.json").read_text() == record  # the other run is left as it was
    assert steps(directory) == [1, 2, 3]
    assert not (root / "scratch" / "wandb_logs" / "ft").exists()


def test_a_change_named_in_resume_changes_continues_the_run(first_run):
    directory, env = fresh_copy(first_run, "second_stage")
    root, data, _ = first_run
    manifest = root / "second_stage_manifest.parquet"
    shutil.copy(data["manifest"], manifest)
    knobs = dict(TRAIN_MANIFEST_PATH=str(manifest), RESUME_FROM="last", MAX_STEPS="4")
    assert train(env, **knobs).returncode == 2
    done = train(env, **knobs, RESUME_CHANGES="TRAIN_MANIFEST_PATH")
    assert done.returncode == 0, done.stdout[-3000:]
    assert steps(directory) == [1, 2, 3, 4]


def test_a_rewind_moves_the_abandoned_steps_aside_so_last_and_pruning_follow_the_new_timeline(
    first_run,
):
    directory, env = fresh_copy(first_run, "rewind")
    old_name = json.loads((directory / "run.json").read_text())["name"]
    rewind = dict(RESUME_FROM=str(directory / "step_00000001.ckpt"), KEEP_BEST_CHECKPOINTS="0")
    done = train(env, **rewind, MAX_STEPS="2", KEEP_CHECKPOINTS="1")
    assert done.returncode == 0, done.stdout[-3000:]
    assert steps(directory) == [2]  # pruning kept the new timeline's newest, not the old step 3
    (aside,) = directory.glob("after_step_00000001_*")
    assert steps(aside) == [2, 3] and run_name(aside / "step_00000003.ckpt") == old_name
    last = Path(checkpoints.resolve_resume_from("last", directory))
    assert last == directory / "step_00000002.ckpt"
    new_name = run_name(last)
    assert new_name == f"{old_name}-from-step_00000001"
    metrics = directory.parent / "wandb_logs" / new_name / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [2]
    # its requeue, with the same environment, continues the new timeline
    done = train(env, **rewind, MAX_STEPS="3", KEEP_CHECKPOINTS="1")
    assert done.returncode == 0, done.stdout[-3000:]
    assert steps(directory) == [3] and run_name(directory / "step_00000003.ckpt") == new_name


def test_a_branch_into_an_empty_directory_is_requeued_from_its_own_newest_checkpoint(first_run):
    root, _, env = first_run
    source = root / "scratch" / "checkpoints" / "step_00000002.ckpt"
    branch = {**env, "CHECKPOINT_DIR": str(root / "branch"), "RESUME_FROM": str(source)}
    done = train(branch, MAX_STEPS="3")
    assert done.returncode == 0, done.stdout[-3000:]
    assert steps(root / "branch") == [3]
    name = run_name(root / "branch" / "step_00000003.ckpt")
    done = train(branch, MAX_STEPS="4")  # the requeue: the same environment
    assert done.returncode == 0, done.stdout[-3000:]
    assert steps(root / "branch") == [3, 4]
    assert run_name(root / "branch" / "step_00000004.ckpt") == name


def test_with_every_checkpoint_unreadable_resume_from_empty_starts_fresh_as_the_error_says(
    first_run,
):
    directory, env = fresh_copy(first_run, "unreadable")
    for path in checkpoints.step_checkpoints(directory):
        path.write_bytes(path.read_bytes()[:1000])
    done = train(env, RESUME_FROM="last")
    assert done.returncode == 2 and "set RESUME_FROM= to start fresh" in done.stdout
    done = train(env, RESUME_FROM="", MAX_STEPS="1")
    assert done.returncode == 0, done.stdout[-3000:]
    assert steps(directory) == [1]
    (aside,) = directory.glob("unreadable_*")
    assert steps(aside) == [1, 2, 3]


def test_a_new_run_reusing_a_run_name_logs_beside_the_other_runs_metrics_not_into_them(first_run):
    root, _, env = first_run
    logs = root / "shared_logs"
    knobs = dict(WANDB_LOG_DIR=str(logs), WANDB_RUN_NAME="ft", MAX_STEPS="2")
    first = train({**env, "DATA_DIR": str(root / "ft_one")}, **knobs)
    assert first.returncode == 0, first.stdout[-3000:]
    theirs = (logs / "ft" / "metrics.jsonl").read_text()
    second = train({**env, "DATA_DIR": str(root / "ft_two")}, **knobs)
    assert second.returncode == 0, second.stdout[-3000:]
    assert (logs / "ft" / "metrics.jsonl").read_text() == theirs  # not one line added
    record = json.loads((root / "ft_two" / "checkpoints" / "run.json").read_text())
    mine = Path(record["log_dir"])
    assert mine == logs / f"ft-{record['wandb_id']}" and (mine / "metrics.jsonl").is_file()
    assert f"{logs / 'ft'} holds another run's metrics" in second.stdout
    from scripts import run_report

    assert run_report.find_run_dir(root / "ft_two" / "checkpoints") == mine
    # the first run's requeue continues in its own directory
    again = train({**env, "DATA_DIR": str(root / "ft_one")}, RESUME_FROM="last", **knobs)
    assert again.returncode == 0 and "holds another run's metrics" not in again.stdout


def metric_steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_a_branch_keeping_its_sources_name_never_logs_into_the_sources_unclaimed_metrics(
    first_run,
):
    root, _, _ = first_run
    directory, env = fresh_copy(first_run, "unclaimed")
    name = json.loads((directory / "run.json").read_text())["name"]
    logs = root / "unclaimed" / "wandb_logs"
    theirs = logs / name / "metrics.jsonl"
    shutil.copy(root / "scratch" / "wandb_logs" / name / "metrics.jsonl", theirs)
    (logs / name / "wandb_id").unlink()  # a run from before runs claimed their directory
    before = theirs.read_text()
    branch = {
        **env,
        "CHECKPOINT_DIR": str(root / "unclaimed_branch"),
        "RESUME_FROM": str(directory / "step_00000002.ckpt"),
        "WANDB_RUN_NAME": name,
        "WANDB_LOG_DIR": str(logs),
    }
    done = train(branch, MAX_STEPS="4")
    assert done.returncode == 0, done.stdout[-3000:]
    assert theirs.read_text() == before
    record = json.loads((root / "unclaimed_branch" / "run.json").read_text())
    assert Path(record["log_dir"]) == logs / f"{name}-{record['wandb_id']}"
    assert metric_steps(Path(record["log_dir"]) / "metrics.jsonl") == [3, 4]
    # the source's own requeue still logs into its directory, and claims it
    done = train({**env, "WANDB_LOG_DIR": str(logs)}, RESUME_FROM="last", MAX_STEPS="4")
    assert done.returncode == 0, done.stdout[-3000:]
    assert metric_steps(theirs)[-1] == 4 and "another run's metrics" not in done.stdout


def test_a_second_rewind_to_a_timelines_start_with_a_new_learning_rate_rewinds_again(first_run):
    directory, env = fresh_copy(first_run, "rewind_twice")
    start = str(directory / "step_00000001.ckpt")
    first = train(env, RESUME_FROM=start, MAX_STEPS="3")
    assert first.returncode == 0, first.stdout[-3000:]
    first_name = run_name(directory / "step_00000003.ckpt")
    # what an export and an evaluation of the first rewind's step 3 leave beside it
    for name in ("step_00000003.nemo", "step_00000003.model-card.md", "step_00000003.val.wer.csv"):
        (directory / name).write_text(f"{first_name}'s step 3")
    second = train(env, RESUME_FROM=start, MAX_STEPS="3", PHASE1_LR="1e-5")
    assert second.returncode == 0, second.stdout[-3000:]
    assert "resuming from" not in second.stdout and "a new rewind to it" in second.stdout
    checkpoint = torch.load(directory / "step_00000003.ckpt", weights_only=False, mmap=True)
    assert checkpoint["run_record"]["settings"]["PHASE1_LR"] == 1e-5
    assert checkpoint["run_record"]["run"]["name"] != first_name
    asides = sorted(directory.glob("after_step_00000001_*"))
    assert len(asides) == 2 and all(steps(a) == [2, 3] for a in asides)
    assert run_name(asides[1] / "step_00000003.ckpt") == first_name
    card = asides[1] / "step_00000003.model-card.md"
    assert card.read_text() == f"{first_name}'s step 3"
    assert (asides[1] / "step_00000003.val.wer.csv").is_file()
    # the new timeline's own export of its step 3 took the name, not the old card's text
    assert (directory / "step_00000003.model-card.md").read_text() != f"{first_name}'s step 3"
