#!/usr/bin/env bash
# Multi-node training: one torchrun per node, NPROC_PER_NODE ranks each, joined by a c10d rendezvous
# hosted on the first node. Works under SLURM (sbatch) and on any set of machines you start by hand.
#
# SLURM (submit from the repository root; the #SBATCH lines below are defaults, override on the CLI):
#   DATA_DIR=/shared/asr_data CHECKPOINT_DIR=/shared/ckpt sbatch --nodes=4 scripts/slurm_train.sh
#   MAX_STEPS=200000 sbatch --nodes=2 --time=48:00:00 scripts/slurm_train.sh  # knobs are env vars
# By hand (run on every node with the same MASTER_ADDR / MASTER_PORT and its own NODE_RANK):
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=0 bash scripts/slurm_train.sh      # on node0
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=1 bash scripts/slurm_train.sh      # on node1
# In a site's container image (Containers, below; docs/operations.md has the package install):
#   CONTAINER_RUNTIME=pyxis CONTAINER_IMAGE='nvcr.io#nvidia/pytorch:25.01-py3' \
#     CONTAINER_PACKAGES=/shared/parakeet/site JOB_ENV=/shared/parakeet/job.env sbatch --nodes=2 scripts/slurm_train.sh
#
# Environment (all optional under SLURM, which provides the first four):
#   NNODES          number of nodes                   (SLURM_JOB_NUM_NODES, else 1)
#   NODE_RANK       this node, 0..NNODES-1; node 0 hosts the rendezvous store (SLURM_NODEID, else 0)
#   MASTER_ADDR     address of node 0 reachable from every node (first host of SLURM_JOB_NODELIST;
#                   required by hand when NNODES > 1)
#   MASTER_PORT     rendezvous TCP port on node 0     (29500)
#   NPROC_PER_NODE  ranks per node                    (number of GPUs from nvidia-smi, else 1)
#   RDZV_ID         rendezvous id, the same on every node (SLURM_JOB_ID, else parakeet-<port>)
#   RDZV_TIMEOUT    seconds to wait for every node to join (900)
#   RDZV_READ_TIMEOUT  seconds a node keeps trying to reach node 0's store (300): start order is free
#   MAX_RESTARTS    torchrun restarts of the whole group after a worker failure (0)
#   TRAIN_SCRIPT    what torchrun runs                (<repo>/train.py); arguments to this script pass on
#   PY              python with the project installed (<repo>/.venv/bin/python, else python3)
#   CHECKPOINT_DIR  must be on a filesystem every node mounts: rank 0 writes checkpoints there and a
#                   requeued job may restart on other nodes. Checked before the rendezvous (below).
#   SHARED_DIR_TIMEOUT  seconds the other nodes wait to see node 0's marker in CHECKPOINT_DIR (120;
#                   0 skips the check, e.g. for a single-node run)
#   RESUME_FROM     unset: 'last', the newest checkpoint in CHECKPOINT_DIR or a fresh start when there
#                   is none, so a requeued job continues. Set it (RESUME_FROM= starts fresh) to choose.
#   JOB_ENV         a file of `export NAME=value` lines (the job's job.env), read on every node and again
#                   inside the container, where its values win over any the image sets   (none)
#   Every config.py knob (DATA_DIR, GRAD_ACCUM, ...) passes through to train.py unchanged.
#
# Containers: each node runs this script inside the image, with the image's Python, the checkout and
# CONTAINER_PACKAGES on PYTHONPATH, and REPO_DIR, DATA_DIR, CHECKPOINT_DIR, CONTAINER_PACKAGES and
# JOB_ENV (those set) mounted at their own paths; nothing is installed into the image.
#   CONTAINER_RUNTIME   none: the host's PY, as above (none)
#                       pyxis: the batch step's srun starts the image (--container-image, --container-mounts)
#                       apptainer: each node enters it with `apptainer exec --nv --bind` (`singularity`
#                       where apptainer is not on PATH), with SLURM or by hand
#   CONTAINER_IMAGE     required: for pyxis an enroot URI (nvcr.io#nvidia/pytorch:25.01-py3) or a .sqsh
#                       file, for apptainer a .sif file (or a docker:// URI)
#   CONTAINER_PYTHON    the image's Python; PY is not read in a container         (python3)
#   CONTAINER_PACKAGES  the directory `python -m pip install --target DIR` filled with what the image lacks,
#                       first on PYTHONPATH                                        (none)
#   CONTAINER_MOUNTS    more mounts, in the runtime's syntax: SRC:DST[:FLAGS],...  (none); for what the job
#                       reads outside those above (INIT_MODEL's folder, ...)
#
# NCCL (GPU) and Gloo (CPU) networking; set these when the defaults pick the wrong interface:
#   NCCL_SOCKET_IFNAME=ib0|eth0|^lo,docker   interface(s) for bootstrap / socket traffic
#   GLOO_SOCKET_IFNAME                       the same for Gloo (defaults to NCCL_SOCKET_IFNAME)
#   NCCL_IB_DISABLE=1                        no InfiniBand (e.g. Ethernet-only clouds)
#   NCCL_IB_HCA=mlx5_0,mlx5_1                which InfiniBand adapters to use
#   NCCL_DEBUG=INFO                          log topology and transport choices (WARN by default here)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1        a hung collective aborts the job instead of hanging (default)
#
# Requeue: --requeue lets SLURM restart a failed or preempted job. 5 minutes before the time limit
# SLURM sends USR1 to this script, which passes it through srun and torchrun to every rank; the ranks
# finish their current optimizer step, save it (step_<step>.ckpt) and exit with code 75, and this
# script then requeues the job. The new run resumes from that checkpoint (RESUME_FROM=last) and redoes
# nothing. PREEMPT_SAVE_SECONDS (240) is how long torchrun waits for the save before killing the ranks.
#
#SBATCH --job-name=parakeet-tdt
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    sed -n '2,/^#SBATCH/{/^#SBATCH/d;s/^# \{0,1\}//;p}' "$0"
    echo
    echo "#SBATCH defaults:"; grep '^#SBATCH' "$0" | sed 's/^/  /'
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    py=${PY:-$here/.venv/bin/python}; [[ -x "$py" ]] || py=python3
    echo
    (cd "$here" && "$py" -c 'import config; print(config.help_epilog("train"))' 2>/dev/null) \
        || echo "(train.py --help lists the knobs train.py reads)"
    exit 0
fi

log() { echo "[slurm_train node ${NODE_RANK:-?}/${NNODES:-?} $(hostname)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# set -e alone exits without a word; name the command and line instead.
trap 'log "ERROR: exit status $? at line $LINENO of scripts/slurm_train.sh: $BASH_COMMAND"' ERR

# Read again inside a container: pyxis and Apptainer keep an image's own value of a variable over the job's.
if [[ -n "${JOB_ENV:-}" ]]; then
    [[ "$JOB_ENV" == /* ]] || JOB_ENV="$PWD/$JOB_ENV"
    [[ -f "$JOB_ENV" ]] || die "JOB_ENV=$JOB_ENV does not exist"
    export JOB_ENV
    # shellcheck source=/dev/null
    source "$JOB_ENV" || die "JOB_ENV=$JOB_ENV: a line of it failed (message above)"
fi

# Under sbatch this file runs from a spool copy, so the repository comes from the submit directory.
if [[ -z "${REPO_DIR:-}" ]]; then
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [[ -f "$here/config.py" ]]; then REPO_DIR="$here"
    elif [[ -n "${SLURM_SUBMIT_DIR:-}" && -f "$SLURM_SUBMIT_DIR/config.py" ]]; then REPO_DIR="$SLURM_SUBMIT_DIR"
    else die "cannot find the repository: submit from its root or set REPO_DIR"; fi
fi
export REPO_DIR
cd "$REPO_DIR"

# The first host of the job: node 0, which hosts the rendezvous.
first_host() {
    local hosts
    # No pipe into head: under pipefail, scontrol's SIGPIPE would end the script on large jobs.
    hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || die "scontrol cannot expand $SLURM_JOB_NODELIST"
    MASTER_ADDR=${hosts%%$'\n'*}
}

# --- a container: check its settings on the host, before any node starts ---
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-none}
in_container=${_SLURM_TRAIN_CONTAINER:-}
case $CONTAINER_RUNTIME in
    none|pyxis|apptainer) ;;
    *) die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME: expected none, pyxis or apptainer" ;;
esac
# Sets container_mounts: the user's CONTAINER_MOUNTS, then each directory the job reads or writes at its
# own path, so every path in the environment means the same inside; a later, more specific mount wins.
set_container_mounts() {
    local paths=("$REPO_DIR") mounted=() entries=() p q entry covered
    container_mounts=${CONTAINER_MOUNTS:-}
    [[ -z "$container_mounts" ]] || IFS=, read -r -a entries <<< "$container_mounts"
    for entry in ${entries[@]+"${entries[@]}"}; do
        [[ -z "$entry" || -e "${entry%%:*}" ]] || die "CONTAINER_MOUNTS: ${entry%%:*} does not exist on this node"
    done
    if [[ -n "${DATA_DIR:-}" ]]; then
        [[ -d "$DATA_DIR" ]] || die "DATA_DIR=$DATA_DIR does not exist on this node (it is mounted into the container)"
        paths+=("$DATA_DIR")
    fi
    if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
        mkdir -p "$CHECKPOINT_DIR" || die "cannot create CHECKPOINT_DIR=$CHECKPOINT_DIR"
        paths+=("$CHECKPOINT_DIR")
    fi
    if [[ -n "${CONTAINER_PACKAGES:-}" ]]; then
        [[ -d "$CONTAINER_PACKAGES" ]] || die "CONTAINER_PACKAGES=$CONTAINER_PACKAGES is not a directory: fill it \
with the image's Python, python -m pip install --target $CONTAINER_PACKAGES (docs/operations.md)"
        paths+=("$CONTAINER_PACKAGES")
    fi
    if [[ -n "${JOB_ENV:-}" ]]; then paths+=("$JOB_ENV"); fi
    for p in "${paths[@]}"; do
        if [[ "$p" != /* ]]; then p="$REPO_DIR/$p"; fi
        p=${p%/}
        covered=0
        for q in ${mounted[@]+"${mounted[@]}"}; do
            if [[ "$p" == "$q" || "$p" == "$q"/* ]]; then covered=1; fi
        done
        for entry in ${entries[@]+"${entries[@]}"}; do
            if [[ "$entry" == "$p" || "$entry" == "$p:$p" ]]; then covered=1; fi
        done
        if (( covered )); then continue; fi
        mounted+=("$p")
        container_mounts+="${container_mounts:+,}$p:$p"
    done
}
if [[ $CONTAINER_RUNTIME != none && -z "$in_container" ]]; then
    [[ -n "${CONTAINER_IMAGE:-}" ]] || die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME but CONTAINER_IMAGE is not set: \
name the image (an enroot URI or .sqsh file for pyxis, a .sif file for apptainer)"
    # A path must exist; pyxis also takes registry names (nvcr.io#nvidia/pytorch:25.01-py3), Apptainer URIs.
    if [[ "$CONTAINER_IMAGE" == [/.~]* || ( $CONTAINER_RUNTIME == apptainer && "$CONTAINER_IMAGE" != *://* ) ]]; then
        [[ -e "$CONTAINER_IMAGE" ]] || die "CONTAINER_IMAGE=$CONTAINER_IMAGE does not exist on this node"
    fi
    if [[ $CONTAINER_RUNTIME == apptainer ]]; then
        apptainer=$(command -v apptainer || command -v singularity) || die "CONTAINER_RUNTIME=apptainer but \
neither apptainer nor singularity is on PATH (module load apptainer, or CONTAINER_RUNTIME=pyxis where srun has it)"
    fi
    set_container_mounts
fi

# --- SLURM batch step: start this script once per node with srun, and handle the time limit ---
in_step=0
if [[ -n "${_SLURM_TRAIN_STEP:-}" ]]; then in_step=1
# srun from an salloc shell: a numeric step id below Slurm's special ids (batch, extern, ...).
elif [[ "${SLURM_STEP_ID:-}" =~ ^[0-9]+$ ]] && (( SLURM_STEP_ID < 4294967290 )); then in_step=1
fi
if [[ -n "${SLURM_JOB_ID:-}" && $in_step == 0 ]]; then
    NNODES=${SLURM_JOB_NUM_NODES:-1}
    NODE_RANK=batch
    requeue_requested=0
    requeue() {
        log "USR1 from SLURM (time limit or preemption near): the ranks save at the end of their current \
optimizer step and exit; job $SLURM_JOB_ID is requeued after that (RESUME_FROM=last continues it)"
        requeue_requested=1
        kill -USR1 "$srun_pid" 2>/dev/null || true  # srun forwards it to the launcher on every node
    }
    trap requeue USR1
    trap : USR2  # a stack-dump request (scancel --full --signal=USR2) must not end the batch shell
    trap - ERR  # srun's own status is reported below; wait returning early on USR1 is no error
    container=()
    if [[ $CONTAINER_RUNTIME == pyxis ]]; then
        srun_help=$(srun --help 2>&1) || true
        [[ "$srun_help" == *--container-image* ]] || die "CONTAINER_RUNTIME=pyxis but this srun has no \
--container-image (the pyxis plugin is not installed here): use CONTAINER_RUNTIME=apptainer"
        [[ -n "${MASTER_ADDR:-}" ]] || first_host  # here: the image may have no scontrol
        export MASTER_ADDR _SLURM_TRAIN_CONTAINER=pyxis
        container=(--container-image="$CONTAINER_IMAGE" --container-mounts="$container_mounts")
        log "every node in the image $CONTAINER_IMAGE (pyxis), mounts $container_mounts"
    fi
    log "starting one launcher per node on $SLURM_JOB_NODELIST (restart #${SLURM_RESTART_COUNT:-0})"
    srun --ntasks-per-node=1 --nodes="$NNODES" --kill-on-bad-exit=1 --export=ALL,_SLURM_TRAIN_STEP=1 \
        ${container[@]+"${container[@]}"} bash "$REPO_DIR/scripts/slurm_train.sh" "$@" &
    srun_pid=$!
    # wait returns early when USR1 arrives; the trap runs, then wait again for srun to end.
    while true; do
        set +e; wait $srun_pid; rc=$?; set -e
        if (( rc > 128 )) && kill -0 $srun_pid 2>/dev/null; then continue; fi
        break
    done
    if (( requeue_requested )); then
        log "launchers ended (status $rc) after the save; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit $rc
fi

# --- one node: work out the topology ---
if [[ $in_step == 1 && -n "${SLURM_NODEID:-}" ]]; then
    # Inside srun, SLURM's values win over any NNODES / NODE_RANK exported from the submit shell.
    NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    NODE_RANK=$SLURM_NODEID
else
    NNODES=${NNODES:-1}
    NODE_RANK=${NODE_RANK:-0}
fi
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        first_host
    elif (( NNODES == 1 )); then
        MASTER_ADDR=127.0.0.1
    else
        die "MASTER_ADDR is not set: give every node the address of node 0 (NNODES=$NNODES)"
    fi
fi

# --- Apptainer: this node enters the image here and runs this script again inside it ---
if [[ $CONTAINER_RUNTIME != none && -z "$in_container" ]]; then
    [[ $CONTAINER_RUNTIME == apptainer ]] || die "CONTAINER_RUNTIME=pyxis: srun starts the image, and this \
script calls srun only as a SLURM batch step: submit it with sbatch (or run it from an salloc shell), or use \
CONTAINER_RUNTIME=apptainer"
    export NNODES NODE_RANK MASTER_ADDR _SLURM_TRAIN_CONTAINER=apptainer
    log "entering the image: $apptainer exec --nv --bind $container_mounts $CONTAINER_IMAGE"
    exec "$apptainer" exec --nv --bind "$container_mounts" "$CONTAINER_IMAGE" \
        bash "$REPO_DIR/scripts/slurm_train.sh" "$@"
fi

MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-parakeet-$MASTER_PORT}}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
RDZV_READ_TIMEOUT=${RDZV_READ_TIMEOUT:-300}
MAX_RESTARTS=${MAX_RESTARTS:-0}
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$REPO_DIR/train.py}
if [[ -n "$in_container" ]]; then
    # The image's Python (the checkout's .venv was built for the host), with what pip --target put beside
    # the read-only image, then the checkout, ahead of the image's own packages.
    PY=${CONTAINER_PYTHON:-python3}
    if [[ -n "${CONTAINER_PACKAGES:-}" && "$CONTAINER_PACKAGES" != /* ]]; then
        CONTAINER_PACKAGES="$REPO_DIR/$CONTAINER_PACKAGES"
    fi
    command -v "$PY" > /dev/null || die "CONTAINER_PYTHON=$PY is not a command in the image ${CONTAINER_IMAGE:-}: \
name the image's Python"
    [[ -z "${CONTAINER_PACKAGES:-}" || -d "$CONTAINER_PACKAGES" ]] \
        || die "CONTAINER_PACKAGES=$CONTAINER_PACKAGES is not mounted in the image"
    export PYTHONPATH="${CONTAINER_PACKAGES:+$CONTAINER_PACKAGES:}$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
    log "in the image ${CONTAINER_IMAGE:-} ($in_container): python $(command -v "$PY"), PYTHONPATH=$PYTHONPATH"
elif [[ -z "${PY:-}" ]]; then
    if [[ -x "$REPO_DIR/.venv/bin/python" ]]; then PY="$REPO_DIR/.venv/bin/python"; else PY=python3; fi
fi
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    (( NPROC_PER_NODE > 0 )) || NPROC_PER_NODE=1
fi
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES=$NNODES: expected a positive integer"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] && (( NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK: expected 0..$((NNODES - 1))"
[[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE=$NPROC_PER_NODE: expected a positive integer"
[[ "$MASTER_PORT" =~ ^[0-9]+$ ]] || die "MASTER_PORT=$MASTER_PORT: expected a TCP port number"
[[ -f "$TRAIN_SCRIPT" ]] || die "TRAIN_SCRIPT=$TRAIN_SCRIPT does not exist"

# config.py validates every knob here, before any node waits on another; it also gives CHECKPOINT_DIR.
CHECKPOINT_DIR=$("$PY" -c 'import config; print(config.CHECKPOINT_DIR)') \
    || die "config.py rejected the environment (message above); fix the variable it names"
export CHECKPOINT_DIR
mkdir -p "$CHECKPOINT_DIR" || die "cannot create CHECKPOINT_DIR=$CHECKPOINT_DIR"
[[ -w "$CHECKPOINT_DIR" ]] || die "CHECKPOINT_DIR=$CHECKPOINT_DIR is not writable"

# Rank 0 saves checkpoints on node 0; a requeued job may resume on any node. Prove the directory is
# shared now rather than after a day of training: node 0 writes a marker that every node must see.
SHARED_DIR_TIMEOUT=${SHARED_DIR_TIMEOUT:-120}
marker="$CHECKPOINT_DIR/.shared_check/${RDZV_ID}.${SLURM_RESTART_COUNT:-0}"
if (( NNODES > 1 && SHARED_DIR_TIMEOUT > 0 )); then
    mkdir -p "$CHECKPOINT_DIR/.shared_check"
    if (( NODE_RANK == 0 )); then
        echo "$(hostname) $$" > "$marker.tmp.$$" && mv "$marker.tmp.$$" "$marker"
    else
        waited=0
        until [[ -f "$marker" ]]; do
            (( waited < SHARED_DIR_TIMEOUT )) || die "CHECKPOINT_DIR=$CHECKPOINT_DIR is not shared: node 0 wrote \
$marker and this node has not seen it after ${SHARED_DIR_TIMEOUT}s. Put CHECKPOINT_DIR (and DATA_DIR) on a \
filesystem every node mounts (NFS, Lustre, GPFS, ...), or set SHARED_DIR_TIMEOUT=0 to skip this check."
            sleep 1; waited=$((waited + 1))
        done
    fi
fi

# 'last' = the newest step_*.ckpt in CHECKPOINT_DIR, or a fresh start when there is none (train.py),
# so a requeued or restarted job continues. An explicit RESUME_FROM, even empty, is kept.
export RESUME_FROM=${RESUME_FROM-last}

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
if [[ -n "${NCCL_SOCKET_IFNAME:-}" && -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
    export GLOO_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME
fi
# Each rank gets its share of the node's cores (torch would otherwise start one thread per core per rank).
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cores=${SLURM_CPUS_ON_NODE:-$(nproc)}
    export OMP_NUM_THREADS=$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))
fi
# Node 0 hosts the rendezvous store; saying so explicitly avoids relying on hostname matching, which
# fails when MASTER_ADDR is an IP or an InfiniBand name.
is_host=$(( NODE_RANK == 0 ? 1 : 0 ))

log "rendezvous c10d://$MASTER_ADDR:$MASTER_PORT id=$RDZV_ID nodes=$NNODES procs/node=$NPROC_PER_NODE \
world=$((NNODES * NPROC_PER_NODE)) host_store=$is_host"
log "script=$TRAIN_SCRIPT CHECKPOINT_DIR=$CHECKPOINT_DIR RESUME_FROM=${RESUME_FROM:-<empty: fresh>} \
OMP_NUM_THREADS=$OMP_NUM_THREADS NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<auto>} \
NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-<auto>} NCCL_DEBUG=$NCCL_DEBUG"

set +e
# USR1 (forwarded by srun from the batch step), SIGTERM (scancel, preemption, the time limit) and SIGINT
# reach torchrun, which passes them on to every rank and waits PREEMPT_SAVE_SECONDS for them: the ranks
# finish their current optimizer step, save it as a step checkpoint and exit with code 75 (see
# docs/operations.md, "Signals"). scripts/launch.py is torchrun with the same arguments that handles
# all three (plain torchrun leaves out USR1) and whose deliberate ends (a user error, a saved stop)
# finish on the run's own line instead of torchrun's traceback; a crash keeps the traceback.
"$PY" "$REPO_DIR/scripts/launch.py" \
    --shutdown-timeout="${PREEMPT_SAVE_SECONDS:-240}" \
    --nnodes="$NNODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id="$RDZV_ID" \
    --rdzv-conf="is_host=$is_host,join_timeout=$RDZV_TIMEOUT,read_timeout=$RDZV_READ_TIMEOUT" \
    --max-restarts="$MAX_RESTARTS" \
    "$TRAIN_SCRIPT" "$@" &
launcher_pid=$!
# This shell passes each stop signal on and waits for the save: a kill of this script alone still
# stops the run, and when SLURM signals every process of the step, this shell outlives the save
# (the launcher ignores a repeated signal). USR2 asks the ranks for their stacks; this shell has none
# and must not die of it (scripts/dump_stacks.py).
pass_on() { log "$1: passing it to torchrun (the ranks save and exit)"; kill -"$1" "$launcher_pid" 2>/dev/null || true; }
trap 'pass_on USR1' USR1
trap 'pass_on TERM' TERM
trap 'pass_on INT' INT
trap : USR2
trap - ERR  # torchrun's status is reported below; wait returning early on a signal is no error
while true; do
    wait $launcher_pid; rc=$?
    if (( rc > 128 )) && kill -0 $launcher_pid 2>/dev/null; then continue; fi
    break
done
set -e
if (( NODE_RANK == 0 )); then rm -f "$marker"; fi
log "torchrun exited with status $rc"
exit $rc
