"""What RESUME_FROM means for a CHECKPOINT_DIR (``checkpoints.plan_resume``) and what a rewind moves
(``apply_resume_plan``), on small stand-in checkpoints: a checkpoint's step comes from the checkpoint,
every file of an abandoned step leaves with it, and a requeue is told from a new rewind by what the
job that began the timeline recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import checkpoints
import config


def stand_in(path, step: int):
    """A file torch can load, holding only the step, as a step checkpoint does."""
    torch.save({"global_step": step}, path)
    return path


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """CHECKPOINT_DIR with step checkpoints 1, 2, 3, as global rank 0 sees it."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for step in (1, 2, 3):
        stand_in(directory / checkpoints.checkpoint_name(step), step)
    return directory


def write_record(directory, **record):
    (directory / checkpoints.RUN_RECORD).write_text(json.dumps(record))


def test_a_checkpoint_named_otherwise_is_resumed_at_the_step_it_holds(run_dir):
    kept = stand_in(run_dir / "good.ckpt", 1)
    plan = checkpoints.plan_resume(str(kept), run_dir)
    assert plan.kind == "rewind" and plan.path == str(kept)
    assert [p.name for p in plan.set_aside] == ["step_00000002.ckpt", "step_00000003.ckpt"]
    assert plan.aside_name == "after_step_00000001"
    (run_dir / "latest.ckpt").symlink_to(run_dir / "step_00000003.ckpt")
    plan = checkpoints.plan_resume(str(run_dir / "latest.ckpt"), run_dir)
    assert plan.kind == "continue" and plan.set_aside == ()


def test_a_resume_from_an_unreadable_file_names_it(run_dir):
    broken = run_dir / "good.ckpt"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoints.CheckpointError, match="RESUME_FROM=.*good.ckpt: truncated"):
        checkpoints.plan_resume(str(broken), run_dir)


def test_a_rewind_moves_every_file_of_an_abandoned_step_and_keeps_those_of_the_others(run_dir):
    step3 = [
        "step_00000003.nemo",
        "step_00000003.model-card.md",
        "step_00000003.val.wer.csv",
        "step_00000003.avg2.nemo",
        "step_00000003.avg2.model-card.md",
    ]
    step1 = ["step_00000001.nemo", "step_00000001.model-card.md"]
    for name in step3 + step1 + ["notes.md"]:
        (run_dir / name).write_text(name)
    write_record(run_dir, name="ft", wandb_id="a1")
    plan = checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir)
    aside = checkpoints.apply_resume_plan(plan, run_dir)
    assert sorted(p.name for p in aside.iterdir()) == sorted(
        ["step_00000002.ckpt", "step_00000003.ckpt", checkpoints.RUN_RECORD, *step3]
    )
    left = sorted(p.name for p in run_dir.iterdir() if p.is_file())
    assert left == sorted(["step_00000001.ckpt", checkpoints.RUN_RECORD, "notes.md", *step1])


def test_two_rewinds_within_one_second_get_a_folder_each(run_dir, monkeypatch):
    write_record(run_dir, name="ft", wandb_id="a1")
    first = checkpoints.apply_resume_plan(
        checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir), run_dir
    )
    for step in (2, 3):
        stand_in(run_dir / checkpoints.checkpoint_name(step), step)
    monkeypatch.setattr(config, "KNOBS", config.read_config({"PHASE1_LR": "1e-5"}))
    second = checkpoints.apply_resume_plan(
        checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir), run_dir
    )
    assert first != second
    for folder in (first, second):
        assert sorted(p.name for p in folder.glob("*.ckpt")) == [
            "step_00000002.ckpt",
            "step_00000003.ckpt",
        ]


def rewound_to_step_1(run_dir):
    """run_dir after a rewind to step 1 that trained on to step 3 again: run.json as that rewind
    wrote it."""
    write_record(run_dir, name="ft", wandb_id="a1")
    checkpoints.apply_resume_plan(
        checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir), run_dir
    )
    for step in (2, 3):
        stand_in(run_dir / checkpoints.checkpoint_name(step), step)
    return checkpoints.read_run_record(run_dir)


def test_naming_the_timelines_start_again_with_the_same_settings_is_its_requeue(run_dir):
    record = rewound_to_step_1(run_dir)
    assert record["name"] == "ft-from-step_00000001" and record["started_inside"]
    plan = checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir)
    assert plan.kind == "continue" and plan.path == str(run_dir / "step_00000003.ckpt")


def test_naming_the_timelines_start_with_another_learning_rate_is_a_new_rewind(
    run_dir, monkeypatch
):
    rewound_to_step_1(run_dir)
    monkeypatch.setattr(config, "KNOBS", config.read_config({"PHASE1_LR": "1e-5"}))
    plan = checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir)
    assert plan.kind == "rewind" and plan.path == str(run_dir / "step_00000001.ckpt")
    assert [p.name for p in plan.set_aside] == ["step_00000002.ckpt", "step_00000003.ckpt"]
    checkpoints.apply_resume_plan(plan, run_dir)
    record = checkpoints.read_run_record(run_dir)
    # a run of its own, not a second W&B run under the first rewind's name
    assert record["name"].startswith("ft-from-step_00000001-") and record["wandb_id"] != "a1"
    assert record["started_by"]["settings"]["PHASE1_LR"] == 1e-5


def test_the_requeue_of_a_slurm_job_continues_whatever_its_settings_say(run_dir, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    rewound_to_step_1(run_dir)
    monkeypatch.setattr(config, "KNOBS", config.read_config({"PHASE1_LR": "1e-5"}))
    plan = checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir)
    assert plan.kind == "continue" and plan.path == str(run_dir / "step_00000003.ckpt")
    monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job, other settings: a new rewind
    assert checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir).kind == "rewind"


def test_settings_a_requeue_may_change_do_not_make_it_a_rewind(run_dir, monkeypatch):
    rewound_to_step_1(run_dir)
    knobs = {"MAX_STEPS": "9", "NUM_WORKERS": "7", "KEEP_CHECKPOINTS": "2", "WATCHDOG_SECONDS": "5"}
    monkeypatch.setattr(config, "KNOBS", config.read_config(knobs))
    assert checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir).kind == "continue"


def test_a_moved_run_directory_still_knows_where_its_timeline_began(run_dir, tmp_path):
    rewound_to_step_1(run_dir)
    moved = tmp_path / "other_disk" / "ckpt"
    moved.parent.mkdir()
    os.rename(run_dir, moved)
    plan = checkpoints.plan_resume(str(moved / "step_00000001.ckpt"), moved)
    assert plan.kind == "continue" and plan.path == str(moved / "step_00000003.ckpt")


def test_a_record_from_before_jobs_were_recorded_is_requeued_by_the_path(run_dir):
    write_record(
        run_dir,
        name="ft-from-step_00000001",
        wandb_id="b2",
        started_from=str(run_dir / "step_00000001.ckpt"),
    )
    plan = checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), run_dir)
    assert plan.kind == "continue" and plan.path == str(run_dir / "step_00000003.ckpt")


def test_a_symlinked_checkpoint_dir_is_one_directory_whichever_path_names_it(run_dir, tmp_path):
    link = tmp_path / "ckpt_link"
    link.symlink_to(run_dir)
    write_record(link, name="ft", wandb_id="a1")
    checkpoints.apply_resume_plan(
        checkpoints.plan_resume(str(link / "step_00000001.ckpt"), link), link
    )
    for step in (2, 3):
        stand_in(run_dir / checkpoints.checkpoint_name(step), step)
    # the requeue names the real path, the job that began the timeline named the link
    plan = checkpoints.plan_resume(str(run_dir / "step_00000001.ckpt"), link)
    assert plan.kind == "continue" and Path(plan.path).resolve() == run_dir / "step_00000003.ckpt"
    plan = checkpoints.plan_resume(str(link / "step_00000002.ckpt"), run_dir)
    assert plan.kind == "rewind" and [p.name for p in plan.set_aside] == ["step_00000003.ckpt"]
