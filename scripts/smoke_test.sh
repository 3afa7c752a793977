#!/usr/bin/env bash
# A first run on a new machine in minutes, before the 8-GPU job: one process, 50 optimizer steps of
# the real configuration, through every path that can fail on a GPU first.
#
#   bash scripts/smoke_test.sh                     # on the GPU node, the job's environment exported
#   INIT_MODEL=/models/parakeet-tdt-0.6b-v2.nemo BASE_LANGUAGES=en DATA_DIR=/nvme/asr_data bash scripts/smoke_test.sh
#
# What it runs (`python train.py`, one process, the current knobs except those below):
#   - the start-up loss check on the device (both of NeMo's kernel families, TDT and RNN-T);
#   - phase 1 for 2 steps, then the unfreeze (AdamW's moments for the encoder appear);
#   - validation at step 4 (the decoder's CUDA graphs built and released), on 20 utterances a language;
#   - the sampler's first, most expensive micro-batches at MAX_BATCH_DURATION with its joint cap;
#   - SIGTERM once step 10 is logged: the step in progress is saved and the process exits with 75;
#   - a resume (RESUME_FROM=last) to step 50, which exports a .nemo and its model card.
# Everything goes to SMOKE_DIR (default: a new directory under /tmp); its metrics.jsonl holds
# gpu/peak_memory_gib and gpu/peak_reserved_gib per step. Exit 0 when every stage did what it should.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
    sed -n '2,/^set -euo pipefail/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
    exit 0
fi
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SMOKE_DIR=$(realpath -m "${SMOKE_DIR:-$(mktemp -d /tmp/smoke.XXXXXX)}")
mkdir -p "$SMOKE_DIR"
export CHECKPOINT_DIR="$SMOKE_DIR/checkpoints" WANDB_LOG_DIR="$SMOKE_DIR/wandb_logs" WANDB_RUN_NAME=smoke
export WANDB_MODE=${WANDB_MODE:-offline} MAX_STEPS=50 UNFREEZE_STEP=2 WARMUP_STEPS=2 PHASE2_WARMUP=2
export EVAL_EVERY_STEPS=4 EVAL_SAMPLES_PER_LANG=${EVAL_SAMPLES_PER_LANG:-20} CHECKPOINT_EVERY=1000
metrics="$WANDB_LOG_DIR/smoke/metrics.jsonl"
say() { echo "[smoke] $*"; }
fail() { say "FAILED: $*"; say "logs: $SMOKE_DIR"; exit 1; }
# Interrupted (Ctrl-C, kill, a job's time limit): stop the train.py it started and wait for it, so
# no run outlives the script. train.py runs in the background and is waited for, since bash runs a
# trap only after a foreground child ends.
pid=
stop() {
    trap - INT TERM
    if [[ -n "$pid" ]]; then
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    say "interrupted: stopped train.py; logs: $SMOKE_DIR"
    exit "$1"
}
trap 'stop 130' INT
trap 'stop 143' TERM

say "training in $SMOKE_DIR (log: train.log); SIGTERM once step 10 is logged"
RESUME_FROM= "$PY" train.py >"$SMOKE_DIR/train.log" 2>&1 &
pid=$!
until grep -q '"step": 10,' "$metrics" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { wait "$pid" || true; fail "train.py ended before step 10 (tail of train.log):
$(tail -20 "$SMOKE_DIR/train.log")"; }
    sleep 1
done
kill -TERM "$pid"
set +e; wait "$pid"; rc=$?; set -e
pid=
[[ $rc == 75 ]] || fail "after SIGTERM train.py exited with $rc, not 75 (tail of train.log):
$(tail -20 "$SMOKE_DIR/train.log")"
saved=$(ls "$CHECKPOINT_DIR"/step_*.ckpt | tail -1)
say "stopped with exit code 75 after saving $(basename "$saved")"
grep -q "agrees with tdt_loss.py" "$SMOKE_DIR/train.log" && say "$(grep -m1 -o 'TDT loss on .*' "$SMOKE_DIR/train.log")"
grep -q "step 4: validation on" "$SMOKE_DIR/train.log" || fail "no validation at step 4"
say "$(grep -m1 -o 'step 4: validation on.*' "$SMOKE_DIR/train.log")"

say "resuming to step 50 (log: resume.log)"
RESUME_FROM=last "$PY" train.py >"$SMOKE_DIR/resume.log" 2>&1 &
pid=$!
wait "$pid" || fail "the resume failed (tail of resume.log):
$(tail -20 "$SMOKE_DIR/resume.log")"
pid=
[[ -f "$CHECKPOINT_DIR/step_00000050.nemo" ]] || fail "no step_00000050.nemo after the resume"
if ! "$PY" - "$metrics" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")]
steps = [r["step"] for r in rows if "train/loss" in r]
peak = max((r.get("gpu/peak_memory_gib", 0) for r in rows), default=0)
reserved = max((r.get("gpu/peak_reserved_gib", 0) for r in rows), default=0)
print(f"[smoke] {len(steps)} optimizer steps logged, each once: {steps == sorted(set(steps))}; "
      f"peak GPU memory {peak:.2f} GiB allocated, {reserved:.2f} GiB reserved")
# The stop and the resume lose no step and log none twice.
sys.exit(0 if steps == list(range(1, 51)) else 1)
PY
then
    fail "the metrics do not hold optimizer steps 1 to 50, each once: $metrics"
fi
say "passed: $SMOKE_DIR"
