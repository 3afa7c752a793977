"""Write every wheel a GPU node without internet needs to train with this project, on a connected machine.

Usage (on a machine that reaches the package index; the project's .venv is enough to run it):
    python scripts/build_wheelhouse.py --out wheelhouse                 # for this machine's Python
    python -m pip freeze > node_freeze.txt                               # on the GPU node
    python scripts/build_wheelhouse.py --out wheelhouse --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --target-freeze node_freeze.txt --training-only
    # an NVIDIA PyTorch container: its torch's version does not say its CUDA; state it
    python scripts/build_wheelhouse.py ... --target-freeze node_freeze.txt --cuda 12

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
too, so the project itself installs with ``--no-index``.

What stays out, each printed with its reason:
- the test and lint tools (pytest, hypothesis, ruff);
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

The node's torch is never replaced: one outside ACCEPTS, one whose version the freeze does not
say, or one a requirement of the set excludes is refused in one line, unless ``--replace-torch``
asks to ship requirements.txt's torch in its place. numba-cuda (NeMo's CUDA TDT loss) takes the
CUDA extra (``cu12``, ``cu13``) of the torch the node trains with: from its local version tag
(``+cu126``), else from the CUDA runtime wheel a registry build brings, else from ``--cuda``; where
none says (NVIDIA's containers: ``2.12.0a0+6a5c3a1d2e.nv26.01``) the build is refused in one line.

It prints the set's size and writes, beside the wheels, ``requirements.txt`` (one ``name==version``
per wheel, and the node's own torch at its version: the install line above) and ``wheelhouse.json``
(the target, the CUDA extra and why, what was left out and why, each wheel's size). Run again into
the same folder, it keeps the wheels the new set holds and removes the other wheels there.
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
DEV_ONLY = {"pytest": "the test runner", "hypothesis": "the tests' data", "ruff": "the linter"}
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
        ">=2.11",
        "the project uses no torch API newer than 2.11; the node's CUDA build stays",
    ),
    "numpy": (">=2.0,<3", "numpy 2; tdt_loss restores the np.row_stack numba-cuda 0.30.4 needs"),
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
    filename = unquote(urlsplit(url).path).rsplit("/", 1)[-1]
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
    ``replace_torch``) takes the registry's build's. (None, why) for a CPU build of torch."""
    have = freeze.versions.get("torch")
    if have is None or replace_torch:
        if cuda is not None and cuda != REGISTRY_TORCH_CUDA:
            raise WheelhouseError(
                f"--cuda {cuda}: this set ships requirements.txt's torch, the registry's CUDA "
                f"{REGISTRY_TORCH_CUDA} build; for the node's own CUDA {cuda} torch give its "
                f"freeze (--target-freeze) without --replace-torch"
            )
        return REGISTRY_TORCH_CUDA, (
            f"the set ships requirements.txt's torch, a CUDA {REGISTRY_TORCH_CUDA} build"
        )
    where = freeze.line("torch")
    local = (Version(have).local or "").split(".")
    tags = [TORCH_CUDA_TAG.match(part) for part in local]
    tagged = {int(tag.group(1)) for tag in tags if tag}
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


def plan_requirements(
    requirements: list[Requirement],
    target: Freeze,
    training_only: bool,
    *,
    cuda: int | None = None,
    replace_torch: bool = False,
) -> Plan:
    """Which requirements pip resolves for the node, and which stay out (``DEV_ONLY``, with
    ``training_only`` ``OFFLINE_ONLY``, a target version inside ``ACCEPTS``, pre-releases and local
    versions included). The node's torch is never replaced unless ``replace_torch``: one the
    project does not accept, or whose version the freeze does not say, is refused in one line.
    numba-cuda takes the CUDA extra of the torch the node trains with (``choose_cuda``)."""
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
        if name == "torch" and target.has(name):
            if replace_torch:
                plan.requirements.append(str(req))
                continue
            if have is None:
                raise WheelhouseError(
                    f"{target.line(name)}: the node's torch has no version in its freeze line: "
                    f"give the output of `python -m pip list --format=freeze` on the node (it "
                    f"prints every version), or --replace-torch to ship {req} in its place"
                )
            plan.node_torch = have
        if have is not None and name in ACCEPTS and not installed_satisfies(have, req.specifier):
            spec, why = ACCEPTS[name]
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
        if have is not None and installed_satisfies(have, req.specifier):
            plan.left_out.append((req.name, f"the target has {have}, as pinned"))
    return plan


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


def _pip(work: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """RESOLVER_PIP with ``args``, run in ``work`` with the target's installed packages on its path
    (``_fake_installed``); ``kwargs`` go to subprocess.run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{work / 'pip'}{os.pathsep}{work / 'site'}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.pop("PIP_TARGET", None)
    return subprocess.run([*_resolver_pip(work), *args], env=env, cwd=work, **kwargs)


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


def resolve(plan: Plan, out: Path, platform_args: list[str], work: Path) -> list[dict]:
    """pip's install report for ``plan.requirements`` on the target: the distributions to ship.

    A requirement with no wheel for the target is built from its sdist into ``out`` and the
    resolution repeated, up to MAX_SDIST_BUILDS times."""
    _fake_installed(work / "site", plan.target)
    reqs = work / "requirements.txt"
    reqs.write_text("\n".join(plan.requirements) + "\n", encoding="utf-8")
    built: set[str] = set()
    for _ in range(MAX_SDIST_BUILDS):
        report = work / "report.json"
        report.unlink(missing_ok=True)
        done = _pip(
            work,
            *("install", "--dry-run", "--report", str(report), "--find-links", str(out)),
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
    requirement_files: list[Path] | None = None,
) -> dict:
    """Build the wheelhouse in ``out`` (module docstring); returns what wheelhouse.json holds."""
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
    )
    platform_args = _pip_platform_args(python_version, platforms)
    out = out.resolve()  # pip runs in a scratch folder
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        work = Path(tmp)
        installs = resolve(plan, out, platform_args, work)
        check_node_torch_kept(installs, plan)
        if nvvm_from_cuda_home:
            installs = drop_nvvm(installs, plan)
        installs += build_backend(installs, platform_args, work)
        download(installs, out, platform_args, work)
    keep = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    backend = {canonicalize_name(i["metadata"]["name"]) for i in installs if i.get("build_backend")}
    wheels = {}
    for wheel in sorted(out.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if keep.get(canonicalize_name(name)) == str(version):
            wheels[wheel.name] = wheel.stat().st_size
        else:
            wheel.unlink()  # a wheel of an earlier build that this set does not hold
    # The build backend's wheel serves `pip install -e .`'s isolated build only: pinned in the
    # install line it could conflict with what the node's own packages ask of setuptools.
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
        "freeze_warnings": target.warnings,
        "left_out": [{"name": n, "why": w} for n, w in plan.left_out],
        "wheels": wheels,
        "total_bytes": sum(wheels.values()),
    }
    (out / "wheelhouse.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def print_summary(summary: dict, out: Path) -> None:
    if summary["cuda"]:
        print(f"\nCUDA: {summary['cuda']}")
    if summary["node_torch"]:
        print(f"the node's torch {summary['node_torch']} stays (pinned in requirements.txt)")
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
        "numba-cuda takes its extra for it",
    )
    parser.add_argument(
        "--replace-torch",
        action="store_true",
        help="ship requirements.txt's torch (the registry's CUDA 13 build) in place of the "
        "node's own; without it the node's torch is never replaced",
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
