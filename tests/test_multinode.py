"""scripts/slurm_train.sh: two "nodes" x one process on localhost, started as two launchers.

The rendezvous is tested with a tiny probe script (init_process_group + all_reduce) run through the
launcher's TRAIN_SCRIPT override, so those tests check the launcher itself; one more runs train.py for
two optimizer steps across the two "nodes" (about 50 s on 2 busy cores). The SLURM path runs with
stand-ins for srun and scontrol.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.torchrun_jobs import free_port, job_processes, signal_every_process

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "scripts" / "slurm_train.sh"
PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "rank_sum": total.item(),
                   "group_rank": int(os.environ["GROUP_RANK"]), "resume_from": os.environ.get("RESUME_FROM"),
                   "argv": sys.argv[1:]}, f)
    dist.destroy_process_group()
""")


@pytest.fixture
def launcher_env(tmp_path):
    """An environment with no SLURM variables (CI may itself run under SLURM) and the probe as script."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "out").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RESUME_FROM"))}
    env.update(
        DATA_DIR=str(tmp_path / "data"),
        TRAIN_SCRIPT=str(tmp_path / "probe.py"),
        PROBE_OUT=str(tmp_path / "out"),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NPROC_PER_NODE="1",
        OMP_NUM_THREADS="1",
        PY=sys.executable,
    )
    return env


def start(env: dict, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(LAUNCHER), *extra.pop("args", "").split()],
        env={**env, **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"launcher did not finish in {timeout}s:\n{out}")
    return proc.returncode, out


@pytest.mark.slow
def test_two_launchers_on_localhost_form_one_world_of_two_ranks(launcher_env, tmp_path):
    nodes = [
        start(launcher_env, NNODES="2", NODE_RANK=str(rank), args="--flag value") for rank in (1, 0)
    ]
    results = [finish(p) for p in nodes]
    for rc, out in results:
        assert rc == 0, out
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert sorted(r["group_rank"] for r in ranks) == [0, 1]  # one rank per node
    assert all(r["rank_sum"] == 1.0 for r in ranks)  # the all_reduce crossed the two "nodes"
    assert all(
        r["argv"] == ["--flag", "value"] for r in ranks
    )  # launcher arguments reach the script
    assert all(
        r["resume_from"] == "last" for r in ranks
    )  # requeue-safe default (fresh when no checkpoint)
    node0_log = results[1][1]
    assert (
        "host_store=1" in node0_log and "world=2" in node0_log and "host_store=0" in results[0][1]
    )


@pytest.mark.slow
def test_train_py_trains_two_steps_over_two_nodes(launcher_env, tmp_path):
    from tests.tiny_training_data import make_training_data

    data = make_training_data(tmp_path / "tiny", per_lang=6, vocab_size=64)
    env = {k: v for k, v in launcher_env.items() if not k.startswith("WANDB")}
    env.update(
        TRAIN_SCRIPT=str(REPO / "train.py"),
        ACCELERATOR="cpu",
        PRECISION="32-true",
        NUM_WORKERS="0",
        INIT_MODEL="",
        TRAIN_MANIFEST_PATH=str(data["manifest"]),
        TOKENIZER_DIR=str(data["tokenizer"]),
        GRAD_ACCUM="1",
        MAX_STEPS="2",
        UNFREEZE_STEP="1",
        WARMUP_STEPS="1",
        PHASE2_WARMUP="1",
        MAX_BATCH_DURATION="6",
        BUCKET_BOUNDARIES="2",
        WANDB_MODE="disabled",
    )
    nodes = [start(env, NNODES="2", NODE_RANK=str(rank)) for rank in (1, 0)]
    (rc1, out1), (rc0, out0) = [finish(p, timeout=240) for p in nodes]
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    assert "world size 2 = 2 node(s) x 1 process(es)" in out0 + out1
    assert "done: 2 optimizer steps" in out0 and "done: 2 optimizer steps" in out1


@pytest.mark.slow
def test_an_explicitly_empty_resume_from_starts_fresh(launcher_env, tmp_path):
    rc, out = finish(start(launcher_env, NNODES="1", NODE_RANK="0", RESUME_FROM=""))
    assert rc == 0, out
    assert json.loads((tmp_path / "out" / "rank0.json").read_text())["resume_from"] == ""


FAKE_SRUN = """#!/usr/bin/env bash
# Stands in for srun --ntasks-per-node=1: the command once per node, with that node's SLURM variables.
nodes=1; exports=""
while [[ $1 == --* ]]; do
    case $1 in --nodes=*) nodes=${1#--nodes=};; --export=*) exports=${1#--export=};; esac
    shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
    (IFS=,; for kv in $exports; do [[ $kv == ALL ]] || export "$kv"; done
     SLURM_NODEID=$i SLURM_PROCID=$i SLURM_STEP_ID=0 exec "$@") &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && printf '127.0.0.1\\nnode-b\\n'
"""


@pytest.mark.slow
def test_under_sbatch_the_batch_step_starts_one_launcher_per_node_with_slurm_topology(
    launcher_env, tmp_path
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in launcher_env.items() if k not in ("MASTER_ADDR", "NNODES")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_SUBMIT_DIR=str(REPO),
        NODE_RANK="0",
    )  # left over in the submit shell: SLURM_NODEID must win inside srun
    rc, out = finish(
        subprocess.Popen(
            ["bash", str(LAUNCHER)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    )
    assert rc == 0, out
    assert "c10d://127.0.0.1:" in out and "id=4242" in out  # node 0 from the node list, the job id
    assert "node 0/2" in out and "node 1/2" in out
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and all(r["rank_sum"] == 1.0 for r in ranks)


def test_multi_node_without_master_addr_stops_before_waiting(launcher_env):
    env = {k: v for k, v in launcher_env.items() if k != "MASTER_ADDR"}
    rc, out = finish(start(env, NNODES="2", NODE_RANK="0"), timeout=30)
    assert rc == 1 and "MASTER_ADDR is not set" in out


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: expected 0..1"),
        ({"NNODES": "0", "NODE_RANK": "0"}, "NNODES=0"),
        ({"NNODES": "1", "NPROC_PER_NODE": "x"}, "NPROC_PER_NODE=x"),
    ],
)
def test_bad_topology_is_refused_with_the_variable_named(launcher_env, variables, message):
    rc, out = finish(start(launcher_env, **variables), timeout=30)
    assert rc == 1 and message in out


def test_a_checkpoint_dir_node_0_does_not_share_is_reported(launcher_env):
    # Node 1 alone: node 0 never writes its marker, exactly what a node-local CHECKPOINT_DIR looks like.
    rc, out = finish(
        start(launcher_env, NNODES="2", NODE_RANK="1", SHARED_DIR_TIMEOUT="2"), timeout=60
    )
    assert rc == 1 and "is not shared" in out and "CHECKPOINT_DIR" in out


def test_a_bad_config_value_stops_the_launcher_before_the_rendezvous(launcher_env):
    rc, out = finish(start(launcher_env, NNODES="2", NODE_RANK="1", GRAD_ACCUM="four"), timeout=60)
    assert rc == 1 and "GRAD_ACCUM" in out and "config.py rejected" in out


def test_launcher_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(LAUNCHER)]).returncode == 0


# A rank as train.py sets it up: it answers the stop signals and SIGUSR2 (its stacks); it ends on a
# stop signal (exit 75) or when PROBE_OUT/finish appears (exit 0).
STOP_PROBE = textwrap.dedent("""
    import os, sys, time
    import process_control
    process_control.install_stop_handlers()
    process_control.set_training(True)
    process_control.install_stack_dump()
    out = os.environ["PROBE_OUT"]
    open(os.path.join(out, "ready"), "w").close()
    for _ in range(1200):
        if process_control.stop_requested() or os.path.exists(os.path.join(out, "finish")):
            break
        time.sleep(0.1)
    with open(os.path.join(out, "stopped_by"), "w") as f:
        f.write(str(process_control.stop_requested()))
    sys.exit(process_control.PREEMPTED_EXIT_CODE if process_control.stop_requested() else 0)
""")
# srun forwards USR1 to its tasks; this stand-in does too.
FORWARDING_SRUN = FAKE_SRUN.replace(
    "rc=0\n", "trap 'kill -USR1 \"${pids[@]}\" 2>/dev/null' USR1\nrc=0\n"
).replace(
    'for p in "${pids[@]}"; do wait "$p" || rc=$?; done',
    'for p in "${pids[@]}"; do\n'
    '    while true; do wait "$p"; r=$?; (( r > 128 )) && kill -0 "$p" 2>/dev/null || break; done\n'
    "    (( r )) && rc=$r\n"
    "done",
)
LOGGING_SCONTROL = FAKE_SCONTROL + 'echo "$@" >> "$PROBE_OUT/scontrol.log"\n'


@pytest.mark.slow
def test_slurm_usr1_reaches_the_ranks_through_srun_and_torchrun_then_the_job_is_requeued(
    launcher_env, tmp_path
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FORWARDING_SRUN), ("scontrol", LOGGING_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "stop_probe.py").write_text(STOP_PROBE)
    env = {k: v for k, v in launcher_env.items() if k not in ("MASTER_ADDR", "NNODES")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_ID="4243",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_SUBMIT_DIR=str(REPO),
        TRAIN_SCRIPT=str(tmp_path / "stop_probe.py"),
        SHARED_DIR_TIMEOUT="0",
    )
    batch = subprocess.Popen(
        ["bash", str(LAUNCHER)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "ready").exists():
        assert batch.poll() is None and time.monotonic() < deadline, batch.communicate()[0]
        time.sleep(0.2)
    batch.send_signal(signal.SIGUSR1)  # what sbatch --signal=B:USR1@300 does
    rc, out = finish(batch, timeout=120)
    assert (tmp_path / "out" / "stopped_by").read_text() == "SIGUSR1", out
    assert (tmp_path / "out" / "scontrol.log").read_text().splitlines()[-1] == "requeue 4243", out
    assert "requeueing job 4243" in out


def start_probe_node(launcher_env: dict, tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    """This script on one node (no SLURM) running STOP_PROBE as its one rank, once the rank is
    ready; its environment marks every process of the job (job_processes)."""
    (tmp_path / "stop_probe.py").write_text(STOP_PROBE)
    env = {
        **launcher_env,
        "TRAIN_SCRIPT": str(tmp_path / "stop_probe.py"),
        "PROBE_JOB": f"node-{tmp_path.name}",
    }
    node = start(env, NNODES="1", NODE_RANK="0")
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "ready").exists():
        if node.poll() is not None or time.monotonic() > deadline:
            signal_every_process(env, signal.SIGKILL)
            pytest.fail(finish(node, timeout=10)[1])
        time.sleep(0.2)
    return node, env


@pytest.mark.slow
def test_usr2_to_every_process_of_a_node_prints_the_ranks_stacks_and_the_job_goes_on(
    launcher_env, tmp_path
):
    node, env = start_probe_node(launcher_env, tmp_path)
    try:
        processes = job_processes(env)
        signal_every_process(env, signal.SIGUSR2)  # as `scancel --signal=USR2 <job>` does
        time.sleep(2)
        assert node.poll() is None and sorted(job_processes(env)) == sorted(processes)
        (tmp_path / "out" / "finish").touch()
        rc, out = finish(node, timeout=60)
    finally:
        signal_every_process(env, signal.SIGKILL)
    assert rc == 0, out
    # The launcher's note is one write; the rank's stack, many: on the shared stderr the note may
    # land inside a stack line, so it is taken out before the stack is read.
    note = re.compile(r"launch\.py: SIGUSR2 ignored: [^\n]*\n")
    assert re.search(r'stop_probe\.py", line \d+ in <module>', note.sub("", out)), out


@pytest.mark.slow
def test_sigterm_to_this_script_alone_has_the_ranks_save_and_it_exits_75(launcher_env, tmp_path):
    node, env = start_probe_node(launcher_env, tmp_path)
    try:
        node.send_signal(signal.SIGTERM)  # `kill <its pid>`: the ranks must hear of it
        rc, out = finish(node, timeout=60)
    finally:
        signal_every_process(env, signal.SIGKILL)
    assert rc == 75, out
    assert (tmp_path / "out" / "stopped_by").read_text() == "SIGTERM", out
