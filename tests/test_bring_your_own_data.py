"""Bring your own data, the whole path: a NeMo JSON manifest (plain and tarred), a Hugging Face
audio parquet folder and a Kaldi data directory each go from files on disk to a trained checkpoint
with the documented commands only: build_manifest.py --source, make_train_val.py,
train_tokenizer.py, then a 2-process torchrun of train.py with a DataLoader worker per rank and
validation on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from tests import byod_factory as byod
from tests.torchrun_jobs import run_torchrun, tiny_train_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def write_source(kind: str, root: Path) -> str:
    utts = byod.utterances(12)
    if kind == "nemo":
        return f"nemo:{byod.write_nemo_json(root / 'nemo', utts)}"
    if kind == "nemo_tarred":
        manifest, tars = byod.write_nemo_tarred(root / "tarred", utts)
        return f"nemo:{manifest}:tars={tars}"
    if kind == "hf":
        return f"hf:{byod.write_hf_parquet(root / 'hf', utts)}"
    return f"kaldi:{byod.write_kaldi(root / 'kaldi', utts)}"


def step(args: list[str], env: dict, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{args[0]} failed:\n{result.stdout[-2000:]}\n{result.stderr}"
    return result.stdout


@pytest.mark.parametrize("kind", ["nemo", "nemo_tarred", "hf", "kaldi"])
def test_a_source_goes_from_files_on_disk_to_a_trained_checkpoint(tmp_path, kind):
    source = write_source(kind, tmp_path / "incoming")
    data = tmp_path / "data"
    env = tiny_train_env(
        {"manifest": data / "train_manifest_v2.parquet", "tokenizer": data / "tokenizer"},
        DATA_DIR=str(data),
        DATA_SOURCES=source,
        MIN_DURATION="0.5",
        MAX_STEPS="3",
        GRAD_ACCUM="1",
        UNFREEZE_STEP="2",
        EVAL_EVERY_STEPS="3",
    )
    env.pop("VAL_MANIFEST_PATH", None)
    out = step(["build_manifest.py", "--no-progress"], env, REPO)
    assert "rows: 24 read, 24 kept, 0 dropped" in out
    step(["scripts/make_train_val.py", "--val-per-lang", "3"], env, REPO)
    val = pl.read_parquet(data / "val_manifest_v2.parquet")
    assert sorted(set(val.get_column("lang"))) == ["en", "hi"]
    step(["scripts/train_tokenizer.py", "--vocab-size", "64"], env, REPO)
    result = run_torchrun(REPO / "train.py", env, REPO, TIMEOUT_S, tmp_path / "train.log")
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("done: 3 optimizer steps, 0 skipped") == 2  # both ranks
    assert re.search(r"step 3: validation on \d+ utterances", result.stdout)
    assert "greedy WER en" in result.stdout
    assert (data / "checkpoints" / "step_00000003.nemo").is_file()
