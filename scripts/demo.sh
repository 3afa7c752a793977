#!/usr/bin/env bash
# `make demo`: every stage of the real pipeline on a small embedded corpus, on CPU, with no downloads.
#
#   make demo                 # builds what is missing, reuses what is already built
#   DEMO_CLEAN=1 make demo    # starts from scratch (or: make clean-demo && make demo)
#   DEMO_DIR=/tmp/d make demo # somewhere else
#
# Stages: corpus -> extract -> build manifest -> make_train_val -> tokenizer -> training caches ->
# torchrun train.py (2 CPU processes, both phases, checkpoints, offline W&B) -> evaluate -> data report.
# Every knob below is an ordinary config.py variable; export one to override it.
set -euo pipefail
if [[ $# -gt 0 ]]; then
    if [[ "$1" == -h || "$1" == --help ]]; then
        sed -n '2,/^set -euo pipefail/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
        echo
        echo "Knobs it sets unless exported (every other config.py knob passes through as is):"
        sed -n 's/^export \([A-Z_0-9]*\)=\${[A-Z_0-9]*:-\(.*\)}$/  \1=\2/p' "$0"
        exit 0
    fi
    echo "demo.sh: unknown argument '$1'; it takes no arguments (--help: what it runs and its knobs)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEMO_DIR=$(realpath -m "${DEMO_DIR:-demo_data}")
DEMO_UTTERANCES=${DEMO_UTTERANCES:-}   # e.g. "hi=20,en=10" for a tiny run (tests)

if [[ "${DEMO_CLEAN:-0}" == 1 ]]; then rm -rf "$DEMO_DIR"; fi
mkdir -p "$DEMO_DIR"

export DATA_DIR="$DEMO_DIR"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Training defaults, sized so the whole demo takes ~9 minutes on 2 idle cores (~0.7 s per step) and the
# model visibly transcribes: configs/demo_tdt.yaml (128 x 3 encoder; wider costs little, the transducer
# loss dominates a step); the encoder is random, so phase 1 (frozen encoder, decoder + joint learn the
# token prior) is kept short but shown; phase 2 at 3e-3 (5e-3 fit the training voices faster but did
# worse on the unseen validation voices). VOCAB_SIZE 512 is already close to characters for 7 scripts;
# smaller would drop more rows as infeasible (tokens > duration / 0.08 s). VAL_PER_LANG 10 puts every
# language, Hindi with its large speaker groups included, in the validation split.
export MODEL_CONFIG=${MODEL_CONFIG:-$PWD/configs/demo_tdt.yaml}
export VOCAB_SIZE=${VOCAB_SIZE:-512}
export MIN_DURATION=${MIN_DURATION:-0.5}
export MAX_DURATION=${MAX_DURATION:-12}
export BUCKET_BOUNDARIES=${BUCKET_BOUNDARIES:-2,3,4,6}
export MAX_BATCH_DURATION=${MAX_BATCH_DURATION:-40}
export VAL_PER_LANG=${VAL_PER_LANG:-10}
export GRAD_ACCUM=${GRAD_ACCUM:-1}
export MAX_STEPS=${MAX_STEPS:-700}
export UNFREEZE_STEP=${UNFREEZE_STEP:-40}
export WARMUP_STEPS=${WARMUP_STEPS:-10}
export PHASE2_WARMUP=${PHASE2_WARMUP:-30}
export PHASE1_LR=${PHASE1_LR:-3e-3}
export PHASE2_LR=${PHASE2_LR:-3e-3}
export MIN_LR=${MIN_LR:-1e-4}
export CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-175}
export NUM_WORKERS=${NUM_WORKERS:-1}
export PRECISION=${PRECISION:-32-true}
export ACCELERATOR=${ACCELERATOR:-cpu}
export WANDB_MODE=${WANDB_MODE:-offline}
export WANDB_RUN_NAME=${WANDB_RUN_NAME:-demo}

TIMINGS="$DEMO_DIR/stage_timings.txt"
: >"$TIMINGS"
stage() {  # stage NAME DONE_FILE COMMAND...: runs COMMAND unless DONE_FILE exists ('-': always), and times it
  local name=$1 done_file=$2; shift 2
  if [[ "$done_file" != - && -e "$done_file" ]]; then
    echo "== $name: reusing $done_file"
    printf '%-16s reused\n' "$name" >>"$TIMINGS"
    return
  fi
  echo "== $name: $*"
  local t0=$SECONDS
  "$@"
  printf '%-16s %4ds\n' "$name" $((SECONDS - t0)) >>"$TIMINGS"
}

# The corpus and extract steps always run: each reuses its own finished work (same arguments,
# verified shards) by itself.
corpus_args=(--out "$DEMO_DIR/shards")
[[ -n "$DEMO_UTTERANCES" ]] && corpus_args+=(--sizes "$DEMO_UTTERANCES")
stage corpus          - $PY scripts/make_demo_corpus.py "${corpus_args[@]}"
stage extract         - $PY scripts/extract_audio.py   # skips verified shards by itself
stage build_manifest  "$DEMO_DIR/master_manifest.parquet" $PY build_manifest.py
# A tiny corpus (DEMO_UTTERANCES, the tests' runs) has languages whose every speaker holds more
# utterances than their validation quota; the full demo gives every language validation rows.
split_args=()
[[ -n "$DEMO_UTTERANCES" ]] && split_args+=(--allow-short-val)
stage make_train_val  "$DEMO_DIR/train_manifest_v2.parquet" $PY scripts/make_train_val.py "${split_args[@]}"
stage tokenizer       "$DEMO_DIR/tokenizer/tokenizer.model" $PY scripts/train_tokenizer.py
stage cache           - $PY scripts/build_training_cache.py   # maps the caches when already built

FINAL_NEMO="$DEMO_DIR/checkpoints/step_$(printf %08d "$MAX_STEPS").nemo"
if [[ ! -e "$FINAL_NEMO" ]] && compgen -G "$DEMO_DIR/checkpoints/step_*.ckpt" >/dev/null; then
  export RESUME_FROM=last   # an interrupted demo run continues from its newest checkpoint
fi
stage train "$FINAL_NEMO" $PY scripts/launch.py --standalone --nproc_per_node 2 train.py
stage evaluate "$DEMO_DIR/eval/wer_by_language.csv" \
  $PY scripts/evaluate.py "$FINAL_NEMO" --manifest "$DEMO_DIR/val_manifest_v2.parquet" \
  --out "$DEMO_DIR/eval/wer_by_language.csv"
stage report "$DEMO_DIR/report/report.md" \
  $PY scripts/manifest_report.py "$DEMO_DIR/train_manifest_v2.parquet" --out "$DEMO_DIR/report"

echo
echo "== demo finished. Stage timings:"
cat "$TIMINGS"
$PY scripts/demo_summary.py --max-loss-ratio "${DEMO_MAX_LOSS_RATIO:-0.7}"
