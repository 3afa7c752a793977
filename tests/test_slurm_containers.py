"""scripts/slurm_train.sh in a site's container image: pyxis/enroot (srun --container-image) and
Apptainer/Singularity (apptainer exec), with the image's Python and the packages pip --target put
beside the read-only image on PYTHONPATH, the job's directories mounted at their own paths, and
JOB_ENV's values winning over the image's own.

The runtimes are stand-ins on PATH that record their arguments and run the inner command on this
machine: the image is a directory whose bin/ holds its python3, which marks the processes it starts
(PROBE_PYTHON), and entering it sets PROBE_SETTING as an image's ENV would. Each job runs the real
scripts/launch.py with one rank of a probe script that writes down what it was started with.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import config
from tests.torchrun_jobs import free_port

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "scripts" / "slurm_train.sh"
PROBE = textwrap.dedent("""
    import json, os, sys
    try:
        import probe_package  # from CONTAINER_PACKAGES
    except ImportError:
        probe_package = None
    seen = {k: os.environ.get(k) for k in ("PYTHONPATH", "PROBE_SETTING", "PROBE_PYTHON", "DATA_DIR")}
    seen.update(package=getattr(probe_package, "__file__", None), argv=sys.argv[1:])
    with open(os.path.join(os.environ["PROBE_OUT"], "rank0.json"), "w") as f:
        json.dump(seen, f)
""")
# srun, with the pyxis plugin when its --help lists --container-image: once per node, with that
# node's SLURM variables, in the image when --container-image names one.
PYXIS_SRUN = """#!/usr/bin/env bash
if [[ $1 == --help ]]; then echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"; exit 0; fi
printf '%s\\n' "$@" > "$PROBE_OUT/srun.argv"
nodes=1; exports=""; image=""
while [[ $1 == --* ]]; do
    case $1 in
        --nodes=*) nodes=${1#--nodes=};; --export=*) exports=${1#--export=};;
        --container-image=*) image=${1#*=};;
    esac
    shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
    (IFS=,; for kv in $exports; do [[ $kv == ALL ]] || export "$kv"; done
     [[ -z $image ]] || export PATH="$image/bin:$PATH" PROBE_SETTING=from-the-image
     SLURM_NODEID=$i SLURM_PROCID=$i SLURM_STEP_ID=0 exec "$@") &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
PLAIN_SRUN = PYXIS_SRUN.replace(
    'echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"', "echo 'Usage: srun'"
)
# apptainer (or singularity) exec [--nv] [--bind MOUNTS] IMAGE COMMAND...
APPTAINER = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$PROBE_OUT/$(basename "$0").argv"
[[ $1 == exec ]] || exit 2
shift
while [[ $1 == --* ]]; do [[ $1 == --bind ]] && shift; shift; done
export PATH="$1/bin:$PATH" PROBE_SETTING=from-the-image
shift
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && echo 127.0.0.1
"""


@pytest.fixture
def site(tmp_path):
    """A site: stand-in srun (with pyxis), apptainer and scontrol on PATH, an image whose python3 is
    this Python, packages installed beside it, a job.env, and an environment with no SLURM variables
    (CI may itself run under SLURM)."""
    bin_dir, image, packages, out = (tmp_path / d for d in ("bin", "nemo.sif", "site", "out"))
    for d in (bin_dir, image / "bin", packages, out, tmp_path / "data", tmp_path / "models"):
        d.mkdir(parents=True)
    for name, text in (("srun", PYXIS_SRUN), ("apptainer", APPTAINER), ("scontrol", SCONTROL)):
        write_executable(bin_dir / name, text)
    write_executable(
        image / "bin" / "python3",
        f'#!/usr/bin/env bash\necho "$*" >> "$PROBE_OUT/image_python.log"\n'
        f'export PROBE_PYTHON=the-image\nexec {sys.executable} "$@"\n',
    )
    (packages / "probe_package.py").write_text("")
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "job.env").write_text("export PROBE_SETTING=from-job-env\n")
    ours = ("SLURM_", "_SLURM_TRAIN", "RESUME_FROM", "CONTAINER_", "JOB_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env = {k: v for k, v in env.items() if k not in ("PY", "PYTHONPATH", "MASTER_ADDR", "NNODES")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        DATA_DIR=str(tmp_path / "data"),
        TRAIN_SCRIPT=str(tmp_path / "probe.py"),
        PROBE_OUT=str(out),
        MASTER_PORT=str(free_port()),
        NPROC_PER_NODE="1",
        OMP_NUM_THREADS="1",
        SHARED_DIR_TIMEOUT="0",
        WANDB_MODE="disabled",
    )
    return env


def write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def under_sbatch(env: dict, **extra: str) -> dict:
    """The batch step of a one-node job."""
    return {
        **env,
        "SLURM_JOB_ID": "4244",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_SUBMIT_DIR": str(REPO),
        **extra,
    }


def container(env: dict, runtime: str, **extra: str) -> dict:
    tmp = Path(env["PROBE_OUT"]).parent
    return {
        **env,
        "CONTAINER_RUNTIME": runtime,
        "CONTAINER_IMAGE": str(tmp / "nemo.sif"),
        "CONTAINER_PACKAGES": str(tmp / "site"),
        "JOB_ENV": str(tmp / "job.env"),
        **extra,
    }


def run(env: dict, *args: str, timeout: float = 60) -> tuple[int, str]:
    proc = subprocess.run(
        ["bash", str(LAUNCHER), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout


def recorded(env: dict, name: str) -> list[str] | None:
    path = Path(env["PROBE_OUT"]) / name
    return path.read_text().splitlines() if path.exists() else None


def rank_saw(env: dict) -> dict:
    return json.loads((Path(env["PROBE_OUT"]) / "rank0.json").read_text())


def test_pyxis_starts_every_node_in_the_image_with_the_jobs_directories_mounted(site, tmp_path):
    extra = tmp_path / "models"
    env = under_sbatch(
        container(
            site,
            "pyxis",
            CHECKPOINT_DIR=str(tmp_path / "ckpt"),
            CONTAINER_MOUNTS=f"{extra}:/opt/models:ro",
        )
    )
    rc, out = run(env, "--flag", "value")
    assert rc == 0, out
    image, data, ckpt, packages, job_env = (
        tmp_path / p for p in ("nemo.sif", "data", "ckpt", "site", "job.env")
    )
    assert recorded(env, "srun.argv") == [
        "--ntasks-per-node=1",
        "--nodes=1",
        "--kill-on-bad-exit=1",
        "--export=ALL,_SLURM_TRAIN_STEP=1",
        f"--container-image={image}",
        f"--container-mounts={extra}:/opt/models:ro,{REPO}:{REPO},{data}:{data},{ckpt}:{ckpt},"
        f"{packages}:{packages},{job_env}:{job_env}",
        "bash",
        f"{REPO}/scripts/slurm_train.sh",
        "--flag",
        "value",
    ]
    assert ckpt.is_dir()  # created on the host: a mount needs its source


def test_inside_pyxis_the_launcher_runs_on_the_images_python_with_the_packages_first(
    site, tmp_path
):
    env = under_sbatch(container(site, "pyxis"))
    rc, out = run(env)
    assert rc == 0, out
    assert any("scripts/launch.py" in line for line in recorded(env, "image_python.log")), out
    seen = rank_saw(env)
    assert seen["PROBE_PYTHON"] == "the-image"  # not the checkout's .venv
    assert seen["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "site"), str(REPO)]
    assert seen["package"] == str(tmp_path / "site" / "probe_package.py")
    assert seen["PROBE_SETTING"] == "from-job-env"  # JOB_ENV over the image's own value


def test_apptainer_enters_the_image_on_every_node_with_gpus_and_the_same_mounts(site, tmp_path):
    env = under_sbatch(container(site, "apptainer"))
    rc, out = run(env, "--flag", "value")
    assert rc == 0, out
    data, packages, job_env = (tmp_path / p for p in ("data", "site", "job.env"))
    assert "--container-image" not in " ".join(recorded(env, "srun.argv"))
    assert recorded(env, "apptainer.argv") == [
        "exec",
        "--nv",
        "--bind",
        f"{REPO}:{REPO},{data}:{data},{packages}:{packages},{job_env}:{job_env}",
        str(tmp_path / "nemo.sif"),
        "bash",
        f"{REPO}/scripts/slurm_train.sh",
        "--flag",
        "value",
    ]
    seen = rank_saw(env)
    assert seen["PROBE_PYTHON"] == "the-image" and seen["argv"] == ["--flag", "value"]
    assert seen["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "site"), str(REPO)]
    assert seen["PROBE_SETTING"] == "from-job-env"


def test_apptainer_by_hand_runs_singularity_where_apptainer_is_not_installed(site, tmp_path):
    bin_dir = Path(site["PATH"].split(":")[0])
    (bin_dir / "apptainer").rename(bin_dir / "singularity")
    if shutil.which("apptainer", path=site["PATH"]):
        pytest.skip("this machine has a real apptainer on PATH")
    env = container(site, "apptainer", NNODES="1", NODE_RANK="0")
    rc, out = run(env)
    assert rc == 0, out
    assert recorded(env, "singularity.argv")[:2] == ["exec", "--nv"]
    assert rank_saw(env)["PROBE_PYTHON"] == "the-image"


def test_without_a_container_runtime_the_job_runs_on_the_host_as_it_always_has(site):
    env = under_sbatch(site, PY=sys.executable, CONTAINER_IMAGE=str(Path(site["PROBE_OUT"]).parent))
    rc, out = run(env)
    assert rc == 0, out
    assert recorded(env, "srun.argv") == [
        "--ntasks-per-node=1",
        "--nodes=1",
        "--kill-on-bad-exit=1",
        "--export=ALL,_SLURM_TRAIN_STEP=1",
        "bash",
        f"{REPO}/scripts/slurm_train.sh",
    ]
    assert recorded(env, "apptainer.argv") is None and recorded(env, "image_python.log") is None
    seen = rank_saw(env)
    assert seen["PROBE_PYTHON"] is None and seen["PYTHONPATH"] is None and seen["package"] is None


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "ERROR:" in line]


@pytest.mark.parametrize(
    "runtime, variables, message",
    [
        ("docker", {}, "CONTAINER_RUNTIME=docker: expected none, pyxis or apptainer"),
        ("apptainer", {"CONTAINER_IMAGE": ""}, "CONTAINER_IMAGE is not set"),
        (
            "apptainer",
            {"CONTAINER_IMAGE": "{tmp}/missing.sif"},
            "CONTAINER_IMAGE={tmp}/missing.sif does not exist",
        ),
        (
            "pyxis",
            {"CONTAINER_PACKAGES": "{tmp}/missing"},
            "CONTAINER_PACKAGES={tmp}/missing is not a directory",
        ),
        (
            "pyxis",
            {"CONTAINER_MOUNTS": "{tmp}/missing:/models"},
            "CONTAINER_MOUNTS: {tmp}/missing does not exist",
        ),
        ("apptainer", {"JOB_ENV": "{tmp}/missing.env"}, "JOB_ENV={tmp}/missing.env does not exist"),
        ("pyxis", {"DATA_DIR": "{tmp}/missing"}, "DATA_DIR={tmp}/missing does not exist"),
    ],
)
def test_a_wrong_container_setting_stops_the_job_before_any_node_in_one_line_naming_it(
    site, tmp_path, runtime, variables, message
):
    variables = {k: v.format(tmp=tmp_path) for k, v in variables.items()}
    env = under_sbatch(container(site, runtime, **variables))
    rc, out = run(env, timeout=30)
    errors = error_lines(out)
    assert rc == 1 and len(errors) == 1 and message.format(tmp=tmp_path) in errors[0], out
    assert recorded(env, "srun.argv") is None and recorded(env, "apptainer.argv") is None


def test_pyxis_on_an_srun_without_the_plugin_is_refused_in_one_line(site):
    write_executable(Path(site["PATH"].split(":")[0]) / "srun", PLAIN_SRUN)
    env = under_sbatch(container(site, "pyxis"))
    rc, out = run(env, timeout=30)
    errors = error_lines(out)
    assert rc == 1 and len(errors) == 1 and "this srun has no --container-image" in errors[0], out
    assert recorded(env, "srun.argv") is None


def test_pyxis_without_slurm_is_refused_in_one_line_naming_the_way_that_works(site):
    rc, out = run(container(site, "pyxis", NNODES="1", NODE_RANK="0"), timeout=30)
    errors = error_lines(out)
    assert rc == 1 and len(errors) == 1 and "CONTAINER_RUNTIME=pyxis: srun starts" in errors[0], out


def test_apptainer_missing_from_path_is_refused_in_one_line(site):
    bin_dir = Path(site["PATH"].split(":")[0])
    (bin_dir / "apptainer").unlink()
    env = container(site, "apptainer", NNODES="1", NODE_RANK="0")
    if shutil.which("apptainer", path=env["PATH"]) or shutil.which("singularity", path=env["PATH"]):
        pytest.skip("this machine has a real apptainer or singularity on PATH")
    rc, out = run(env, timeout=30)
    errors = error_lines(out)
    assert rc == 1 and len(errors) == 1, out
    assert (
        "CONTAINER_RUNTIME=apptainer but neither apptainer nor singularity is on PATH" in errors[0]
    )


def test_a_container_python_the_image_lacks_is_refused_in_one_line(site):
    env = under_sbatch(container(site, "apptainer", CONTAINER_PYTHON="python3.99"))
    rc, out = run(env, timeout=30)
    errors = error_lines(out)
    assert rc == 1 and len(errors) == 1, out
    assert "CONTAINER_PYTHON=python3.99 is not a command in the image" in errors[0]


def test_the_container_variables_are_never_taken_for_misspelt_knobs():
    names = [
        "JOB_ENV",
        "CONTAINER_RUNTIME",
        "CONTAINER_IMAGE",
        "CONTAINER_PYTHON",
        "CONTAINER_PACKAGES",
        "CONTAINER_MOUNTS",
    ]
    config.read_config({name: "1" for name in names})
