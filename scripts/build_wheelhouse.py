"""Write every wheel a GPU node without internet needs to train with this project, on a connected machine.

Usage (on a machine that reaches the package index; the project's .venv is enough to run it):
    python scripts/build_wheelhouse.py --out wheelhouse                 # for this machine's Python
    python -m pip freeze > node_freeze.txt                               # on the GPU node
    python scripts/build_wheelhouse.py --out wheelhouse --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --target-freeze node_freeze.txt --training-only
    # an NVIDIA PyTorch container: its torch's version does not say its CUDA; state it
    python scripts/build_wheelhouse.py ... --target-freeze node_freeze.txt --cuda 12
    # a node whose torch is older than the project accepts, driver for CUDA 12: torch's CUDA 12 build
    python scripts/build_wheelhouse.py ... --target-freeze node_freeze.txt --replace-torch --cuda 12

Then, on the node (no index, the wheelhouse copied next to the checkout):
    python -m pip install --no-index --find-links wheelhouse -r wheelhouse/requirements.txt
    python -m pip install --no-index --find-links wheelhouse --no-deps -e .   # the project's modules
or, where the node's Python cannot be written to, into a directory of its own:
    python -m pip install --no-index --no-deps --target /scratch/site wheelhouse/*.whl
    export PYTHONPATH=/scratch/site:$PWD

What goes in: requirements.txt and requirements-gpu.txt, each pin with every dependency it needs,
resolved by pip for ``--python-version`` and ``--platform`` (default: this interpreter's), as wheels
only; a requirement published only as an sdist (antlr4-python3-runtime) is built into a wheel here,
and must come out pure Python (or built for the target's own platform) to be used. setuptools comes
too, so the project itself installs with ``--no-index``, and stays out of the install line: the
node keeps its own, unless a package of the set asks for a newer one (NeMo 3.0's
nv-one-logger-pytorch-lightning-integration asks for >= 79), which pip on the node then takes from
the folder all the same: then it is pinned, and listed with the other packages the install replaces.

What stays out, each printed with its reason:
- the test and lint tools (pytest, pytest-xdist, hypothesis, ruff);
- with ``--training-only``, what only the offline steps import (polars, matplotlib): for a node that
  trains on data prepared elsewhere;
- with ``--target-freeze`` (the node's ``python -m pip freeze``, in any form pip prints), what the
  node already has: a pinned package whose installed version the project accepts (ACCEPTS below:
  the node's CUDA build of torch, its numpy, ...; pre-releases and local versions count, as pip
  counts an installed one) and every dependency the installed packages already satisfy. A pin the
  node has in a version the project does not accept (lightning 2.6.6: NeMo 3.0 does not import
  with it) is shipped in the pinned version. A freeze line it cannot read is a warning naming the
  line; that package counts as absent;
- with ``--nvvm-from-cuda-home``, libNVVM's wheel (nvidia-nvvm, about 59 MiB; for CUDA 12 the
  compiler's, nvidia-cuda-nvcc-cu12): numba-cuda then finds libNVVM in the node's CUDA toolkit
  (CUDA_HOME), as in NVIDIA's containers.

What the install replaces: pip keeps an installed version wherever every requirement of the set
accepts it (one it replaced all the same is resolved again with the node's version pinned). Before
it downloads, the builder prints each package of the freeze the install replaces, the node's
version -> the shipped one, and who asks for it: a pin of the project the node's version is outside
of, or each package of the set whose requirement excludes it; wheelhouse.json keeps the list.

The node's torch is never replaced: one outside ACCEPTS, one whose version the freeze does not
say, or one a requirement of the set excludes is refused in one line, unless ``--replace-torch``
asks to ship requirements.txt's torch in its place. The torch the set ships (``--replace-torch``, or
a node without torch) is built for the CUDA major the node's driver runs: ``--cuda``, else that of
the node's own torch, else (no torch on the node) the registry's (CUDA 13). A CUDA 12 build comes
from PyTorch's index (TORCH_INDEXES: ``cu126``), with the CUDA libraries and triton it pins, the
rest of the set from the usual index; ``--torch-index`` names another index. numba-cuda (NeMo's CUDA
TDT loss) takes the CUDA extra (``cu12``, ``cu13``) of the torch the node trains with: from its
local version tag (``+cu126``), else from the CUDA runtime wheel a registry build brings, else from
``--cuda``; where none says (NVIDIA's containers: ``2.12.0a0+6a5c3a1d2e.nv26.01``) the build is
refused in one line.

It prints the set's size and writes, beside the wheels, ``requirements.txt`` (one ``name==version``
per wheel but a setuptools the node keeps, and the node's own torch at its version: the install line
above) and ``wheelhouse.json`` (the target, the CUDA extra and why, the torch the set ships and its
index, what was left out and why, what the install replaces and why, each wheel's size). Run again
into the same folder, it keeps the wheels the new set holds and removes the other wheels there.
Markers (``; python_version < "3.12"``) are evaluated by pip on this machine's Python: a dependency
that only an older Python needs can come along unused. The target's packages are known by name and
version only, not by what they require: a shipped wheel that one of them bounds (torch bounding
setuptools, say) shows as a conflict at the node's ``--no-index`` install, named by pip, never as a
silent change.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
REQUIREMENT_FILES = ("requirements.txt", "requirements-gpu.txt")
# The pip that resolves: dry runs for another platform against installed packages need pip >= 24.
RESOLVER_PIP = "pip==26.3"
MAX_SDIST_BUILDS = 10
BUILD_BACKEND = "setuptools>=68"  # pyproject.toml's [build-system]

# Needed to test and lint the project, not to train with it.
DEV_ONLY = {
    "pytest": "the test runner",
    "pytest-xdist": "the test runner's parallel workers",
    "hypothesis": "the tests' data",
    "ruff": "the linter",
}
# Imported only by the offline steps (build_manifest, make_train_val, reports), never by train.py,
# its DataLoader workers, preflight with a training cache, or the acceptance run.
OFFLINE_ONLY = {
    "polars": "build_manifest.py, make_train_val.py and the other offline steps",
    "matplotlib": "the reports' PNGs (manifest_report.py, run_report.py)",
}
# Pins whose exact version is this project's tested CPU set, where a node's own installed version
# works too: kept when the target has a version inside the range. Every other pin is exact.
ACCEPTS = {
    "torch": (
        ">=2.10",
        "the CPU tests of train.py's path, scripts/launch.py and the acceptance run's CPU stages "
        "pass on torch 2.10.0; older torchrun lacks --signals-to-handle (docs/operations.md)",
    ),
    "numpy": (
        ">=2.0,<3",
        "numpy 2: pyarrow 26.0.1 does not import with numpy 1.26.4; tdt_loss restores the "
        "np.row_stack numba-cuda 0.30.4 needs",
    ),
    "pyarrow": (">=15", "parquet and memory-mapped Arrow"),
    "sentencepiece": (">=0.2.0", "0.2.2's proto lacks a field; the project warns and goes on"),
    "soundfile": (">=0.12", "decoding"),
    "soxr": (">=0.3", "resampling"),
    "pyyaml": (">=6", "configs"),
    "tqdm": (">=4.60", "progress bars"),
    "rich": (">=13", "tables"),
    "wandb": (">=0.17", "the W&B client"),
    "kaldialign": (">=0.9", "edit distances"),
    "matplotlib": (">=3.7", "PNGs"),
    "numba": (">=0.60,<0.69", "the range requirements-gpu.txt allows"),
}
# Left out with --nvvm-from-cuda-home: libNVVM comes from the node's CUDA toolkit. numba-cuda's cu13
# extra brings it in nvidia-nvvm, its cu12 extra in the CUDA 12 compiler's wheel.
NVVM_WHEELS = {"nvidia-nvvm", "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12"}
# numba-cuda's CUDA extras, as its published metadata names them (numba-cuda 0.30.4: Provides-Extra
# cu12 and cu13; NeMo 3.0's own cu12/cu13 extras ask for the same two): by CUDA major version.
NUMBA_CUDA_EXTRAS = {12: "cu12", 13: "cu13"}
# requirements.txt's torch as the registry has it for Linux: built for CUDA 13.0 (requirements-gpu.txt).
REGISTRY_TORCH_CUDA = 13
# Where a torch the set ships comes from when it must be built for another CUDA major than the
# registry's (CUDA 13.0, which needs a driver >= 580): PyTorch's own index of that major's builds.
# A CUDA 12.6 build runs on every CUDA 12 driver (>= 525, by CUDA's minor version compatibility).
TORCH_INDEXES = {12: "https://download.pytorch.org/whl/cu126"}
# torch's registry builds bring CUDA's runtime as a wheel: named for CUDA 12, plain for CUDA 13.
CUDA_RUNTIME_WHEEL = re.compile(r"^nvidia-cuda-runtime(-cu\d+)?$")
# torch's local version tag of a CUDA build: cu126 is CUDA 12.6, cu130 is 13.0.
TORCH_CUDA_TAG = re.compile(r"^cu(\d+)(\d)$")
HOW_TO_SEE_CUDA = "`python -c 'import torch; print(torch.version.cuda)'` on the node prints it"


class WheelhouseError(Exception):
    """A wheelhouse that cannot be built as asked: the message says what to change."""


@dataclass
class Freeze:
    """A node's ``pip freeze``: what it has, in the version each line says."""

    versions: dict[str, str] = field(default_factory=dict)  # canonical name -> version
    unversioned: set[str] = field(default_factory=set)  # installed, no version in its line
    where: dict[str, str] = field(default_factory=dict)  # canonical name -> "file:line"
    warnings: list[str] = field(default_factory=list)  # the lines read as something less

    def has(self, name: str) -> bool:
        return name in self.versions or name in self.unversioned

    def line(self, name: str) -> str:
        """Where ``name`` was read ("file:line"), for messages."""
        return self.where.get(name, "--target-freeze")


@dataclass
class Plan:
    """What goes into the wheelhouse and what stays out, with each reason."""

    requirements: list[str] = field(default_factory=list)  # what pip resolves, node-adjusted
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    target: dict[str, str] = field(default_factory=dict)  # canonical name -> version
    cuda: str = ""  # numba-cuda's CUDA extra and why that one
    node_torch: str | None = None  # the node's torch version when the set keeps it
    asks: dict[str, str] = field(default_factory=dict)  # canonical name -> why the project asks
    torch_index: str | None = None  # the index the set's torch comes from; None: the usual one
    torch_cuda: int | None = None  # the CUDA major of the torch the set ships
    torch_why: str = ""  # why the torch the set ships is built for that CUDA


def read_requirements(paths: list[Path]) -> list[Requirement]:
    """The requirements of ``paths`` (``-r``/options lines, comments and blanks skipped)."""
    out = []
    for path in paths:
        # utf-8-sig: a file saved by a Windows editor starts with a byte-order mark.
        for number, raw in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
            line = raw.split(" #")[0].strip()
            if not line or line.startswith(("#", "-")):
                continue
            try:
                out.append(Requirement(line))
            except InvalidRequirement as exc:
                raise WheelhouseError(f"{path}:{number}: not a requirement ({exc})") from None
    return out


# pip freeze's comment above an editable install without a VCS remote, naming what it installed:
# "# Editable install with no version control (name==1.0)", "# Editable Git install with no remote
# (name==1.0)", "# Editable Git install (name==1.0) with either a deleted local remote or invalid URI:".
EDITABLE_COMMENT = re.compile(r"^#\s*Editable\b.*\(([A-Za-z0-9][A-Za-z0-9._-]*)===?([^)\s]+)\)")
EDITABLE = re.compile(r"^(?:-e|--editable)(?:\s+|=)(\S.*)$")
EGG = re.compile(r"[#&]egg=([A-Za-z0-9][A-Za-z0-9._-]*)")
LEADING_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")
EVERY_VERSION = "`python -m pip list --format=freeze` on the node prints every version"


def version_in_url(url: str) -> str | None:
    """The version a ``name @ url`` freeze line installed, from the wheel's or sdist's file name in
    the URL's path (%-decoded: pip writes a local version's ``+`` as ``%2B``); None for a directory
    or a VCS checkout, whose version the line does not say."""
    scheme = url.split(":", 1)[0]
    if "+" in scheme:  # git+https://...@commit
        return None
    filename = _file_name(url)
    try:
        if filename.endswith(".whl"):
            return str(parse_wheel_filename(filename)[1])
        if filename.endswith((".tar.gz", ".zip")):
            return str(parse_sdist_filename(filename)[1])
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return None


def read_freeze(path: Path) -> Freeze:
    """A node's ``pip freeze`` (or ``pip list --format=freeze``), every form pip prints:
    ``name==version`` (pre-release and local versions: ``2.12.0a0+6a5c3a1d2e.nv26.01``), ``name===version``,
    ``name @ file:///.../name-version-....whl`` and ``@ https://`` (the version from the file name),
    ``-e`` editables (the version from pip's comment above one without a VCS remote). Names are
    canonical (PEP 503: ``Ruamel.Yaml`` and ``ruamel_yaml`` are ``ruamel-yaml``), versions PEP 440's
    normal form. A line naming a package without a version it can read (a VCS checkout, a source
    directory) marks that package installed in an unknown version; it, and every line that names no
    package, is a warning naming the line, in ``warnings``."""
    freeze = Freeze()

    def warn(number: int, line: str, why: str) -> None:
        freeze.warnings.append(f"{path}:{number}: {line!r}: {why}")

    def had(name: str, version: str | None, number: int, line: str, why: str = "") -> None:
        name = canonicalize_name(name)
        freeze.where[name] = f"{path}:{number}"
        if version is None:
            freeze.unversioned.add(name)
            why = why or "no version in this line"
            warn(number, line, f"{why}: {name} counts as absent ({EVERY_VERSION})")
            return
        freeze.versions[name] = version
        freeze.unversioned.discard(name)

    pending: tuple[str, str] | None = None  # (name, version) of pip's comment above an editable
    for number, raw in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            found = EDITABLE_COMMENT.match(line)
            if found:
                pending = (found.group(1), found.group(2))
            continue
        named, pending = pending, None
        editable = EDITABLE.match(line)
        if editable:
            egg = EGG.search(editable.group(1))
            if named:
                had(named[0], _normal_version(named[1]), number, line)
            elif egg:
                had(egg.group(1), None, number, line)
            else:
                warn(number, line, "an editable install whose name pip did not write: ignored")
            continue
        if line.startswith("-"):
            warn(number, line, "an option, not a package: ignored")
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            req = None
        if req is not None and req.url:
            had(req.name, version_in_url(req.url), number, line)
            continue
        specs = list(req.specifier) if req is not None else []
        if len(specs) == 1 and specs[0].operator in ("==", "==="):
            version = _normal_version(specs[0].version)
            had(req.name, version, number, line, f"{specs[0].version!r} is no PEP 440 version")
            continue
        leading = LEADING_NAME.match(line)
        if leading:
            had(leading.group(1), None, number, line, "not a `pip freeze` line (name==version)")
        else:
            warn(number, line, "not a `pip freeze` line (name==version): ignored")
    if not freeze.versions:
        raise WheelhouseError(
            f"{path}: no line reads as an installed package (name==version): give the output of "
            f"`python -m pip freeze` on the node"
        )
    return freeze


def _normal_version(text: str) -> str | None:
    try:
        return str(Version(text.strip()))
    except InvalidVersion:
        return None


def installed_satisfies(version: str, specifier: SpecifierSet | str) -> bool:
    """Whether an installed ``version`` meets ``specifier`` as pip judges an installed package:
    pre-releases count (``2.12.0a0`` is in ``>=2.11``), a local version's label is ignored against
    a specifier without one (``2.13.0+cu126`` is in ``==2.13.0``)."""
    return SpecifierSet(str(specifier)).contains(Version(version), prereleases=True)


def choose_cuda(freeze: Freeze, cuda: int | None, replace_torch: bool) -> tuple[int | None, str]:
    """(the CUDA major version numba-cuda's extra is chosen for, why): that of the torch the node
    trains with. Read from the node's torch's local version tag (``+cu126``: 12), else, for a
    registry build without one, from the CUDA runtime wheel beside it; ``cuda`` (``--cuda``) states
    it where the freeze cannot (NVIDIA's containers: ``2.12.0a0+6a5c3a1d2e.nv26.01``) and must agree
    where it can. A set that ships requirements.txt's torch (no torch on the node, or
    ``replace_torch``) takes the CUDA that torch is built for (``shipped_torch_cuda``). (None, why)
    for a CPU build of torch."""
    have = freeze.versions.get("torch")
    if have is None or replace_torch:
        return shipped_torch_cuda(freeze, cuda)
    where = freeze.line("torch")
    local = (Version(have).local or "").split(".")
    tagged = local_cuda_majors(have)
    if tagged:
        found = tagged.pop()
        how = f"the node's torch {have} is a CUDA {found} build ({where})"
    elif "cpu" in local:
        if cuda is not None:
            raise WheelhouseError(
                f"{where}: --cuda {cuda}, but the node's torch {have} is a CPU build: install "
                f"torch's CUDA build on the node first"
            )
        return None, (
            f"the node's torch {have} is a CPU build: numba-cuda as requirements-gpu.txt writes "
            f"it (NeMo's CUDA loss needs torch's CUDA build)"
        )
    elif local != [""]:  # NVIDIA's builds (.nv26.01), source builds (+git...): no CUDA in the tag
        if cuda is None:
            raise WheelhouseError(
                f"{where}: the node's torch {have} does not say which CUDA it is built for: give "
                f"--cuda 12 or --cuda 13 ({HOW_TO_SEE_CUDA})"
            )
        return cuda, f"--cuda {cuda} for the node's torch {have}"
    else:
        runtimes = {
            Version(version).major: f"{name} {version}"
            for name, version in sorted(freeze.versions.items())
            if CUDA_RUNTIME_WHEEL.match(name)
        }
        if len(runtimes) != 1:
            if cuda is not None:
                return cuda, f"--cuda {cuda} for the node's torch {have}"
            seen = " and ".join(runtimes.values()) or "none"
            raise WheelhouseError(
                f"{where}: the node's torch {have} has no CUDA tag and the freeze's CUDA runtime "
                f"wheels ({seen}) do not say one CUDA: give --cuda 12 or --cuda 13 "
                f"({HOW_TO_SEE_CUDA})"
            )
        ((found, runtime),) = runtimes.items()
        how = f"the node's torch {have} is a CUDA {found} build ({runtime} beside it)"
    if cuda is not None and cuda != found:
        raise WheelhouseError(
            f"{where}: --cuda {cuda}, but the node's torch {have} is a CUDA {found} build (from "
            f"{how}): leave --cuda out or give {found}"
        )
    return found, how


def local_cuda_majors(version: str) -> set[int]:
    """The CUDA majors a torch version's local tag names (``2.13.0+cu126``: {12}; none for
    ``2.13.0``, ``+cpu`` or NVIDIA's ``+6a5c3a1d2e.nv26.01``)."""
    local = (Version(version).local or "").split(".")
    return {int(tag.group(1)) for tag in map(TORCH_CUDA_TAG.match, local) if tag}


def shipped_torch_cuda(freeze: Freeze, cuda: int | None) -> tuple[int, str]:
    """(CUDA major, why) of the torch a set ships, in place of the node's or where it has none: the
    major the node's driver runs, which a torch of another major may not run on (CUDA 13 builds need
    a driver >= 580). ``cuda`` (``--cuda``) where given; else that of the node's own torch, which its
    driver runs (its local tag or CUDA runtime wheel, as ``choose_cuda`` reads them); else, no torch
    on the node, the registry's build's. A node torch whose freeze does not say its CUDA (NVIDIA's
    builds, a CPU build, no version) is refused in one line without ``cuda``."""
    if cuda is not None:
        return cuda, f"--cuda {cuda}: the set ships requirements.txt's torch built for CUDA {cuda}"
    if not freeze.has("torch"):
        return REGISTRY_TORCH_CUDA, (
            f"the set ships requirements.txt's torch, the registry's CUDA {REGISTRY_TORCH_CUDA} build"
        )
    have = freeze.versions.get("torch")
    found = None
    if have is not None:
        try:
            found, how = choose_cuda(freeze, None, replace_torch=False)
        except WheelhouseError:
            found = None
    if found is not None:
        return found, (
            f"the set ships requirements.txt's torch built for CUDA {found}, the node's: {how}"
        )
    raise WheelhouseError(
        f"{freeze.line('torch')}: the set ships requirements.txt's torch in place of the node's "
        f"{have or '(no version)'}, which does not say the CUDA the node's driver runs: give "
        f"--cuda 12 or --cuda 13 (`nvidia-smi` on the node prints it; CUDA 13 needs a driver >= 580)"
    )


def plan_requirements(
    requirements: list[Requirement],
    target: Freeze,
    training_only: bool,
    *,
    cuda: int | None = None,
    replace_torch: bool = False,
    torch_index: str | None = None,
) -> Plan:
    """Which requirements pip resolves for the node, and which stay out (``DEV_ONLY``, with
    ``training_only`` ``OFFLINE_ONLY``, a target version inside ``ACCEPTS``, pre-releases and local
    versions included). The node's torch is never replaced unless ``replace_torch``: one the
    project does not accept, or whose version the freeze does not say, is refused in one line.
    numba-cuda takes the CUDA extra of the torch the node trains with (``choose_cuda``). A torch the
    set ships comes from ``torch_index``, else from TORCH_INDEXES' index for the CUDA major it must
    be built for (``shipped_torch_cuda``), else (the registry's CUDA 13) from the usual index."""
    plan = Plan(target=dict(target.versions))
    for req in requirements:
        name = canonicalize_name(req.name)
        if name in DEV_ONLY:
            plan.left_out.append((req.name, f"tests and lint only ({DEV_ONLY[name]})"))
            continue
        if training_only and name in OFFLINE_ONLY:
            plan.left_out.append((req.name, f"offline steps only ({OFFLINE_ONLY[name]})"))
            continue
        if name == "numba-cuda":
            major, why = choose_cuda(target, cuda, replace_torch)
            if major is not None:
                req = _with_cuda_extra(req, major, why)
            plan.cuda = f"{req}: {why}"
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        marker = f"; {req.marker}" if req.marker else ""
        have = target.versions.get(name)
        if name == "torch" and (replace_torch or not target.has(name)):
            plan_shipped_torch(plan, req, target, cuda, torch_index)
            plan.requirements.append(str(req))
            continue
        if name == "torch":
            if have is None:
                raise WheelhouseError(
                    f"{target.line(name)}: the node's torch has no version in its freeze line: "
                    f"give the output of `python -m pip list --format=freeze` on the node (it "
                    f"prints every version), or --replace-torch to ship {req} in its place"
                )
            plan.node_torch = have
        if have is not None and name in ACCEPTS and not installed_satisfies(have, req.specifier):
            spec, why = ACCEPTS[name]
            if SpecifierSet(spec) != req.specifier:
                plan.asks[name] = f"the project's {req} (it accepts {spec})"
            if installed_satisfies(have, spec):
                plan.left_out.append(
                    (
                        req.name,
                        f"the target has {have}, accepted ({spec}: {why}; pinned {req.specifier})",
                    )
                )
                # Still resolved, so pip keeps the installed version for what depends on it.
                plan.requirements.append(f"{req.name}{extras}{spec}{marker}")
                continue
            if name == "torch":
                raise WheelhouseError(
                    f"{target.line(name)}: the node's torch {have} is outside what the project "
                    f"accepts ({spec}): train on an image with torch {spec}, or give "
                    f"--replace-torch to ship {req} in place of the node's own build"
                )
        plan.requirements.append(str(req))
        plan.asks.setdefault(name, f"the project's {req}")
        if have is not None and installed_satisfies(have, req.specifier):
            plan.left_out.append((req.name, f"the target has {have}, as pinned"))
    if torch_index and plan.torch_cuda is None:
        kept = f"the node's torch {plan.node_torch} stays" if plan.node_torch else "no torch"
        raise WheelhouseError(
            f"--torch-index {torch_index}: the set ships {kept}; --replace-torch ships "
            f"requirements.txt's torch from that index in its place"
        )
    return plan


def plan_shipped_torch(
    plan: Plan, req: Requirement, target: Freeze, cuda: int | None, torch_index: str | None
) -> None:
    """Where ``req`` (requirements.txt's torch, shipped to the node) comes from, in ``plan``: built
    for the CUDA major the node's driver runs (``shipped_torch_cuda``), from ``torch_index`` or
    TORCH_INDEXES' index for that major, or the registry's own build where it is that major."""
    major, why = shipped_torch_cuda(target, cuda)
    if torch_index is None and major != REGISTRY_TORCH_CUDA:
        if major not in TORCH_INDEXES:
            raise WheelhouseError(
                f"{req}: PyTorch's index is known here for CUDA {', '.join(map(str, TORCH_INDEXES))} "
                f"only, and the registry's torch is a CUDA {REGISTRY_TORCH_CUDA} build; for CUDA "
                f"{major} ({why}) give --torch-index with an index of torch's CUDA {major} builds"
            )
        torch_index = TORCH_INDEXES[major]
    plan.torch_index, plan.torch_cuda, plan.torch_why = torch_index, major, why
    source = torch_index or "the registry"
    plan.asks["torch"] = f"--replace-torch: the project's {req}, a CUDA {major} build from {source}"


def _with_cuda_extra(req: Requirement, major: int, why: str) -> Requirement:
    """``req`` (numba-cuda) with the CUDA extra of CUDA ``major`` in place of any other."""
    if major not in NUMBA_CUDA_EXTRAS:
        known = ", ".join(f"{extra} (CUDA {m})" for m, extra in NUMBA_CUDA_EXTRAS.items())
        raise WheelhouseError(
            f"{req.name} publishes CUDA extras {known} only; the torch the node trains with is "
            f"CUDA {major} ({why}): train with TDT_LOSS=torch, which needs no numba"
        )
    chosen = Requirement(str(req))
    chosen.extras = (set(req.extras) - set(NUMBA_CUDA_EXTRAS.values())) | {NUMBA_CUDA_EXTRAS[major]}
    return chosen


def numba_loss_verdict(
    driver_cuda: int | None,
    torch_cuda: str | None,
    numba_cuda: str | None,
    bindings: str | None,
    nvvm: bool,
) -> tuple[bool | None, str]:
    """Whether NeMo's numba TDT loss can run on a node's combination, and the sentence saying the
    combination: the driver's CUDA (cudaDriverGetVersion: 12040 is 12.4), torch's CUDA build
    (``torch.version.cuda``), numba-cuda's version and the cuda-bindings it runs on (their major
    is numba-cuda's CUDA extra: cu12 brings bindings 12, cu13 bindings 13), whether libNVVM was
    found. It can when numba-cuda, its bindings and libNVVM are there and the driver runs the
    bindings' CUDA major (a driver runs every toolkit of its major and older, none newer: CUDA 13
    needs a driver >= 580); None when the driver's CUDA is unknown."""
    driver = (
        "unknown" if driver_cuda is None else f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}"
    )
    said = f"driver CUDA {driver}, torch CUDA {torch_cuda or 'none (a CPU build)'}"
    if numba_cuda is None:
        return False, f"{said}, no numba-cuda: NeMo's numba loss cannot run"
    if bindings is None:
        return False, f"{said}, numba-cuda {numba_cuda} without cuda-bindings: it cannot run"
    major = Version(bindings).major
    extra = NUMBA_CUDA_EXTRAS.get(major)
    said += f", numba-cuda {numba_cuda} on cuda-bindings {bindings} (CUDA {major}"
    said += f": its {extra} extra)" if extra else ")"
    if torch_cuda and int(torch_cuda.split(".")[0]) != major:
        said += f" beside a CUDA {torch_cuda.split('.')[0]} torch"
    if not nvvm:
        return False, f"{said}: NeMo's numba loss cannot run without libNVVM"
    if driver_cuda is None:
        return None, f"{said}: whether NeMo's numba loss runs depends on the driver"
    if driver_cuda // 1000 < major:
        fits = NUMBA_CUDA_EXTRAS.get(driver_cuda // 1000, "none")
        return False, (
            f"{said}: NeMo's numba loss cannot run (CUDA {major} bindings need a driver for CUDA "
            f"{major}): numba-cuda's extra for this driver is {fits}"
        )
    return True, f"{said}: NeMo's numba loss can run"


def check_node_torch_kept(installs: list[dict], plan: Plan) -> None:
    """Refuse a resolution that would install a torch over the node's own (``plan.node_torch``),
    naming what asks for it: pip takes the installed torch wherever it fits, so a torch in the
    set means a requirement excludes the node's version."""
    if plan.node_torch is None:
        return
    new = [i for i in installs if canonicalize_name(i["metadata"]["name"]) == "torch"]
    if not new:
        return
    asking = []
    for install in installs:
        for text in install["metadata"].get("requires_dist") or []:
            try:
                dep = Requirement(text)
            except InvalidRequirement:
                continue
            if canonicalize_name(dep.name) == "torch" and not installed_satisfies(
                plan.node_torch, dep.specifier
            ):
                asking.append(f"{install['metadata']['name']} asks for torch{dep.specifier}")
    raise WheelhouseError(
        f"the set would install torch {new[0]['metadata']['version']} over the node's "
        f"{plan.node_torch} ({'; '.join(asking) or 'pip found no way to keep it'}): train on an "
        f"image whose torch fits, or give --replace-torch"
    )


MANYLINUX = re.compile(r"^manylinux_2_(\d+)_(\w+)$")
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def drop_nvvm(installs: list[dict], plan: Plan) -> list[dict]:
    """``installs`` without libNVVM's wheels (``NVVM_WHEELS``), each one dropped named in
    ``plan.left_out``: with ``--nvvm-from-cuda-home`` numba-cuda finds libNVVM in CUDA_HOME."""
    kept = []
    for install in installs:
        if canonicalize_name(install["metadata"]["name"]) in NVVM_WHEELS:
            plan.left_out.append(
                (
                    install["metadata"]["name"],
                    "--nvvm-from-cuda-home: the node's CUDA toolkit has libNVVM",
                )
            )
        else:
            kept.append(install)
    return kept


def cuda_major(text: str) -> int:
    """``--cuda``'s value: a CUDA version (``12``, ``12.8``) as its major number."""
    try:
        return Version(text).major
    except InvalidVersion:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no CUDA version (12, 13, or 12.8 as torch.version.cuda prints it)"
        ) from None


def expand_platforms(platforms: list[str]) -> list[str]:
    """``platforms`` with every older glibc level each manylinux tag runs: pip matches a given
    ``--platform`` exactly, while a node with glibc 2.28 installs wheels built for 2.17 as well
    (``manylinux_2_28_x86_64`` -> 2_28, 2_27, ..., 2_17 = manylinux2014, ..., manylinux1)."""
    out: list[str] = []
    for platform in platforms:
        found = MANYLINUX.match(platform)
        tags = [platform]
        if found:
            glibc, arch = int(found.group(1)), found.group(2)
            tags = []
            for minor in range(glibc, 4, -1):
                tags.append(f"manylinux_2_{minor}_{arch}")
                if minor in LEGACY_MANYLINUX:
                    tags.append(f"{LEGACY_MANYLINUX[minor]}_{arch}")
        out += [t for t in tags if t not in out]
    return out


def _pip_platform_args(python_version: str | None, platforms: list[str]) -> list[str]:
    args = ["--only-binary=:all:"]
    if python_version:
        args += ["--python-version", python_version, "--implementation", "cp"]
    for p in expand_platforms(platforms):
        args += ["--platform", p]
    return args


def _fake_installed(site: Path, target: dict[str, str]) -> None:
    """Metadata-only installed distributions of ``target`` in ``site``: pip, run with ``site`` on
    its path, treats them as installed and keeps each one that satisfies what needs it."""
    for name, version in target.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
        )


def _resolver_pip(work: Path) -> list[str]:
    """``python -S -m pip`` of RESOLVER_PIP unpacked in ``work``: it sees no installed package but
    the ones put on its path."""
    home = work / "pip"
    if not (home / "pip").is_dir():
        download = work / "pip-download"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                RESOLVER_PIP,
                "-d",
                download,
            ],
            check=True,
        )
        wheel = next(download.glob("pip-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(home)
    return [sys.executable, "-S", "-m", "pip"]


def _pip(
    work: Path, *args: str, only_index: str | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """RESOLVER_PIP with ``args``, run in ``work`` with the target's installed packages on its path
    (``_fake_installed``); with ``only_index``, looking in that index alone (and in the folder
    ``_torch_staging``); ``kwargs`` go to subprocess.run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{work / 'pip'}{os.pathsep}{work / 'site'}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.pop("PIP_TARGET", None)
    if only_index is not None:
        # pip's environment variables override its configuration files' values of the same names,
        # and an empty one is ignored: these replace every index and folder configured here.
        env["PIP_INDEX_URL"] = env["PIP_EXTRA_INDEX_URL"] = only_index
        env["PIP_FIND_LINKS"] = str(_torch_staging(work))
        env.pop("PIP_NO_INDEX", None)
    return subprocess.run([*_resolver_pip(work), *args], env=env, cwd=work, **kwargs)


def _torch_staging(work: Path) -> Path:
    """The folder the wheels from the torch index wait in until the set is downloaded."""
    folder = work / "torch-index"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


UNSATISFIABLE = re.compile(r"satisfies the requirement ([^\s(]+)")
NO_DISTRIBUTION = re.compile(r"no matching distributions available for your environment:\s+(\S+)")


def unsatisfiable_requirement(stderr: str) -> str | None:
    """The requirement pip found no wheel for (``name==spec`` where pip names the spec), or None
    when its failure is something else."""
    found = UNSATISFIABLE.search(stderr)
    if found:
        return found.group(1)
    found = NO_DISTRIBUTION.search(stderr)
    if not found:
        return None
    name = found.group(1)
    spec = re.search(rf"depends on ({re.escape(name)}[^\s,]*)", stderr)
    return spec.group(1) if spec else name


def resolve(
    plan: Plan,
    out: Path,
    platform_args: list[str],
    work: Path,
    constraints: list[str] | None = None,
) -> list[dict]:
    """pip's install report for ``plan.requirements`` on the target, under ``constraints``
    (``name==version`` lines): the distributions to ship.

    A requirement with no wheel for the target is built from its sdist into ``out`` and the
    resolution repeated, up to MAX_SDIST_BUILDS times."""
    _fake_installed(work / "site", plan.target)
    reqs = work / "requirements.txt"
    lines = list(plan.requirements)
    if constraints:
        (work / "constraints.txt").write_text("\n".join(constraints) + "\n", encoding="utf-8")
        lines.append("-c constraints.txt")
    reqs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    links = ["--find-links", str(out)]
    if plan.torch_index:
        links += ["--find-links", str(_torch_staging(work))]
    built: set[str] = set()
    for _ in range(MAX_SDIST_BUILDS):
        report = work / "report.json"
        report.unlink(missing_ok=True)
        done = _pip(
            work,
            *("install", "--dry-run", "--report", str(report), *links),
            *platform_args,
            *("-r", str(reqs)),
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            return json.loads(report.read_text(encoding="utf-8"))["install"]
        said = done.stdout + done.stderr
        missing = unsatisfiable_requirement(said)
        if not missing:
            errors = [
                line for line in said.splitlines() if not line.startswith("WARNING: Location")
            ]
            raise WheelhouseError("pip could not resolve the set:\n" + "\n".join(errors[-40:]))
        if missing in built:
            raise WheelhouseError(
                f"{missing}: the wheel built from its sdist does not install on the target "
                f"({', '.join(platform_args)})"
            )
        built.add(missing)
        build_from_sdist(missing, out, platform_args, work)
    raise WheelhouseError(f"more than {MAX_SDIST_BUILDS} requirements without a wheel")


def build_from_sdist(spec: str, out: Path, platform_args: list[str], work: Path) -> Path:
    """A wheel of ``spec`` built here from its sdist into ``out``; it must install on the target
    (pure Python, or this machine's platform when that is the target's)."""
    build = work / "built"
    shutil.rmtree(build, ignore_errors=True)
    print(f"building a wheel of {spec} from its sdist (no wheel is published)", flush=True)
    done = _pip(
        work,
        "wheel",
        "--quiet",
        "--no-deps",
        "-w",
        str(build),
        spec,
        capture_output=True,
        text=True,
    )
    wheels = list(build.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise WheelhouseError(
            f"{spec} has no wheel for the target and its sdist did not build here:\n"
            f"{done.stderr.strip()[-2000:]}"
        )
    wheel = wheels[0]
    tags = parse_wheel_filename(wheel.name)[3]
    pure = any(t.abi == "none" and t.platform == "any" for t in tags)
    if not pure and "--platform" in platform_args:
        raise WheelhouseError(
            f"{wheel.name} built from the sdist of {spec} is for this machine's platform, not the "
            f"target's: build it on a machine like the node (same Python and platform) and add it "
            f"to {out}"
        )
    dest = out / wheel.name
    shutil.move(str(wheel), dest)
    return dest


def fetch_torch(plan: Plan, out: Path, platform_args: list[str], work: Path) -> str:
    """Put requirements.txt's torch from ``plan.torch_index`` in ``_torch_staging(work)`` with each
    wheel that torch pins exactly (its CUDA libraries, triton), and pin torch's line of
    ``plan.requirements`` to that build's version (``torch==2.13.0+cu126``): no other source has it,
    so the set's resolution takes it from there and every other package from the usual index. A
    wheel already in ``out`` is not fetched again. A build for another CUDA major than
    ``plan.torch_cuda`` is refused. Returns torch's version."""
    line = next(r for r in plan.requirements if canonicalize_name(Requirement(r).name) == "torch")
    report = work / "torch-report.json"
    done = _pip(
        work,
        *("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)),
        *platform_args,
        line,
        only_index=plan.torch_index,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        said = [
            text
            for text in (done.stdout + done.stderr).splitlines()
            if not text.startswith("WARNING: Location")
        ]
        raise WheelhouseError(
            f"{line}: pip found no build of it for the target in --torch-index "
            f"{plan.torch_index} (PyTorch lists each release's CUDA builds: cu126, cu128, ...):\n"
            + "\n".join(said[-20:])
        )
    installs = json.loads(report.read_text(encoding="utf-8"))["install"]
    torch = next(i for i in installs if canonicalize_name(i["metadata"]["name"]) == "torch")
    version = torch["metadata"]["version"]
    built_for = local_cuda_majors(version)
    if built_for and built_for != {plan.torch_cuda}:
        raise WheelhouseError(
            f"--torch-index {plan.torch_index}: its torch {version} is a CUDA "
            f"{min(built_for)} build, and the set is for CUDA {plan.torch_cuda} "
            f"({plan.torch_why}): name the index of torch's CUDA {plan.torch_cuda} builds"
        )
    pinned = {"torch"}
    for dep in _requires(torch):
        specs = list(dep.specifier)
        if _applies(dep, {""}) and len(specs) == 1 and specs[0].operator == "==":
            pinned.add(canonicalize_name(dep.name))
    fetch = [
        f"{i['metadata']['name']}=={i['metadata']['version']}"
        for i in installs
        if canonicalize_name(i["metadata"]["name"]) in pinned
        and not (out / _file_name(i["download_info"]["url"])).is_file()
    ]
    if fetch:
        print(
            f"downloading torch {version} from {plan.torch_index} ({len(fetch)} wheels)", flush=True
        )
        _pip(
            work,
            *("download", "--quiet", "--no-deps", "-d", str(_torch_staging(work))),
            *platform_args,
            *fetch,
            only_index=plan.torch_index,
            check=True,
        )
    plan.requirements = [f"torch=={version}" if r == line else r for r in plan.requirements]
    return version


def _file_name(url: str) -> str:
    return unquote(urlsplit(url).path).rsplit("/", 1)[-1]


def _applies(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req``'s marker holds here (pip evaluates markers on this machine's Python) for a
    distribution installed with ``extras`` (``""``: none)."""
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)


def _requires(install: dict) -> list[Requirement]:
    out = []
    for text in install["metadata"].get("requires_dist") or []:
        try:
            out.append(Requirement(text))
        except InvalidRequirement:
            continue
    return out


def replaced_packages(installs: list[dict], plan: Plan, target: Freeze) -> list[dict]:
    """Each package of the node's freeze that installing ``installs`` replaces, in their order:
    ``{"name", "node", "shipped", "why"}``, ``node`` None where the freeze says no version.
    ``why`` names every requirement that excludes the node's version (every one that asks for the
    package, where that version is unknown): a pin of the project (``plan.asks``) or a package of
    the set (``wandb 0.31.0 asks for protobuf<8,>=5``), each marker evaluated as pip does, with the
    extras the set asks of its package. An empty ``why``: no requirement excludes the node's
    version. The build backend's entry (``build_backend``) replaces nothing: pip takes it only for
    ``pip install -e .``'s isolated build."""
    shipped = [i for i in installs if not i.get("build_backend")]
    top = [Requirement(line) for line in plan.requirements]
    requires = {id(i): _requires(i) for i in shipped}
    # The extras the set asks of each package: pip's report names them for the requirements only.
    extras: dict[str, set[str]] = {canonicalize_name(r.name): set(r.extras) for r in top}
    changed = True
    while changed:
        changed = False
        for install in shipped:
            own = extras.get(canonicalize_name(install["metadata"]["name"]), set()) | {""}
            for dep in requires[id(install)]:
                asked = extras.setdefault(canonicalize_name(dep.name), set())
                if dep.extras - asked and _applies(dep, own):
                    asked |= dep.extras
                    changed = True
    asking = [
        (plan.asks.get(canonicalize_name(r.name), f"the project's {r}"), r)
        for r in top
        if _applies(r, {""})
    ]
    for install in shipped:
        meta = install["metadata"]
        own = extras.get(canonicalize_name(meta["name"]), set()) | {""}
        asking += [
            (f"{meta['name']} {meta['version']} asks for {dep.name}{dep.specifier}", dep)
            for dep in requires[id(install)]
            if _applies(dep, own)
        ]
    replaced = []
    for install in shipped:
        name = canonicalize_name(install["metadata"]["name"])
        if not target.has(name):
            continue
        have = target.versions.get(name)
        why = [
            who
            for who, req in asking
            if canonicalize_name(req.name) == name
            and (have is None or not installed_satisfies(have, req.specifier))
        ]
        replaced.append(
            {
                "name": name,
                "node": have,
                "shipped": install["metadata"]["version"],
                "why": list(dict.fromkeys(why)),
            }
        )
    return replaced


def resolve_keeping_node_versions(
    plan: Plan, target: Freeze, out: Path, platform_args: list[str], work: Path
) -> tuple[list[dict], list[dict]]:
    """``resolve``'s set and what installing it replaces (``replaced_packages``), keeping every
    version of the node that all the set's requirements accept. pip prefers an installed version
    that fits; one it replaced all the same is pinned to the node's version (a constraint) and the
    set resolved again: it then holds no such replacement."""
    installs = resolve(plan, out, platform_args, work)
    replaced = replaced_packages(installs, plan, target)
    needless = [f"{r['name']}=={r['node']}" for r in replaced if r["node"] and not r["why"]]
    if needless:
        print(f"resolving again with the node's {', '.join(needless)}: nothing asks for another")
        installs = resolve(plan, out, platform_args, work, constraints=needless)
        replaced = replaced_packages(installs, plan, target)
    return installs, replaced


def print_replaced(replaced: list[dict]) -> None:
    """The node's packages the install replaces, each with its versions and who asks for it."""
    if not replaced:
        print("the install replaces none of the node's packages", flush=True)
        return
    print(f"the install replaces {len(replaced)} of the node's packages (node -> shipped: why):")
    for item in replaced:
        change = f"{item['node'] or '(no version in the freeze)'} -> {item['shipped']}"
        why = "; ".join(item["why"]) or "no requirement of the set excludes the node's version"
        print(f"  {item['name']:<24} {change:<26} {why}")
    print(flush=True)


def build_backend(installs: list[dict], platform_args: list[str], work: Path) -> list[dict]:
    """The report entry of BUILD_BACKEND when the set lacks it: ``pip install -e .`` builds the
    project in an isolated environment, which ``--no-index`` fills from the wheelhouse alone,
    whatever setuptools the node has installed."""
    if any(canonicalize_name(i["metadata"]["name"]) == "setuptools" for i in installs):
        return []
    report = work / "backend.json"
    _pip(
        work,
        *("install", "--dry-run", "--quiet", "--ignore-installed", "--no-deps"),
        *("--report", str(report), *platform_args, BUILD_BACKEND),
        check=True,
        capture_output=True,
    )
    entries = json.loads(report.read_text(encoding="utf-8"))["install"]
    return [{**entry, "build_backend": True} for entry in entries]


def download(installs: list[dict], out: Path, platform_args: list[str], work: Path) -> None:
    """Every wheel of ``installs`` not already in ``out``, fetched by pip (its cache first)."""
    have = {parse_wheel_filename(w.name)[:2] for w in out.glob("*.whl")}
    wanted = [
        f"{i['metadata']['name']}=={i['metadata']['version']}"
        for i in installs
        if (canonicalize_name(i["metadata"]["name"]), Version(i["metadata"]["version"])) not in have
    ]
    if not wanted:
        return
    print(f"downloading {len(wanted)} wheels into {out}", flush=True)
    _pip(
        work,
        *("download", "--quiet", "--no-deps", "--find-links", str(out), "-d", str(out)),
        *platform_args,
        *wanted,
        check=True,
    )


def build_wheelhouse(
    out: Path,
    *,
    python_version: str | None = None,
    platforms: list[str] | None = None,
    target_freeze: Path | None = None,
    training_only: bool = False,
    nvvm_from_cuda_home: bool = False,
    cuda: int | None = None,
    replace_torch: bool = False,
    torch_index: str | None = None,
    requirement_files: list[Path] | None = None,
) -> dict:
    """Build the wheelhouse in ``out`` (module docstring); returns what wheelhouse.json holds.
    What the install replaces is printed before any wheel is downloaded."""
    platforms = platforms or []
    files = requirement_files or [REPO / f for f in REQUIREMENT_FILES]
    target = read_freeze(target_freeze) if target_freeze else Freeze()
    for warning in target.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    plan = plan_requirements(
        read_requirements(files),
        target,
        training_only,
        cuda=cuda,
        replace_torch=replace_torch,
        torch_index=torch_index,
    )
    platform_args = _pip_platform_args(python_version, platforms)
    out = out.resolve()  # pip runs in a scratch folder
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        work = Path(tmp)
        if plan.torch_index:
            fetch_torch(plan, out, platform_args, work)
        installs, replaced = resolve_keeping_node_versions(plan, target, out, platform_args, work)
        check_node_torch_kept(installs, plan)
        if nvvm_from_cuda_home:
            installs = drop_nvvm(installs, plan)
            kept = {canonicalize_name(i["metadata"]["name"]) for i in installs}
            replaced = [item for item in replaced if item["name"] in kept]
        if target_freeze:
            print_replaced(replaced)
        installs += build_backend(installs, platform_args, work)
        for wheel in _torch_staging(work).glob("*.whl"):
            shutil.move(str(wheel), out / wheel.name)
        download(installs, out, platform_args, work)
    keep = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    backend = {canonicalize_name(i["metadata"]["name"]) for i in installs if i.get("build_backend")}
    if "setuptools" not in {item["name"] for item in replaced}:
        # setuptools is there for `pip install -e .`'s build; pinned where the node's own fits, it
        # would conflict with what the node's packages (its torch) ask of setuptools, and a node
        # without one takes it from the folder as a dependency of whatever asks for it.
        backend.add("setuptools")
    wheels = {}
    for wheel in sorted(out.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if keep.get(canonicalize_name(name)) == str(version):
            wheels[wheel.name] = wheel.stat().st_size
        else:
            wheel.unlink()  # a wheel of an earlier build that this set does not hold
    pins = {name: version for name, version in keep.items() if name not in backend}
    if plan.node_torch is not None:
        # The node's own torch, pinned as it is: a pip on the node that would take another torch
        # for any line here refuses the set instead of replacing the node's build.
        pins["torch"] = plan.node_torch
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())]
    (out / "requirements.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = {
        "python_version": python_version or sysconfig.get_python_version(),
        "platforms": platforms or ["this machine's"],
        "target_freeze": str(target_freeze) if target_freeze else None,
        "training_only": training_only,
        "nvvm_from_cuda_home": nvvm_from_cuda_home,
        "cuda": plan.cuda,
        "node_torch": plan.node_torch,
        "replace_torch": replace_torch,
        "torch": shipped_torch(plan, keep),
        "freeze_warnings": target.warnings,
        "left_out": [{"name": n, "why": w} for n, w in plan.left_out],
        "replaced": replaced,
        "wheels": wheels,
        "total_bytes": sum(wheels.values()),
    }
    (out / "wheelhouse.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def shipped_torch(plan: Plan, keep: dict[str, str]) -> dict | None:
    """The torch the set ships (wheelhouse.json's ``torch``): its version, the index it comes from
    (None: the usual one) and why it is built for its CUDA; None where the node's torch stays."""
    if "torch" not in keep or plan.torch_cuda is None:
        return None
    return {"version": keep["torch"], "index": plan.torch_index, "why": plan.torch_why}


def print_summary(summary: dict, out: Path) -> None:
    if summary["cuda"]:
        print(f"\nCUDA: {summary['cuda']}")
    if summary["node_torch"]:
        print(f"the node's torch {summary['node_torch']} stays (pinned in requirements.txt)")
    torch = summary["torch"]
    if torch:
        print(f"torch {torch['version']} from {torch['index'] or 'the registry'}: {torch['why']}")
    if summary["target_freeze"]:
        print(f"the install replaces {len(summary['replaced'])} of the node's packages (above)")
    print(f"\nleft out ({len(summary['left_out'])}):")
    for item in summary["left_out"]:
        print(f"  {item['name']:<24} {item['why']}")
    wheels = summary["wheels"]
    largest = sorted(wheels.items(), key=lambda kv: -kv[1])[:5]
    print(f"\n{len(wheels)} wheels, {summary['total_bytes'] / 2**20:.1f} MiB in {out}; largest:")
    for name, size in largest:
        print(f"  {size / 2**20:6.1f} MiB  {name}")
    print(
        f"\non the node (python -m pip: the pip of the Python that trains):\n"
        f"  python -m pip install --no-index --find-links {out} -r {out}/requirements.txt\n"
        f"  python -m pip install --no-index --find-links {out} --no-deps -e .   # in the checkout"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("wheelhouse"), help="the wheelhouse directory"
    )
    parser.add_argument(
        "--python-version", help="the node's Python, e.g. 3.12 (default: this interpreter's)"
    )
    parser.add_argument(
        "--platform",
        action="append",
        default=[],
        help="a platform tag of the node, e.g. manylinux_2_28_x86_64 for glibc 2.28 (`ldd --version` "
        "on the node); every older manylinux level is added (repeatable)",
    )
    parser.add_argument(
        "--target-freeze", type=Path, help="the node's `pip freeze`: what it has stays out"
    )
    parser.add_argument(
        "--training-only",
        action="store_true",
        help="leave out what only the offline steps import (polars, matplotlib)",
    )
    parser.add_argument(
        "--nvvm-from-cuda-home",
        action="store_true",
        help="leave out libNVVM's wheel: the node's CUDA toolkit (CUDA_HOME) provides libNVVM",
    )
    parser.add_argument(
        "--cuda",
        type=cuda_major,
        help="the CUDA version the node's torch is built for (12, 13, or as torch.version.cuda "
        "prints it: 12.8), where the freeze does not say (NVIDIA's PyTorch containers): "
        "numba-cuda takes its extra for it; with --replace-torch, the CUDA the shipped torch is "
        "built for (one the node's driver runs: `nvidia-smi` prints its CUDA version)",
    )
    parser.add_argument(
        "--replace-torch",
        action="store_true",
        help="ship requirements.txt's torch in place of the node's own, built for the CUDA of the "
        "node's torch or --cuda; without it the node's torch is never replaced",
    )
    parser.add_argument(
        "--torch-index",
        metavar="URL",
        help="the package index a torch the set ships comes from, with the CUDA libraries it pins "
        "(e.g. https://download.pytorch.org/whl/cu128); default: for CUDA 12, "
        f"{TORCH_INDEXES[12]}; for CUDA {REGISTRY_TORCH_CUDA}, the usual index's own build",
    )
    args = parser.parse_args(argv)
    if args.platform and not args.python_version:
        args.python_version = sysconfig.get_python_version()
    try:
        summary = build_wheelhouse(
            args.out,
            python_version=args.python_version,
            platforms=args.platform,
            target_freeze=args.target_freeze,
            training_only=args.training_only,
            nvvm_from_cuda_home=args.nvvm_from_cuda_home,
            cuda=args.cuda,
            replace_torch=args.replace_torch,
            torch_index=args.torch_index,
        )
    except (WheelhouseError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(
            f"error: {' '.join(map(str, exc.cmd[:6]))} ... failed (exit {exc.returncode})",
            file=sys.stderr,
        )
        return 1
    print_summary(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
