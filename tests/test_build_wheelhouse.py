"""scripts/build_wheelhouse.py: the wheels a GPU node without internet needs, for a stated target.

The planning rules are checked on their own, against pip's own definitions: PEP 440 versions as
packaging compares an installed one (pre-releases count, a local label is ignored against a
specifier without one), PEP 503 names, the lines `pip freeze` writes (a slow test has pip write
them). Builds against a local registry of metadata-only wheels shaped like the real ones (and a
local PEP 503 index of torch's CUDA 12 build) check what the install replaces, who asks for it, and
where a shipped torch comes from, without the network. Slow tests build or resolve real sets from
the package index: the GPU image whose `pip freeze` is tests/gpu_image_freeze.txt (Python 3.12,
torch 2.11 with CUDA 13, lightning 2.6.6, sentencepiece 0.2.2, numpy 2.5.2; training only), the
NVIDIA PyTorch container shaped by tests/nvidia_pytorch_container_freeze.txt (NVIDIA's pre-release
torch from a wheel file, CUDA 12), and a local target that is then installed with ``--no-index``
into an environment holding only the target's packages, where the tiny training runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import quote

import pytest
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from scripts import build_wheelhouse as bw
from tests.tiny_training_data import make_training_data
from tests.torchrun_jobs import tiny_train_env

REPO = Path(__file__).resolve().parents[1]
IMAGE_FREEZE = REPO / "tests" / "gpu_image_freeze.txt"
NVIDIA_FREEZE = REPO / "tests" / "nvidia_pytorch_container_freeze.txt"
IMAGE_PLATFORMS = ["manylinux_2_28_x86_64"]  # its glibc: the older levels are added
NVIDIA_TORCH = "2.12.0a0+6a5c3a1d2e.nv26.01"  # NVIDIA's own build: a pre-release, CUDA not named


def _reqs(*lines: str) -> list[Requirement]:
    return [Requirement(line) for line in lines]


def _freeze(tmp_path: Path, *lines: str) -> bw.Freeze:
    path = tmp_path / "freeze.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return bw.read_freeze(path)


def _node(**versions: str) -> bw.Freeze:
    return bw.Freeze(versions=versions, where={name: f"freeze.txt:{name}" for name in versions})


def pep503(name: str) -> str:
    """PEP 503's normalized name, as the PEP writes it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _left_out(plan: bw.Plan) -> dict[str, str]:
    return {name: why for name, why in plan.left_out}


def test_a_pin_the_target_has_in_an_accepted_version_is_kept_and_resolved_as_the_range():
    plan = bw.plan_requirements(
        _reqs("torch==2.13.0", "numpy==2.4.6", "sentencepiece==0.2.3"),
        _node(torch="2.10.0", numpy="2.5.2", sentencepiece="0.2.2"),
        training_only=False,
    )
    out = _left_out(plan)
    assert set(out) == {"torch", "numpy", "sentencepiece"}
    assert "the target has 2.10.0, accepted (>=2.10" in out["torch"]
    # pip resolves the range, so the installed version satisfies whatever depends on it.
    assert plan.requirements == ["torch>=2.10", "numpy>=2.0,<3", "sentencepiece>=0.2.0"]


def test_a_pin_the_target_has_in_a_version_the_project_does_not_accept_is_shipped_as_pinned():
    plan = bw.plan_requirements(
        _reqs("lightning==2.4.0", "nemo_toolkit[asr]==3.0.0"),
        _node(lightning="2.6.6"),
        training_only=False,
    )
    assert _left_out(plan) == {}
    assert plan.requirements == ["lightning==2.4.0", "nemo_toolkit[asr]==3.0.0"]


# An installed version meets a specifier as pip judges an installed package (PEP 440):
# a pre-release counts, and a local label is ignored against a specifier that has none.
@pytest.mark.parametrize(
    ("have", "kept"),
    [
        (NVIDIA_TORCH, True),  # a pre-release of 2.12 comes after 2.10
        ("2.10.0+cu126", True),  # the local label is ignored: 2.10.0 >= 2.10
        ("2.13.0+cu130", True),  # == 2.13.0, the pinned version, whatever the local label
        ("2.10.0rc1", False),  # a pre-release of 2.10 comes before 2.10
        ("2.10.0a0+ecf3bae40a.nv25.11", False),
        ("2.9.1+cu126", False),  # its torchrun has no --signals-to-handle for scripts/launch.py
        ("2.7.0a0+79aa17489c.nv25.4", False),  # NVIDIA's PyTorch container 25.04
    ],
)
def test_the_nodes_torch_stays_when_pip_would_count_it_in_the_accepted_range(have, kept):
    reqs = _reqs("torch==2.13.0", "nemo_toolkit[asr]==3.0.0")
    if not kept:
        with pytest.raises(bw.WheelhouseError, match=r"freeze.txt:torch: .*--replace-torch"):
            bw.plan_requirements(reqs, _node(torch=have), training_only=False)
        return
    plan = bw.plan_requirements(reqs, _node(torch=have), training_only=False)
    assert Version(plan.node_torch) == Version(have)
    assert "torch==2.13.0" not in plan.requirements or have.startswith("2.13.0")
    assert f"the target has {have}" in _left_out(plan)["torch"]


def test_the_nodes_torch_outside_the_range_is_replaced_only_when_asked():
    reqs = _reqs("torch==2.13.0", "tqdm==4.70.1")
    with pytest.raises(bw.WheelhouseError) as refused:
        bw.plan_requirements(reqs, _node(torch="2.9.1+cu126"), training_only=False)
    said = str(refused.value)
    assert "\n" not in said and "2.9.1+cu126" in said and ">=2.10" in said
    plan = bw.plan_requirements(
        reqs, _node(torch="2.9.1+cu126"), training_only=False, replace_torch=True
    )
    assert plan.requirements == ["torch==2.13.0", "tqdm==4.70.1"] and plan.node_torch is None
    # Asked, it replaces even an accepted torch with requirements.txt's.
    plan = bw.plan_requirements(reqs, _node(torch=NVIDIA_TORCH), False, cuda=13, replace_torch=True)
    assert plan.requirements[0] == "torch==2.13.0" and plan.node_torch is None


def test_a_torch_whose_freeze_line_has_no_version_is_refused_naming_the_line(tmp_path):
    freeze = _freeze(tmp_path, "numpy==2.5.2", "torch @ file:///opt/pytorch/pytorch")
    assert "torch" in freeze.unversioned and "torch" not in freeze.versions
    with pytest.raises(bw.WheelhouseError, match=r"freeze.txt:2: .*pip list --format=freeze"):
        bw.plan_requirements(_reqs("torch==2.13.0"), freeze, training_only=False)


def test_a_resolution_that_would_install_a_torch_over_the_nodes_is_refused_naming_who_asks():
    plan = bw.plan_requirements(_reqs("torch==2.13.0"), _node(torch=NVIDIA_TORCH), False)
    installs = [
        {"metadata": {"name": "torch", "version": "2.13.0"}},
        {"metadata": {"name": "torchmetrics", "version": "9.0", "requires_dist": ["torch>=2.13"]}},
        {"metadata": {"name": "tqdm", "version": "4.70.1", "requires_dist": ["colorama"]}},
    ]
    with pytest.raises(
        bw.WheelhouseError, match=r"torchmetrics asks for torch>=2.13.*replace-torch"
    ):
        bw.check_node_torch_kept(installs, plan)
    bw.check_node_torch_kept(installs[1:], plan)  # no torch in the set: nothing to refuse
    asked = bw.plan_requirements(
        _reqs("torch==2.13.0"), _node(torch=NVIDIA_TORCH), False, cuda=13, replace_torch=True
    )
    bw.check_node_torch_kept(installs, asked)


def test_test_tools_always_and_offline_only_packages_with_training_only_stay_out():
    reqs = _reqs(
        "pytest==9.2.0", "ruff==0.17.6", "polars==2.1.0", "matplotlib==3.11.2", "tqdm==4.70.1"
    )
    full = bw.plan_requirements(reqs, bw.Freeze(), training_only=False)
    assert set(_left_out(full)) == {"pytest", "ruff"}
    assert full.requirements == ["polars==2.1.0", "matplotlib==3.11.2", "tqdm==4.70.1"]
    training = bw.plan_requirements(reqs, bw.Freeze(), training_only=True)
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


def test_a_freeze_line_that_is_no_pin_is_a_warning_naming_its_file_and_line(tmp_path):
    freeze = _freeze(tmp_path, "# comment", "torch==2.11.0", "numpy>=2", "-----", "-f /wheels")
    said = "\n".join(freeze.warnings)
    assert "freeze.txt:3: 'numpy>=2': not a `pip freeze` line" in said
    assert "freeze.txt:4: '-----'" in said and "freeze.txt:5: '-f /wheels'" in said
    assert len(freeze.warnings) == 3
    # The package it names is installed in a version nobody can tell: not kept as if it fitted.
    assert freeze.versions == {"torch": "2.11.0"} and freeze.unversioned == {"numpy"}


def test_a_file_with_no_installed_package_in_it_is_refused(tmp_path):
    with pytest.raises(bw.WheelhouseError, match=r"freeze.txt: no line reads as an installed"):
        _freeze(tmp_path, "Package    Version", "---------- -------", "torch      2.11.0")


def test_a_freeze_of_direct_references_and_editables_reads_the_wheel_versions(tmp_path):
    freeze = _freeze(
        tmp_path,
        "-e git+https://example.invalid/x.git@0123abcd#egg=x_lib",
        "flash_attn @ file:///wheels/flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl",
        "mylib @ file:///src/mylib",
        "Torch==2.11.0+cu130",
    )
    assert freeze.versions == {"flash-attn": "2.8.3", "torch": "2.11.0+cu130"}
    assert freeze.unversioned == {"x-lib", "mylib"}
    assert [w.split(":")[1] for w in freeze.warnings] == ["1", "3"]


# Every form pip writes for an installed torch 2.12.0a0+6a5c3a1d2e.nv26.01 or 2.11.0+cu126:
# name==version (a pre-release and a local version), name===version, name @ a wheel's URL with
# the local version's "+" written %2B (file:// and https://, with a hash fragment), an editable
# install under pip's comment naming it, a name in another case.
@pytest.mark.parametrize(
    ("lines", "version"),
    [
        ([f"torch=={NVIDIA_TORCH}"], NVIDIA_TORCH),
        (["torch===2.11.0+cu126"], "2.11.0+cu126"),
        (
            [
                "torch @ file:///opt/transfer/torch-2.12.0a0%2B6a5c3a1d2e.nv26.01-cp312-cp312-linux_x86_64.whl"
            ],
            NVIDIA_TORCH,
        ),
        (
            [
                "torch @ https://download.example.invalid/whl/cu126/"
                "torch-2.11.0%2Bcu126-cp312-cp312-manylinux_2_28_x86_64.whl#sha256=00ff"
            ],
            "2.11.0+cu126",
        ),
        (["torch @ file:///sdists/torch-2.11.0%2Bcu126.tar.gz"], "2.11.0+cu126"),
        (
            [
                "# Editable install with no version control (torch==2.12.0a0+6a5c3a1d2e.nv26.1)",
                "-e /opt/pytorch/pytorch",
            ],
            NVIDIA_TORCH,
        ),
        (
            ["# Editable Git install with no remote (torch==2.11.0+cu126)", "-e /src/pytorch"],
            "2.11.0+cu126",
        ),
        (["TORCH==2.11.0+cu126"], "2.11.0+cu126"),
    ],
)
def test_every_form_pip_writes_for_an_installed_torch_reads_as_its_version(
    tmp_path, lines, version
):
    freeze = _freeze(tmp_path, "numpy==2.5.2", *lines)
    assert Version(freeze.versions["torch"]) == Version(version)
    assert freeze.warnings == []


def test_names_in_any_case_and_separator_are_one_package_as_pep_503_defines():
    spelled = [
        "Ruamel.Yaml",
        "ruamel_yaml.clib",
        "PyYAML",
        "typing_extensions",
        "Jinja2",
        "flash_attn",
    ]
    freeze = bw.read_freeze(NVIDIA_FREEZE)
    for name in ("ruamel.yaml", "ruamel.yaml.clib", "PyYAML", "typing_extensions", "Jinja2"):
        assert pep503(name) in freeze.versions, name
    # A requirement spelled one way finds the node's package spelled another.
    for name in spelled:
        node = _node(**{pep503(name): "1.0"})
        plan = bw.plan_requirements(_reqs(f"{name}==1.0"), node, training_only=False)
        assert _left_out(plan) == {name: "the target has 1.0, as pinned"}, name


def test_the_nvidia_containers_freeze_reads_its_torch_and_warns_of_each_line_without_a_version():
    text = NVIDIA_FREEZE.read_text(encoding="utf-8").splitlines()
    freeze = bw.read_freeze(NVIDIA_FREEZE)
    assert Version(freeze.versions["torch"]) == Version(NVIDIA_TORCH)
    assert Version(freeze.versions["torchvision"]) == Version("0.27.0a0+9c1e2f3")
    assert freeze.versions["lightning-thunder"] == "0.2.5.dev0"  # from pip's comment
    unreadable = {"apex", "nvfuser", "transformer_engine", "megatron_core"}
    assert freeze.unversioned == {pep503(n) for n in unreadable}
    numbers = {n: next(i for i, l in enumerate(text, 1) if n in l) for n in unreadable}
    warned = {int(w.split(":")[1]) for w in freeze.warnings}
    assert warned == set(numbers.values())


def test_a_freeze_saved_with_a_byte_order_mark_and_crlf_reads_its_first_package(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_bytes(b"\xef\xbb\xbftorch==2.11.0\r\nnumpy==2.5.2\r\n")
    assert bw.read_freeze(freeze).versions == {"torch": "2.11.0", "numpy": "2.5.2"}


# numba-cuda's extras as its published metadata (0.30.4) names them: cu12 brings CUDA 12's bindings
# and toolkit wheels, cu13 CUDA 13's. The one for the torch the node trains with, however its freeze
# says that torch's CUDA: the local version tag, the CUDA runtime wheel a registry build brings
# (nvidia-cuda-runtime-cu12 for CUDA 12, nvidia-cuda-runtime 13.x for CUDA 13), or --cuda.
@pytest.mark.parametrize(
    ("lines", "cuda", "replace", "extra"),
    [
        (["torch==2.11.0+cu126"], None, False, "cu12"),
        (["torch==2.11.0+cu130"], None, False, "cu13"),
        (["torch==2.11.0+cu126"], 12, False, "cu12"),
        (["torch==2.11.0", "nvidia-cuda-runtime-cu12==12.6.77"], None, False, "cu12"),
        (
            ["torch==2.11.0", "nvidia-cuda-runtime==13.0.96", "cuda-toolkit==13.0.2"],
            None,
            False,
            "cu13",
        ),
        ([f"torch=={NVIDIA_TORCH}"], 12, False, "cu12"),
        ([f"torch=={NVIDIA_TORCH}"], 13, False, "cu13"),
        ([f"torch=={NVIDIA_TORCH}"], 12, True, "cu12"),  # ships torch's CUDA 12 build
        ([f"torch=={NVIDIA_TORCH}"], 13, True, "cu13"),  # ships the registry's CUDA 13 torch
        (["torch==2.10.0+cu126"], None, True, "cu12"),  # ships a torch for the node's CUDA
        (["numpy==2.5.2"], None, False, "cu13"),  # no torch on the node: the registry's comes
        (["numpy==2.5.2"], 12, False, "cu12"),  # ... or torch's CUDA 12 build, given --cuda 12
        (["torch==2.13.0+cpu"], None, False, "cu13"),  # a CPU torch: the file's extra
    ],
)
def test_numba_cuda_takes_the_cuda_extra_of_the_torch_the_node_trains_with(
    tmp_path, lines, cuda, replace, extra
):
    reqs = _reqs("torch==2.13.0", "numba-cuda[cu13]==0.30.4")
    plan = bw.plan_requirements(
        reqs, _freeze(tmp_path, *lines), False, cuda=cuda, replace_torch=replace
    )
    assert f"numba-cuda[{extra}]==0.30.4" in plan.requirements
    assert plan.cuda.startswith(f"numba-cuda[{extra}]==0.30.4: ")


@pytest.mark.parametrize(
    ("lines", "cuda", "replace", "refusal"),
    [
        ([f"torch=={NVIDIA_TORCH}"], None, False, r"freeze.txt:1: .* give --cuda 12 or --cuda 13"),
        (["torch==2.11.0"], None, False, r"no CUDA tag .*\(none\).* give --cuda"),
        (
            ["torch==2.11.0", "nvidia-cuda-runtime-cu12==12.6.77", "nvidia-cuda-runtime==13.0.96"],
            None,
            False,
            r"give --cuda",
        ),
        (["torch==2.11.0+cu130"], 12, False, r"--cuda 12, but .* is a CUDA 13 build"),
        (["torch==2.11.0+cu118"], None, False, r"cu12 \(CUDA 12\), cu13 \(CUDA 13\) only"),
        (["torch==2.13.0+cpu"], 12, False, r"a CPU build"),
        ([f"torch=={NVIDIA_TORCH}"], None, True, r"freeze.txt:1: .*driver runs: give --cuda 12"),
        (["torch==2.13.0+cpu"], None, True, r"in place of the node's 2.13.0\+cpu, .*give --cuda"),
    ],
)
def test_a_cuda_the_freeze_cannot_tell_or_contradicts_is_refused_in_one_line(
    tmp_path, lines, cuda, replace, refusal
):
    freeze = _freeze(tmp_path, *lines)
    reqs = _reqs("torch==2.13.0", "numba-cuda[cu13]==0.30.4")
    with pytest.raises(bw.WheelhouseError, match=refusal) as refused:
        bw.plan_requirements(reqs, freeze, False, cuda=cuda, replace_torch=replace)
    assert "\n" not in str(refused.value)


def test_a_freeze_that_cannot_tell_its_cuda_plans_when_no_numba_cuda_is_asked_for(tmp_path):
    plan = bw.plan_requirements(
        _reqs("torch==2.13.0", "tqdm==4.70.1"), _freeze(tmp_path, f"torch=={NVIDIA_TORCH}"), False
    )
    assert plan.requirements == ["torch>=2.10", "tqdm==4.70.1"] and plan.cuda == ""


def test_cuda_option_reads_a_major_or_torch_version_cuda_as_printed():
    assert [bw.cuda_major(text) for text in ("12", "12.8", "13.0", "13")] == [12, 12, 13, 13]
    with pytest.raises(Exception, match="no CUDA version"):
        bw.cuda_major("cu126")


def test_nvvm_from_cuda_home_drops_the_libnvvm_wheel_of_either_cuda_extra():
    # What pip resolves for numba-cuda 0.30.4's extras: libNVVM comes in nvidia-cuda-nvcc-cu12
    # (cuda-toolkit 12's nvcc) for cu12 and in nvidia-nvvm (cuda-toolkit 13's nvvm) for cu13.
    cu12 = [
        "cuda-bindings",
        "nvidia-cuda-nvcc-cu12",
        "nvidia-cuda-nvrtc-cu12",
        "nvidia-nvjitlink-cu12",
    ]
    cu13 = ["cuda-bindings", "nvidia-nvvm", "nvidia-cuda-nvrtc", "nvidia-nvjitlink"]
    for names, libnvvm in ((cu12, "nvidia-cuda-nvcc-cu12"), (cu13, "nvidia-nvvm")):
        plan = bw.Plan()
        kept = bw.drop_nvvm([{"metadata": {"name": n, "version": "1"}} for n in names], plan)
        assert [i["metadata"]["name"] for i in kept] == [n for n in names if n != libnvvm]
        assert [name for name, _ in plan.left_out] == [libnvvm]


# A driver runs every CUDA toolkit of its major and older ones, none of a newer major (NVIDIA's CUDA
# compatibility table: CUDA 13.x needs a driver >= 580, 12.x one >= 525); numba-cuda runs on its
# cuda-bindings and needs libNVVM.
@pytest.mark.parametrize(
    ("driver", "torch_cuda", "bindings", "nvvm", "runs"),
    [
        (13000, "13.0", "13.5.0", True, True),
        (12040, "12.6", "12.9.10", True, True),  # a 550 driver, the cu12 extra
        (12020, "12.6", "13.5.0", True, False),  # a 535 driver, the cu13 extra's bindings
        (13000, "13.0", "12.9.10", True, True),  # CUDA 12 bindings run on a CUDA 13 driver
        (13000, "13.0", "13.5.0", False, False),  # no libNVVM
        (None, "13.0", "13.5.0", True, None),  # the driver's CUDA unknown
    ],
)
def test_the_numba_loss_verdict_follows_the_driver_and_the_bindings_major(
    driver, torch_cuda, bindings, nvvm, runs
):
    verdict, said = bw.numba_loss_verdict(driver, torch_cuda, "0.30.4", bindings, nvvm)
    assert verdict is runs
    major = Version(bindings).major
    assert f"cuda-bindings {bindings} (CUDA {major}: its cu{major} extra)" in said
    assert f"torch CUDA {torch_cuda}" in said
    assert ("can run" in said) is (runs is True) and ("cannot run" in said) is (runs is False)


def test_the_numba_loss_verdict_names_a_missing_numba_cuda_or_bindings():
    assert bw.numba_loss_verdict(13000, "13.0", None, None, False)[0] is False
    verdict, said = bw.numba_loss_verdict(13000, "13.0", "0.30.4", None, False)
    assert verdict is False and "without cuda-bindings" in said


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
# What the install replaces, and a torch from its own index: builds against a local registry
# --------------------------------------------------------------------------------------------------

# The registry these builds see, in place of the package index: metadata-only wheels shaped like
# the real ones (the NeMo chain's requirements that replace an NVIDIA container's packages: wandb's
# protobuf >= 5, datasets' fsspec bound, nv-one-logger's setuptools >= 79), each package the node has
# also in a newer version no requirement needs, and requirements.txt's torch as the registry has it.
REGISTRY = [
    ("torch", "2.13.0", ("setuptools>=77.0.3",)),
    ("numpy", "2.4.6"),
    ("tqdm", "4.70.1"),
    ("wandb", "0.31.0", ("protobuf!=5.28.0,!=5.29.0,<8,>=5", "packaging", "requests<3,>=2.0.0")),
    ("protobuf", "7.36.2"),
    ("packaging", "24.2"),
    ("requests", "2.34.2"),
    (
        "nemo_toolkit",
        "3.0.0",
        ("numpy>=1.22", 'datasets; extra == "asr"', "nv-one-logger-pytorch-lightning-integration"),
    ),
    ("datasets", "4.0.0", ("fsspec<=2025.3.0,>=2023.1.0", 'protobuf<4.0.0; extra == "tests"')),
    ("fsspec", "2025.3.0"),
    ("fsspec", "2025.10.0"),
    ("nv-one-logger-pytorch-lightning-integration", "2.3.1", ("setuptools (>=79.0.0)",)),
    ("setuptools", "84.2.1"),
]
REQUIREMENTS = (
    "torch==2.13.0\nnumpy==2.4.6\nwandb==0.31.0\ntqdm==4.70.1\nnemo_toolkit[asr]==3.0.0\n"
)
# NVIDIA's PyTorch container 25.04: torch 2.7 (outside what the project accepts), setuptools 78.
CONTAINER_25_04 = {
    "torch @ file:///opt/transfer/torch-2.12.0a0%2B6a5c3a1d2e.nv26.01-cp312-cp312-linux_x86_64.whl": (
        "torch==2.7.0a0+79aa17489c.nv25.4"
    ),
    "setuptools==79.0.1": "setuptools==78.1.1",
}
TORCH_CU126 = "2.13.0+cu126"


@pytest.fixture(scope="module")
def resolver_pip_wheel(tmp_path_factory) -> Path:
    """RESOLVER_PIP's wheel, fetched once from this machine's index for the local registries."""
    work = tmp_path_factory.mktemp("resolver-pip")
    bw._resolver_pip(work)
    return next((work / "pip-download").glob("pip-*.whl"))


def _local_registry(mp: pytest.MonkeyPatch, folder: Path, resolver_pip: Path) -> None:
    """REGISTRY in ``folder``, made pip's only source (no index) for the builder and its pip."""
    folder.mkdir()
    shutil.copy(resolver_pip, folder)
    for name, version, *requires in REGISTRY:
        _metadata_wheel(folder, name, version, *requires)
    mp.setenv("PIP_NO_INDEX", "1")
    mp.setenv("PIP_FIND_LINKS", str(folder))


def _simple_index(folder: Path, wheels: list[Path]) -> str:
    """A PEP 503 index in ``folder`` serving ``wheels`` (one page per project): its file:// URL."""
    for wheel in wheels:
        page = folder / pep503(parse_wheel_filename(wheel.name)[0])
        page.mkdir(parents=True, exist_ok=True)
        shutil.move(wheel, page / wheel.name)
        links = "".join(f'<a href="{quote(w.name)}">{w.name}</a>\n' for w in page.glob("*.whl"))
        (page / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return folder.as_uri()


def _build(tmp: Path, freeze_text: str, **options) -> tuple[dict, str, Path]:
    """build_wheelhouse for a node of ``freeze_text`` and REQUIREMENTS: (summary, printed, out)."""
    (tmp / "node_freeze.txt").write_text(freeze_text, encoding="utf-8")
    (tmp / "requirements.txt").write_text(REQUIREMENTS, encoding="utf-8")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = bw.build_wheelhouse(
            tmp / "wh",
            target_freeze=tmp / "node_freeze.txt",
            requirement_files=[tmp / "requirements.txt"],
            **options,
        )
    return summary, printed.getvalue(), tmp / "wh"


@pytest.fixture(scope="module")
def container_build(tmp_path_factory, resolver_pip_wheel):
    """The set for an NVIDIA container of tests/nvidia_pytorch_container_freeze.txt (torch 2.12,
    numpy 1.26.4, protobuf 4.25.8, fsspec 2025.9.0, setuptools 79.0.1), from REGISTRY."""
    tmp = tmp_path_factory.mktemp("container")
    with pytest.MonkeyPatch.context() as mp:
        _local_registry(mp, tmp / "registry", resolver_pip_wheel)
        return _build(tmp, NVIDIA_FREEZE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def container_25_04_build(tmp_path_factory, resolver_pip_wheel):
    """The set for an NVIDIA container 25.04 (CONTAINER_25_04: torch 2.7, setuptools 78.1.1) on a
    CUDA 12 driver with --replace-torch --cuda 12, torch from a local index of its CUDA 12.6 build."""
    tmp = tmp_path_factory.mktemp("container-25.04")
    text = NVIDIA_FREEZE.read_text(encoding="utf-8")
    for line, replacement in CONTAINER_25_04.items():
        assert line in text
        text = text.replace(line, replacement)
    wheels = tmp / "cu126-wheels"
    wheels.mkdir()
    cuda_runtime = 'nvidia-cuda-runtime-cu12==12.6.77; platform_system == "Linux"'
    built = [
        _metadata_wheel(wheels, "torch", TORCH_CU126, ("setuptools>=77.0.3", cuda_runtime)),
        _metadata_wheel(wheels, "nvidia-cuda-runtime-cu12", "12.6.77"),
        _metadata_wheel(wheels, "setuptools", "84.2.1"),  # PyTorch's index has torch's every need
    ]
    index = _simple_index(tmp / "cu126", built)
    with pytest.MonkeyPatch.context() as mp:
        _local_registry(mp, tmp / "registry", resolver_pip_wheel)
        summary, printed, out = _build(tmp, text, cuda=12, replace_torch=True, torch_index=index)
    return summary, printed, out, index


def _pins(out: Path) -> dict[str, str]:
    lines = (out / "requirements.txt").read_text(encoding="utf-8").split()
    return dict(line.split("==") for line in lines)


def test_the_builder_prints_each_node_package_the_install_replaces_with_who_asks(container_build):
    summary, printed, out = container_build
    replaced = {item["name"]: item for item in summary["replaced"]}
    assert replaced == {
        "numpy": {
            "name": "numpy",
            "node": "1.26.4",
            "shipped": "2.4.6",
            "why": ["the project's numpy==2.4.6 (it accepts >=2.0,<3)"],
        },
        "protobuf": {
            "name": "protobuf",
            "node": "4.25.8",
            "shipped": "7.36.2",
            "why": ["wandb 0.31.0 asks for protobuf!=5.28.0,!=5.29.0,<8,>=5"],
        },
        "fsspec": {  # a downgrade
            "name": "fsspec",
            "node": "2025.9.0",
            "shipped": "2025.3.0",
            "why": ["datasets 4.0.0 asks for fsspec<=2025.3.0,>=2023.1.0"],
        },
    }
    assert json.loads((out / "wheelhouse.json").read_text())["replaced"] == summary["replaced"]
    # Printed before any wheel is downloaded, one line each: name, node -> shipped, why.
    listed = printed.split("the install replaces 3 of the node's packages")[1]
    assert printed.index("the install replaces 3") < printed.index("downloading")
    for name, item in replaced.items():
        line = next(text for text in listed.splitlines() if text.split()[:1] == [name])
        assert f"{item['node']} -> {item['shipped']}" in line and item["why"][0] in line
    assert {name: _pins(out)[name] for name in replaced} == {
        name: item["shipped"] for name, item in replaced.items()
    }


def test_a_node_version_every_requirement_accepts_is_kept_though_the_registry_has_a_newer_one(
    container_build,
):
    summary, _, out = container_build
    pins = _pins(out)
    # packaging 23.2 and requests 2.32.5 meet wandb's requirements, tqdm 4.67.1 what the project
    # accepts (>=4.60), the container's torch too: REGISTRY's newer versions stay out.
    for name in ("packaging", "requests", "tqdm"):
        assert name not in pins and name not in {r["name"] for r in summary["replaced"]}, name
    assert pins["torch"] == "2.12.0a0+6a5c3a1d2e.nv26.1" and summary["torch"] is None
    assert not any(w.startswith(("packaging-", "requests-", "tqdm-")) for w in summary["wheels"])


def test_setuptools_stays_out_of_the_install_line_where_the_nodes_own_fits(container_build):
    summary, _, out = container_build
    # nv-one-logger asks for setuptools>=79, which the container's 79.0.1 meets: the folder holds
    # setuptools for `pip install -e .`'s build, the install line leaves the node's in place.
    assert "setuptools" not in _pins(out)
    assert "setuptools-84.2.1-py3-none-any.whl" in summary["wheels"]
    assert "setuptools" not in {r["name"] for r in summary["replaced"]}


def test_setuptools_a_package_needs_newer_than_the_nodes_is_listed_as_replaced(
    container_25_04_build,
):
    summary, printed, out, _ = container_25_04_build
    setuptools = next(r for r in summary["replaced"] if r["name"] == "setuptools")
    assert setuptools == {
        "name": "setuptools",
        "node": "78.1.1",
        "shipped": "84.2.1",
        "why": ["nv-one-logger-pytorch-lightning-integration 2.3.1 asks for setuptools>=79.0.0"],
    }
    assert _pins(out)["setuptools"] == "84.2.1"  # pip on the node would take it all the same


def test_replace_torch_for_cuda_12_ships_torchs_build_from_its_index_with_its_cuda_libraries(
    container_25_04_build,
):
    summary, printed, out, index = container_25_04_build
    wheels = summary["wheels"]
    assert f"torch-{TORCH_CU126}-py3-none-any.whl" in wheels  # from the index, not REGISTRY's
    assert not any(w.startswith("torch-2.13.0-") for w in wheels)
    assert "nvidia_cuda_runtime_cu12-12.6.77-py3-none-any.whl" in wheels  # the wheel torch pins
    assert "wandb-0.31.0-py3-none-any.whl" in wheels  # the rest from the usual index
    assert _pins(out)["torch"] == TORCH_CU126 and summary["node_torch"] is None
    assert summary["torch"] == {
        "version": TORCH_CU126,
        "index": index,
        "why": "--cuda 12: the set ships requirements.txt's torch built for CUDA 12",
    }
    torch = next(r for r in summary["replaced"] if r["name"] == "torch")
    assert (torch["node"], torch["shipped"]) == ("2.7.0a0+79aa17489c.nv25.4", TORCH_CU126)
    assert torch["why"] == [
        f"--replace-torch: the project's torch==2.13.0, a CUDA 12 build from {index}"
    ]
    line = next(text for text in printed.splitlines() if text.startswith("  torch "))
    assert f"2.7.0a0+79aa17489c.nv25.4 -> {TORCH_CU126}" in line and torch["why"][0] in line


def test_the_25_04_set_installs_offline_on_a_stand_in_node_replacing_exactly_what_it_named(
    container_25_04_build, tmp_path
):
    """A stand-in for the 25.04 node: a venv holding the freeze's version of every package the set
    touches (metadata-only wheels). The offline install the docs give (--no-index, the wheelhouse
    and its requirements.txt) changes exactly the packages the builder listed as replaced, each to
    the version it named, and leaves every other one the node had as it was."""
    summary, _, out, _ = container_25_04_build
    text = NVIDIA_FREEZE.read_text(encoding="utf-8")
    for line, replacement in CONTAINER_25_04.items():
        text = text.replace(line, replacement)
    wanted = {pep503(name) for name, *_ in REGISTRY} | {"nvidia-cuda-runtime-cu12"}
    node_versions = {}
    for line in text.splitlines():
        name, sep, version = line.partition("==")
        if sep and pep503(name) in wanted:
            node_versions[pep503(name)] = version.strip()
    assert {"torch", "numpy", "protobuf", "setuptools"} <= set(node_versions)
    node = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", str(node)], check=True)
    stand_in = tmp_path / "node-packages"
    stand_in.mkdir()
    wheels = [_metadata_wheel(stand_in, n, v) for n, v in node_versions.items()]

    def pip(*args: str) -> str:
        return _node_pip(node, *args)

    def installed() -> dict[str, str]:
        lines = pip("list", "--format=freeze").split()
        return {pep503(n): v for n, _, v in (line.partition("==") for line in lines)}

    pip("install", "-q", "--no-index", "--no-deps", *map(str, wheels))
    before = installed()
    assert all(before[n] == v for n, v in node_versions.items())
    pip(
        "install", "-q", "--no-index", "--find-links", str(out), "-r", str(out / "requirements.txt")
    )
    after = installed()
    changed = {n: after.get(n) for n, v in before.items() if after.get(n) != v}
    named = {pep503(r["name"]): r["shipped"] for r in summary["replaced"]}
    assert changed == named
    assert after["torch"] == TORCH_CU126


# The torch a set ships is built for the CUDA the node's driver runs: --cuda, else the node's own
# torch's; CUDA 12 from PyTorch's index of its CUDA 12.6 builds, CUDA 13 the registry's own build.
@pytest.mark.parametrize(
    ("lines", "cuda", "index"),
    [
        ([f"torch=={NVIDIA_TORCH}"], 12, "https://download.pytorch.org/whl/cu126"),
        (["torch==2.10.0+cu128"], None, "https://download.pytorch.org/whl/cu126"),
        (["numpy==2.5.2"], 12, "https://download.pytorch.org/whl/cu126"),
        ([f"torch=={NVIDIA_TORCH}"], 13, None),
        (["torch==2.10.0+cu130"], None, None),
        (["numpy==2.5.2"], None, None),  # no torch on the node: the registry's CUDA 13 build
    ],
)
def test_a_shipped_torch_comes_from_the_index_of_the_cuda_the_node_runs(
    tmp_path, lines, cuda, index
):
    plan = bw.plan_requirements(
        _reqs("torch==2.13.0"), _freeze(tmp_path, *lines), False, cuda=cuda, replace_torch=True
    )
    assert plan.torch_index == index and plan.requirements == ["torch==2.13.0"]
    named = bw.plan_requirements(
        _reqs("torch==2.13.0"),
        _freeze(tmp_path, *lines),
        False,
        cuda=cuda,
        replace_torch=True,
        torch_index="https://download.pytorch.org/whl/cu128",
    )
    assert named.torch_index == "https://download.pytorch.org/whl/cu128"


def test_a_torch_index_whose_torch_is_built_for_another_cuda_is_refused(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    index = _simple_index(tmp_path / "cu130", [_metadata_wheel(wheels, "torch", "2.13.0+cu130")])
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\n", encoding="utf-8")
    with pytest.raises(
        bw.WheelhouseError, match=r"torch 2.13.0\+cu130 is a CUDA 13 build, and the"
    ):
        bw.build_wheelhouse(
            tmp_path / "wh",
            cuda=12,
            torch_index=index,
            requirement_files=[tmp_path / "requirements.txt"],
        )
    assert not list((tmp_path / "wh").glob("*"))  # stopped before anything was written


def test_a_torch_index_for_a_set_that_keeps_the_nodes_torch_is_refused(tmp_path):
    with pytest.raises(
        bw.WheelhouseError, match=r"the node's torch 2.11.0\+cu126 stays.*--replace-torch"
    ):
        bw.plan_requirements(
            _reqs("torch==2.13.0"),
            _freeze(tmp_path, "torch==2.11.0+cu126"),
            False,
            torch_index="https://download.pytorch.org/whl/cu126",
        )


def _install(name: str, version: str, *requires: str, **extra) -> dict:
    return {
        "metadata": {"name": name, "version": version, "requires_dist": list(requires)},
        **extra,
    }


def test_a_requirement_asks_only_where_its_marker_holds_for_the_extras_the_set_asks():
    plan = bw.plan_requirements(_reqs("nemo_toolkit[asr]==3.0.0"), bw.Freeze(), False)
    installs = [
        _install(
            "nemo_toolkit", "3.0.0", 'datasets[audio]; extra == "asr"', 'numpy<2; extra == "tts"'
        ),
        _install(
            "datasets", "4.0.0", 'fsspec<=2025.3.0; extra == "audio"', 'protobuf<4; extra == "dev"'
        ),
        _install("fsspec", "2025.3.0"),
        _install("protobuf", "7.36.2"),
        _install("numpy", "2.4.6"),
        _install("setuptools", "84.2.1", build_backend=True),
    ]
    node = _node(fsspec="2025.9.0", protobuf="4.25.8", numpy="1.26.4", setuptools="78.1.1")
    replaced = {r["name"]: r["why"] for r in bw.replaced_packages(installs, plan, node)}
    assert replaced == {
        "fsspec": ["datasets 4.0.0 asks for fsspec<=2025.3.0"],  # datasets[audio], from nemo[asr]
        "protobuf": [],  # datasets[dev] is asked by none
        "numpy": [],  # nemo_toolkit[tts] neither
    }  # setuptools: the build backend's, for `pip install -e .` alone


def test_a_node_version_pip_replaced_though_no_requirement_excludes_it_is_resolved_again_pinned(
    monkeypatch,
):
    plan = bw.plan_requirements(_reqs("wandb==0.31.0"), _node(packaging="23.2"), False)
    calls = []

    def resolve(plan, out, platform_args, work, constraints=None):
        calls.append(constraints)
        wandb = _install("wandb", "0.31.0", "packaging")
        return [wandb] if constraints else [wandb, _install("packaging", "24.2")]

    monkeypatch.setattr(bw, "resolve", resolve)
    installs, replaced = bw.resolve_keeping_node_versions(
        plan, _node(packaging="23.2"), Path("out"), [], Path("work")
    )
    assert calls == [None, ["packaging==23.2"]]
    assert [i["metadata"]["name"] for i in installs] == ["wandb"] and replaced == []


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


def test_the_install_line_pins_the_nodes_own_torch_and_the_set_holds_no_torch(
    tmp_path, monkeypatch
):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("torch==2.13.0\ntqdm==4.70.1\n", encoding="utf-8")
    freeze = tmp_path / "node_freeze.txt"
    freeze.write_text(
        "numpy==2.5.2\ntorch @ file:///opt/transfer/"
        "torch-2.12.0a0%2B6a5c3a1d2e.nv26.01-cp312-cp312-linux_x86_64.whl\n",
        encoding="utf-8",
    )
    fetched = []
    real_download = bw.download

    def download(installs, *args):
        names = [i["metadata"]["name"] for i in installs]
        assert "torch" not in names  # never fetch a torch build to put over the node's
        fetched.extend(names)
        real_download(installs, *args)

    monkeypatch.setattr(bw, "download", download)
    summary = bw.build_wheelhouse(
        tmp_path / "wh", target_freeze=freeze, requirement_files=[requirements]
    )
    assert "tqdm" in fetched
    assert not any(w.startswith("torch-") for w in summary["wheels"])
    # pip on the node keeps a pinned installed version, and refuses a set that needs another.
    pins = (tmp_path / "wh" / "requirements.txt").read_text().split()
    assert pins == ["torch==2.12.0a0+6a5c3a1d2e.nv26.1", "tqdm==4.70.1"]
    assert Version(pins[0].split("==")[1]) == Version(NVIDIA_TORCH)
    assert summary["node_torch"] == pins[0].split("==")[1]


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
    assert pins["torch"] == "2.11.0"  # the image's own, pinned as it is
    for kept in ("numpy", "numba", "numba-cuda", "sentencepiece", "polars", "setuptools"):
        assert kept not in pins, kept
    wheels = os.listdir(out)
    assert not any(w.startswith("torch-") for w in wheels)
    assert summary["cuda"].startswith("numba-cuda[cu13]==0.30.4: ")
    assert any(w.startswith("antlr4_python3_runtime-4.9.3-py3-none-any") for w in wheels)
    # The build backend for `pip install -e .` is in the folder, not in the install line.
    assert any(w.startswith("setuptools-") for w in wheels)
    assert all(w.endswith((".whl", ".txt", ".json")) for w in wheels)
    assert json.loads((out / "wheelhouse.json").read_text())["training_only"] is True


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _node_env() -> dict[str, str]:
    """This process's environment without this machine's pip configuration, which stays out of a
    stand-in node."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _node_pip(venv: Path, *args: str) -> str:
    """pip of the stand-in node ``venv`` with ``args``: its output; a failure fails the test."""
    done = subprocess.run(
        [str(_venv_python(venv)), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        env=_node_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# A sitecustomize that makes packages look not installed: no finder finds their modules or their
# distribution's metadata (what importlib.util.find_spec and importlib.metadata ask, as libraries'
# "is it available" checks do).
NOT_INSTALLED = """
import sys

HIDDEN = set({names!r})


class _Without:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, context=None):
        if not hasattr(self.finder, "find_distributions"):
            return iter(())
        found = self.finder.find_distributions(context) if context else self.finder.find_distributions()
        return (d for d in found if (d.metadata["Name"] or "").lower() not in HIDDEN)

    def invalidate_caches(self):
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


sys.meta_path[:] = [_Without(f) for f in sys.meta_path]
"""


def test_training_needs_none_of_what_a_training_only_wheelhouse_leaves_out(tmp_path):
    """``--training-only`` leaves out OFFLINE_ONLY (polars, matplotlib): train.py trains, saves and
    exports without them, here in a process where neither can be found (a sitecustomize hides their
    modules and their metadata, as on a node that never installed them). The offline install of a
    wheelhouse beside a node's own torch, numpy and sentencepiece, and a job trained with it, is
    the air-gapped runbook's test (tests/test_air_gapped.py)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOT_INSTALLED.format(names=sorted(bw.OFFLINE_ONLY)))
    data = make_training_data(tmp_path / "data", per_lang=8, vocab_size=64)
    env = tiny_train_env(
        data,
        DATA_DIR=str(tmp_path / "run"),
        MAX_STEPS="3",
        UNFREEZE_STEP="1",
        EVAL_EVERY_STEPS="0",
        WANDB_MODE="offline",
        PYTHONPATH=str(site),
    )
    probe = subprocess.run(
        [sys.executable, "-c",
         "import importlib.metadata as m, importlib.util as u; "
         "print(u.find_spec('polars'), u.find_spec('matplotlib'), "
         "[d for d in ('polars', 'matplotlib') if any(True for _ in m.distributions(name=d))]); "
         "import polars"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert probe.stdout.split() == ["None", "None", "[]"], probe.stdout + probe.stderr[-2000:]
    assert "No module named 'polars'" in probe.stderr
    run = subprocess.run(
        [sys.executable, str(REPO / "train.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    metrics = next((tmp_path / "run").rglob("metrics.jsonl"))
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines() if "train/loss" in l]
    assert steps == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "step_00000003.nemo").is_file()


@pytest.mark.slow
def test_the_nvidia_containers_set_keeps_its_torch_and_takes_numba_cuda_for_cuda_12(
    tmp_path, monkeypatch
):
    resolved = []
    monkeypatch.setattr(bw, "download", lambda installs, *args: resolved.extend(installs))
    with pytest.raises(bw.WheelhouseError, match="give --cuda 12 or --cuda 13"):
        bw.build_wheelhouse(tmp_path / "wh", target_freeze=NVIDIA_FREEZE, training_only=True)
    summary = bw.build_wheelhouse(
        tmp_path / "wh",
        python_version="3.12",
        platforms=IMAGE_PLATFORMS,
        target_freeze=NVIDIA_FREEZE,
        training_only=True,
        cuda=12,
    )
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in resolved}
    assert "torch" not in versions  # pip kept the container's pre-release torch for every need
    assert versions["numba-cuda"] == "0.30.4"
    # CUDA 12's bindings (the container's 12.9.2 fits numba-cuda[cu12]), nvJitLink and libNVVM.
    assert "cuda-bindings" not in versions
    assert "nvidia-cuda-nvcc-cu12" in versions and "nvidia-nvjitlink-cu12" in versions
    assert not {"nvidia-nvvm", "nvidia-nvjitlink"} & set(versions)  # CUDA 13's
    pins = (tmp_path / "wh" / "requirements.txt").read_text().split()
    assert "torch==2.12.0a0+6a5c3a1d2e.nv26.1" in pins
    assert len(summary["freeze_warnings"]) == 4
    # The container's numpy 1.26.4 and protobuf 4 go, each with who asks; its packaging 23.2 stays
    # (only pytest, a test tool left out, asks for >= 24), and its setuptools 79.0.1 fits NeMo's.
    replaced = {item["name"]: item for item in summary["replaced"]}
    assert {"numpy", "protobuf"} <= set(replaced) and all(r["why"] for r in replaced.values())
    assert replaced["numpy"]["why"][0] == "the project's numpy==2.4.6 (it accepts >=2.0,<3)"
    assert "packaging" not in replaced and not any(p.startswith("setuptools==") for p in pins)


def _metadata_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A wheel of ``name`` ``version`` holding its metadata only, with a Requires-Dist line for each
    of ``requires`` and a Provides-Extra line for each extra their markers name (the binary
    distribution format: the file name's name escaped to ``[a-z0-9_]``, the version as is, local
    label included)."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{stem}-{version}.dist-info"
    extras = dict.fromkeys(re.findall(r"extra == [\"']([^\"']+)", " ".join(requires)))
    requires_dist = "".join(f"Provides-Extra: {extra}\n" for extra in extras)
    requires_dist += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + requires_dist,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    wheel = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


@pytest.mark.slow
def test_what_pip_itself_writes_for_a_containers_packages_reads_back_as_installed(tmp_path):
    # pip's own freeze of packages installed as NVIDIA's containers install them: torch from a wheel
    # file with a local version, a name in its project's own case, an editable source tree.
    venv = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    wheels = tmp_path / "transfer"
    wheels.mkdir()
    built = [
        _metadata_wheel(wheels, "torch", "2.12.0a0+6a5c3a1d2e.nv26.1"),
        _metadata_wheel(wheels, "Ruamel.Yaml", "0.18.15"),
    ]
    thunder = tmp_path / "lightning-thunder"
    thunder.mkdir()
    (thunder / "setup.py").write_text(
        "from setuptools import setup\nsetup(name='lightning-thunder', version='0.2.5.dev0')\n"
    )
    env = _node_env()

    def pip(*args: str) -> str:
        return _node_pip(venv, *args)

    pip("install", "-q", "--no-index", "--no-deps", *map(str, built))
    # An editable install as `setup.py develop` makes one: a fresh venv has setuptools, but not the
    # wheel package a PEP 660 editable build needs.
    done = subprocess.run(
        [str(_venv_python(venv)), "setup.py", "-q", "develop"],
        cwd=thunder,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    frozen = pip("freeze")
    assert "torch @ file://" in frozen and "%2B6a5c3a1d2e" in frozen, frozen
    for command in (["freeze"], ["list", "--format=freeze"]):
        path = tmp_path / "freeze.txt"
        path.write_text(frozen if command == ["freeze"] else pip(*command), encoding="utf-8")
        freeze = bw.read_freeze(path)
        assert Version(freeze.versions["torch"]) == Version(NVIDIA_TORCH), command
        assert freeze.versions[pep503("Ruamel.Yaml")] == "0.18.15", command
        assert freeze.versions["lightning-thunder"] == "0.2.5.dev0", command
        assert freeze.warnings == [], command
