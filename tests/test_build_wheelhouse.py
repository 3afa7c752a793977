"""scripts/build_wheelhouse.py: the wheels a GPU node without internet needs, for a stated target.

The planning rules are checked on their own; two slow tests build real sets from the package index:
the one for the GPU image whose `pip freeze` is tests/gpu_image_freeze.txt (Python 3.12, torch
2.11 with CUDA 13, lightning 2.6.6, sentencepiece 0.2.2, numpy 2.5.2; training only), and one for a
local target that is then installed with ``--no-index`` into an environment holding only the
target's packages, where the tiny training runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from scripts import build_wheelhouse as bw
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import tiny_train_env

REPO = Path(__file__).resolve().parents[1]
IMAGE_FREEZE = REPO / "tests" / "gpu_image_freeze.txt"
IMAGE_PLATFORMS = ["manylinux_2_28_x86_64"]  # its glibc: the older levels are added


def _reqs(*lines: str) -> list[Requirement]:
    return [Requirement(line) for line in lines]


def _left_out(plan: bw.Plan) -> dict[str, str]:
    return {name: why for name, why in plan.left_out}


def test_a_pin_the_target_has_in_an_accepted_version_is_kept_and_resolved_as_the_range():
    plan = bw.plan_requirements(
        _reqs("torch==2.13.0", "numpy==2.4.6", "sentencepiece==0.2.3"),
        {"torch": "2.11.0", "numpy": "2.5.2", "sentencepiece": "0.2.2"},
        training_only=False,
    )
    out = _left_out(plan)
    assert set(out) == {"torch", "numpy", "sentencepiece"}
    assert "the target has 2.11.0, accepted (>=2.11" in out["torch"]
    # pip resolves the range, so the installed version satisfies whatever depends on it.
    assert plan.requirements == ["torch>=2.11", "numpy>=2.0,<3", "sentencepiece>=0.2.0"]


def test_a_pin_the_target_has_in_a_version_the_project_does_not_accept_is_shipped_as_pinned():
    plan = bw.plan_requirements(
        _reqs("lightning==2.4.0", "torch==2.13.0", "nemo_toolkit[asr]==3.0.0"),
        {"lightning": "2.6.6", "torch": "2.10.0"},
        training_only=False,
    )
    assert _left_out(plan) == {}
    assert plan.requirements == ["lightning==2.4.0", "torch==2.13.0", "nemo_toolkit[asr]==3.0.0"]


def test_test_tools_always_and_offline_only_packages_with_training_only_stay_out():
    reqs = _reqs(
        "pytest==9.2.0", "ruff==0.17.6", "polars==2.1.0", "matplotlib==3.11.2", "tqdm==4.70.1"
    )
    full = bw.plan_requirements(reqs, {}, training_only=False)
    assert set(_left_out(full)) == {"pytest", "ruff"}
    assert full.requirements == ["polars==2.1.0", "matplotlib==3.11.2", "tqdm==4.70.1"]
    training = bw.plan_requirements(reqs, {}, training_only=True)
    assert "offline steps only" in _left_out(training)["polars"]
    assert training.requirements == ["tqdm==4.70.1"]


def test_the_project_requirement_files_parse_and_plan(tmp_path):
    reqs = bw.read_requirements([REPO / f for f in bw.REQUIREMENT_FILES])
    names = {r.name for r in reqs}
    assert {"nemo_toolkit", "lightning", "numba-cuda", "torch"} <= names
    plan = bw.plan_requirements(reqs, bw.read_freeze(IMAGE_FREEZE), training_only=True)
    assert "lightning==2.4.0" in plan.requirements  # the image's 2.6.6 breaks `import nemo`


def test_a_manylinux_platform_brings_every_older_glibc_level_pip_would_otherwise_skip():
    tags = bw.expand_platforms(["manylinux_2_28_x86_64"])
    assert tags[:2] == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64"]
    for tag in (
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    ):
        assert tag in tags
    assert bw.expand_platforms(["linux_x86_64", "manylinux_2_17_aarch64"])[:3] == [
        "linux_x86_64",
        "manylinux_2_17_aarch64",
        "manylinux2014_aarch64",
    ]


def test_a_freeze_line_that_is_no_pin_names_its_file_and_line(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# comment\ntorch==2.11.0\nnumpy>=2\n", encoding="utf-8")
    with pytest.raises(
        bw.WheelhouseError, match=r"freeze.txt:3: 'numpy>=2' is not a `pip freeze` line"
    ):
        bw.read_freeze(freeze)


def test_a_freeze_of_direct_references_and_editables_reads_the_wheel_versions(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text(
        "-e git+https://example.invalid/x.git#egg=x\n"
        "flash_attn @ file:///wheels/flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl\n"
        "mylib @ file:///src/mylib\n"
        "Torch==2.11.0+cu130\n",
        encoding="utf-8",
    )
    assert bw.read_freeze(freeze) == {"flash-attn": "2.8.3", "torch": "2.11.0+cu130"}


def test_a_freeze_saved_with_a_byte_order_mark_and_crlf_reads_its_first_package(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_bytes(b"\xef\xbb\xbftorch==2.11.0\r\nnumpy==2.5.2\r\n")
    assert bw.read_freeze(freeze) == {"torch": "2.11.0", "numpy": "2.5.2"}


def test_pips_two_ways_of_saying_no_wheel_name_the_requirement():
    assert (
        bw.unsatisfiable_requirement(
            "ERROR: Could not find a version that satisfies the requirement foo==1.2 (from versions: none)"
        )
        == "foo==1.2"
    )
    said = (
        "The conflict is caused by:\n    hydra-core 1.3.2 depends on antlr4-python3-runtime==4.9.*\n\n"
        "Additionally, some packages in these conflicts have no matching distributions available "
        "for your environment:\n    antlr4-python3-runtime\n"
    )
    assert bw.unsatisfiable_requirement(said) == "antlr4-python3-runtime==4.9.*"
    assert bw.unsatisfiable_requirement("ERROR: ResolutionImpossible") is None


# --------------------------------------------------------------------------------------------------
# Real sets, from the package index
# --------------------------------------------------------------------------------------------------


def test_a_relative_out_folder_is_the_callers_and_a_rebuild_drops_wheels_the_set_lost(
    tmp_path, monkeypatch
):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("tqdm==4.70.1\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "old-1.0-py3-none-any.whl").write_bytes(b"")
    bw.build_wheelhouse(Path("wh"), requirement_files=[requirements])
    names = sorted(p.name for p in (tmp_path / "wh").iterdir())
    assert "old-1.0-py3-none-any.whl" not in names
    assert "tqdm-4.70.1-py3-none-any.whl" in names
    assert any(n.startswith("setuptools-") for n in names)  # for `pip install -e .`'s build
    assert (tmp_path / "wh" / "requirements.txt").read_text() == "tqdm==4.70.1\n"


@pytest.mark.slow
def test_the_gpu_images_training_set_is_under_40_mib_and_holds_what_the_image_lacks(tmp_path):
    out = tmp_path / "wheelhouse"
    summary = bw.build_wheelhouse(
        out,
        python_version="3.12",
        platforms=IMAGE_PLATFORMS,
        target_freeze=IMAGE_FREEZE,
        training_only=True,
    )
    assert summary["total_bytes"] < 40 * 2**20, summary["total_bytes"] / 2**20
    pins = dict(line.split("==") for line in (out / "requirements.txt").read_text().split() if line)
    assert pins["lightning"] == "2.4.0" and pins["nemo-toolkit"] == "3.0.0"
    assert pins["antlr4-python3-runtime"] == "4.9.3"  # an sdist, built here into a pure wheel
    for kept in ("torch", "numpy", "numba", "numba-cuda", "sentencepiece", "polars", "setuptools"):
        assert kept not in pins, kept
    wheels = os.listdir(out)
    assert any(w.startswith("antlr4_python3_runtime-4.9.3-py3-none-any") for w in wheels)
    # The build backend for `pip install -e .` is in the folder, not in the install line.
    assert any(w.startswith("setuptools-") for w in wheels)
    assert all(w.endswith((".whl", ".txt", ".json")) for w in wheels)
    assert json.loads((out / "wheelhouse.json").read_text())["training_only"] is True


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _pip(venv: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(_venv_python(venv)), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_a_set_installed_with_no_index_beside_the_targets_packages_trains(tmp_path):
    # The target: torch and numpy as a GPU image has them, an older sentencepiece the project
    # accepts, nothing else (no NeMo, no Lightning, no W&B).
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    done = _pip(target, "install", "-q", "torch==2.13.0", "numpy==2.4.6", "sentencepiece==0.2.2")
    assert done.returncode == 0, done.stderr[-3000:]
    freeze = tmp_path / "target_freeze.txt"
    freeze.write_text(_pip(target, "freeze").stdout, encoding="utf-8")

    out = tmp_path / "wheelhouse"
    summary = bw.build_wheelhouse(out, target_freeze=freeze, training_only=True)
    left_out = {item["name"]: item["why"] for item in summary["left_out"]}
    assert "accepted" in left_out["sentencepiece"] and "offline steps only" in left_out["polars"]

    done = _pip(
        target,
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(out),
        "-r",
        str(out / "requirements.txt"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    done = _pip(
        target,
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(out),
        "--no-deps",
        "-e",
        str(REPO),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    versions = subprocess.run(
        [
            str(_venv_python(target)),
            "-c",
            "import importlib.util, sentencepiece, torch; print(sentencepiece.__version__, torch.__version__, "
            "importlib.util.find_spec('polars') is None)",
        ],  # fmt: skip
        capture_output=True,
        text=True,
    )
    assert versions.stdout.split() == ["0.2.2", "2.13.0+cpu", "True"], versions.stderr[-2000:]

    data = make_training_data(tmp_path / "data", per_lang=8, vocab_size=64)
    env = tiny_train_env(
        data,
        DATA_DIR=str(tmp_path / "run"),
        MAX_STEPS="3",
        UNFREEZE_STEP="1",
        EVAL_EVERY_STEPS="0",
        WANDB_MODE="offline",
    )
    env.pop("PYTHONPATH", None)  # the project comes from the target's own install
    run = subprocess.run(
        [str(_venv_python(target)), str(REPO / "train.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    # sentencepiece 0.2.2 lacks a field the fingerprint clears: one warning, and training goes on.
    assert run.stderr.count("has no TrainerSpec.seed_sentencepieces_file") == 1
    metrics = next((tmp_path / "run").rglob("metrics.jsonl"))
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines() if "train/loss" in l]
    assert steps == [1, 2, 3]
