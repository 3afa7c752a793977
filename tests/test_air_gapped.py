"""docs/air_gapped.md as written: every bash block of the runbook, in order, on CPU.

The runbook names no stand-in; this test uses these, and only these:
- the connected machine is this checkout with its .venv; the cluster node is a fresh venv holding
  only what a GPU image brings (torch, numpy, sentencepiece), which installs the wheelhouse the
  runbook builds with ``--no-index`` and no pip configuration (no index, no find-links);
- ``hf download`` is a shell function that writes a tiny TDT model (configs/tiny_tdt.yaml, an English
  tokenizer) under the file name the hub has; the copy of $TRANSFER to the cluster is a copy;
- the audio already on the cluster is a small demo corpus in tones;
- ``SUBSTITUTIONS`` swap the GPU sizes for CPU ones (one process, the acceptance run's CPU mode on
  its environment and data stages, a short data check, the node's Python version and machine),
  and the paths for temporary ones; CPU training knobs come from the environment, which the
  runbook's job.env does not set.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import config

REPO = Path(__file__).resolve().parents[1]
RUNBOOK = REPO / "docs" / "air_gapped.md"
BASE_FILE = "parakeet-tdt-0.6b-v2.nemo"
IMAGE_PACKAGES = ("torch==2.13.0", "numpy==2.4.6", "sentencepiece==0.2.2")


def runbook_blocks() -> list[tuple[str, str]]:
    """(where, text) of each ```bash block of the runbook, in order; ``where`` is "connected" or
    "node", from the block's first line (``# on the connected machine ...`` or ``# on ... node``)."""
    text = RUNBOOK.read_text(encoding="utf-8")
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```$", text, flags=re.S | re.M):
        first = body.splitlines()[0]
        assert first.startswith("# on "), f"a runbook block must say where it runs: {first!r}"
        blocks.append(("connected" if "connected machine" in first else "node", body))
    return blocks


def substitutions(paths: dict[str, Path]) -> list[tuple[str, str]]:
    """(text in the runbook, what the CPU run uses instead), applied in order to every block."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return [
        ("export TRANSFER=/data/transfer/parakeet", f"export TRANSFER={paths['transfer']}"),
        ("/shared/transfer/parakeet", str(paths["arrived"])),
        ("/shared/parakeet", str(paths["shared"])),
        ("--python-version 3.12", f"--python-version {version}"),
        ("manylinux_2_28_x86_64", f"manylinux_2_28_{platform.machine()}"),
        ('prepare --data "$TRANSFER/acceptance"', 'prepare --data "$TRANSFER/acceptance" --sizes hi=30,en=30'),
        ("gpu_acceptance.py run --data", "gpu_acceptance.py run --cpu --only environment,data --data"),
        ("--nproc_per_node 8", "--nproc_per_node 1"),
        ("scripts/preflight.py", "scripts/preflight.py --data-seconds 5"),
    ]  # fmt: skip


def substituted(blocks: list[tuple[str, str]], paths: dict[str, Path]) -> list[tuple[str, str]]:
    """``blocks`` with ``substitutions`` made; each one must be found, or the runbook changed
    under this test."""
    out = [text for _, text in blocks]
    for old, new in substitutions(paths):
        assert any(old in text for text in out), f"the runbook no longer holds {old!r}"
        out = [text.replace(old, new) for text in out]
    return [(where, text) for (where, _), text in zip(blocks, out)]


def test_every_block_says_where_it_runs_and_names_the_base_by_its_path():
    blocks = runbook_blocks()
    assert [where for where, _ in blocks] == ["node", "connected"] + ["node"] * 5
    connected = blocks[1][1]
    assert f"hf download nvidia/parakeet-tdt-0.6b-v2 {BASE_FILE}" in connected
    assert f"sha256sum {BASE_FILE} >" in connected
    node = "\n".join(text for where, text in blocks if where == "node")
    assert f"sha256sum --check {BASE_FILE}.sha256" in node
    assert f"INIT_MODEL=$SHARED/models/{BASE_FILE}" in node and "INIT_MODEL=nvidia" not in node
    assert "--no-index" in node and "pip install" not in connected  # nothing fetched on the node
    # the gate comes before the job: acceptance run, then preflight, then train.py
    order = [node.index(s) for s in ("gpu_acceptance.py run", "preflight.py", "train.py")]
    assert order == sorted(order)
    paths = {name: Path(f"/tmp/{name}") for name in ("transfer", "arrived", "shared")}
    substituted(blocks, paths)  # every stand-in still has its place in the runbook


def _bash(script: str, cwd: Path, env: dict[str, str], log: Path, timeout: float = 1200):
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n$ cd {cwd}\n{script}\n")
        f.flush()
        done = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + script],
            cwd=cwd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    return done.returncode


def _tail(log: Path, n: int = 6000) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-n:]


def _stand_in_base(root: Path) -> Path:
    """A tiny TDT model with an English tokenizer, saved under the hub's file name."""
    import torch

    import asr_model
    from tests.tiny_training_data import make_training_data

    data = make_training_data(root / "base", per_lang=12, langs=("en",), vocab_size=48)
    torch.manual_seed(0)
    model = asr_model.build_model("", REPO / "configs" / "tiny_tdt.yaml", data["tokenizer"])
    path = root / BASE_FILE
    model.save_to(str(path))
    return path


def _environments(node_venv: Path) -> tuple[dict, dict]:
    """(the connected machine's environment, the node's): the caller's knobs and W&B settings left
    out; the node sees only its own venv, no pip configuration (file or PIP_* variables), and the
    CPU sizes of a tiny job."""
    leave_out = set(config.KNOBS) | {"PYTHONPATH", "VIRTUAL_ENV"}
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in leave_out and not k.startswith(("WANDB", "PROBE", "RESUME"))
    }
    base["OMP_NUM_THREADS"] = "1"
    connected = dict(base)
    path = [p for p in base.get("PATH", "").split(os.pathsep) if Path(p) != REPO / ".venv" / "bin"]
    path = [p for p in path if Path(p).resolve() != Path(sys.executable).parent.resolve()]
    node = {k: v for k, v in base.items() if not k.startswith("PIP_")}
    node.update(
        PATH=os.pathsep.join([str(node_venv / "bin"), *path]),
        PIP_CONFIG_FILE=os.devnull,
        ACCELERATOR="cpu",
        PRECISION="32-true",
        NUM_WORKERS="1",
        MAX_STEPS="4",
        UNFREEZE_STEP="2",
        WARMUP_STEPS="1",
        PHASE2_WARMUP="1",
        GRAD_ACCUM="1",
        CHECKPOINT_EVERY="2",
        VOCAB_SIZE="120",
        VAL_PER_LANG="6",
        # A tone per character is denser than the tiny base's pieces: every validation row holds
        # more tokens than encoder frames, so there is nothing to validate on and the job says so
        # and stops. The runbook's job runs without validation, as one without a val manifest.
        EVAL_EVERY_STEPS="0",
        MIN_DURATION="0.5",
        MAX_DURATION="12",
        BUCKET_BOUNDARIES="2,3,4,6",
        MAX_BATCH_DURATION="20",
        WANDB_MODE="disabled",
        WATCHDOG_SECONDS="120",
    )
    return connected, node


@pytest.mark.slow
def test_the_runbook_runs_from_the_connected_machine_to_a_trained_job_on_a_node_without_an_index(
    tmp_path,
):
    log = tmp_path / "runbook.log"
    paths = {
        "transfer": tmp_path / "connected" / "transfer",
        "arrived": tmp_path / "cluster" / "transfer",
        "shared": tmp_path / "cluster" / "parakeet",
    }
    paths["transfer"].mkdir(parents=True)
    node_home = tmp_path / "node-home"
    node_home.mkdir()
    # The node as an image makes it: torch, numpy and sentencepiece, nothing of this project.
    node_venv = tmp_path / "node-venv"
    subprocess.run([sys.executable, "-m", "venv", str(node_venv)], check=True)
    image = subprocess.run(
        [str(node_venv / "bin" / "python"), "-m", "pip", "install", "-q", *IMAGE_PACKAGES],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert image.returncode == 0, image.stderr[-3000:]
    connected_env, node_env = _environments(node_venv)
    standin = _stand_in_base(tmp_path / "hub")
    hub = (
        "hf() {  # the hub, for this test: the one file the runbook asks for\n"
        f'  [[ "$1 $2 $3 $4" == "download nvidia/parakeet-tdt-0.6b-v2 {BASE_FILE} --local-dir" ]]\n'
        f'  mkdir -p "$5" && cp {standin} "$5/$3"\n'
        "}\n"
    )
    # The audio already on the cluster's file system.
    shards = paths["shared"] / "data" / "shards"
    corpus = subprocess.run(
        [sys.executable, "scripts/make_demo_corpus.py", "--engine", "tones", "--no-install",
         "--out", str(shards), "--sizes", "en=30,hi=30"],
        cwd=REPO, env=connected_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert corpus.returncode == 0, corpus.stderr[-3000:]

    blocks = substituted(runbook_blocks(), paths)
    for number, (where, script) in enumerate(blocks, 1):
        if where == "connected":
            code = _bash(hub + script, REPO, connected_env, log)
            # step 3 of the runbook: $TRANSFER onto the cluster's file system
            shutil.copytree(paths["transfer"], paths["arrived"])
        else:
            code = _bash(script, node_home, node_env, log)
        assert code == 0, f"runbook block {number} ({where}) exited {code}:\n{_tail(log)}"
        if number == 1:  # step 1: node_freeze.txt goes to the connected machine, into $TRANSFER
            shutil.copy(node_home / "node_freeze.txt", paths["transfer"] / "node_freeze.txt")

    shared = paths["shared"]
    # the node's pip looked in the wheelhouse alone
    links = [
        line for line in _tail(log, 10**9).splitlines() if line.startswith("Looking in links:")
    ]
    assert links and all(
        line == f"Looking in links: {paths['arrived']}/wheelhouse" for line in links
    )
    # the node's torch is the image's, its older sentencepiece (one the project accepts) is kept,
    # and the project's packages came from the wheelhouse
    versions = subprocess.run(
        [str(node_venv / "bin" / "python"), "-c",
         "import importlib.metadata as m; print(m.version('torch'), m.version('sentencepiece'), "
         "m.version('nemo_toolkit'), m.version('polars'))"],
        capture_output=True, text=True, env=node_env,
    )  # fmt: skip
    assert versions.stdout.split()[:2] == ["2.13.0+cpu", "0.2.2"], versions.stderr[-2000:]
    # ... which lacks a field the tokenizer's fingerprint clears: a warning, and the job trained on
    assert "has no TrainerSpec.seed_sentencepieces_file" in _tail(log, 10**9)
    job_env = (shared / "job.env").read_text()
    assert f"INIT_MODEL={shared}/models/{BASE_FILE}" in job_env
    acceptance = json.loads((shared / "acceptance-results" / "acceptance.json").read_text())
    verdicts = {s["name"]: s["verdict"] for s in acceptance["stages"]}
    assert verdicts["environment"] == "ok" and verdicts["data"] == "ok", acceptance
    checkpoints = shared / "data" / "checkpoints"
    card = (checkpoints / "step_00000004.model-card.md").read_text()
    assert f"{shared}/models/{BASE_FILE}" in card  # the base by its path on the cluster

    # A model that arrives damaged stops the cluster's install block before anything is unpacked.
    damaged = paths["arrived"] / "models" / BASE_FILE
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    fresh = dict(paths, shared=tmp_path / "cluster" / "again")
    install = substituted(runbook_blocks(), fresh)[2][1]
    assert "sha256sum --check --quiet SHA256SUMS" in install
    code = _bash(install, node_home, node_env, tmp_path / "damaged.log")
    assert code != 0
    assert f"{BASE_FILE}: FAILED" in (tmp_path / "damaged.log").read_text()
    assert not (fresh["shared"] / "parakeet").exists()
