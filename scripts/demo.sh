#!/usr/bin/env bash
# `make demo`: every stage of the real pipeline on a small embedded corpus, on CPU, with no downloads,
# finetuning a base model onto new languages as users finetune Parakeet.
#
#   make demo                 # builds what is missing, reuses what is already built
#   DEMO_CLEAN=1 make demo    # starts from scratch (or: make clean-demo && make demo)
#   DEMO_DIR=/tmp/d make demo # somewhere else
#
# Stages: corpus -> extract -> build manifest -> make_train_val -> the base model: its languages'
# rows of the split (DEMO_BASE_LANGUAGES), its own tokenizer, torchrun train.py from scratch
# (DEMO_BASE_STEPS), validated on its languages at its end -> the finetune: the tokenizer extended from the
# base's (INIT_MODEL set first, as README says), training caches, torchrun train.py from the base
# (2 CPU processes, both phases, step-0 validation of the base, checkpoints, offline W&B) ->
# evaluate -> data report. The closing page shows per language the base, the finetune at step 0
# and at its end. Every knob below is an ordinary config.py variable (DEMO_* are the demo's own);
# export one to override it.
set -euo pipefail
if [[ $# -gt 0 ]]; then
    if [[ "$1" == -h || "$1" == --help ]]; then
        sed -n '2,/^set -euo pipefail/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
        echo
        echo "Knobs it sets unless exported (every other config.py knob passes through as is):"
        sed -n 's/^\(export \)\{0,1\}\([A-Z_0-9]*\)=\${[A-Z_0-9]*:-\(.*\)}\( *#.*\)\{0,1\}$/  \2=\3/p' "$0"
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
# Training defaults, sized so the whole demo takes ~7 minutes on 2 idle cores (0.45 s a step of the
# base, 0.55 s of the finetune: 512 pieces, seven languages) and the model visibly transcribes:
# configs/demo_tdt.yaml (128 x 3 encoder; wider costs little, the transducer loss dominates a step).
# The base: English and Hindi, the corpus's two largest languages, trained from scratch for
# DEMO_BASE_STEPS (a stand-in for the pretrained Parakeet a user starts from: it shows the method,
# not a good model). The finetune: every language with config.py's finetuning defaults (the base's
# own languages kept at a floor of the mix). VOCAB_SIZE 512 for the extended tokenizer is already
# close to characters for 7 scripts; smaller would drop rows as infeasible (tokens > duration /
# 0.08 s). VAL_PER_LANG 10 puts every language, Hindi with its large speaker groups included, in the
# validation split.
export MODEL_CONFIG=${MODEL_CONFIG:-$PWD/configs/demo_tdt.yaml}
export VOCAB_SIZE=${VOCAB_SIZE:-512}
export MIN_DURATION=${MIN_DURATION:-0.5}
export MAX_DURATION=${MAX_DURATION:-12}
export BUCKET_BOUNDARIES=${BUCKET_BOUNDARIES:-2,3,4,6}
export MAX_BATCH_DURATION=${MAX_BATCH_DURATION:-40}
export VAL_PER_LANG=${VAL_PER_LANG:-10}
export GRAD_ACCUM=${GRAD_ACCUM:-1}
export MAX_STEPS=${MAX_STEPS:-300}
export UNFREEZE_STEP=${UNFREEZE_STEP:-60}
export WARMUP_STEPS=${WARMUP_STEPS:-10}
export PHASE2_WARMUP=${PHASE2_WARMUP:-30}
export PHASE1_LR=${PHASE1_LR:-3e-3}
export PHASE2_LR=${PHASE2_LR:-3e-3}
export MIN_LR=${MIN_LR:-1e-4}
export CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-100}
export NUM_WORKERS=${NUM_WORKERS:-1}
export PRECISION=${PRECISION:-32-true}
export ACCELERATOR=${ACCELERATOR:-cpu}
export WANDB_MODE=${WANDB_MODE:-offline}
export WANDB_RUN_NAME=${WANDB_RUN_NAME:-demo}
DEMO_BASE_LANGUAGES=${DEMO_BASE_LANGUAGES:-en,hi}
DEMO_BASE_STEPS=${DEMO_BASE_STEPS:-250}
DEMO_BASE_VOCAB_SIZE=${DEMO_BASE_VOCAB_SIZE:-256}
BASE_DIR="$DEMO_DIR/base"
BASE_NEMO="$BASE_DIR/checkpoints/step_$(printf %08d "$DEMO_BASE_STEPS").nemo"
# The base run's own paths and schedule, over the split's rows of its languages.
base_env=(
  TRAIN_MANIFEST_PATH="$BASE_DIR/train_manifest_v2.parquet"
  VAL_MANIFEST_PATH="$BASE_DIR/val_manifest_v2.parquet"
  TOKENIZER_DIR="$BASE_DIR/tokenizer"
  CHECKPOINT_DIR="$BASE_DIR/checkpoints"
  WANDB_RUN_NAME="$WANDB_RUN_NAME-base"
  VOCAB_SIZE="$DEMO_BASE_VOCAB_SIZE"
  MAX_STEPS="$DEMO_BASE_STEPS"
  CHECKPOINT_EVERY="$DEMO_BASE_STEPS"
  UNFREEZE_STEP=0
  INIT_MODEL=
  RESUME_FROM=
)

TIMINGS="$DEMO_DIR/stage_timings.txt"
: >"$TIMINGS"
# The machine's load average beside each time: a stage that took longer on a busy machine says so.
load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown; }
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
  printf '%-16s %4ds  (load %s)\n' "$name" $((SECONDS - t0)) "$(load)" >>"$TIMINGS"
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

# The base model: its languages' rows of the same split (none of the finetune's validation rows in its
# training), its own tokenizer, trained from scratch.
stage base_split "$BASE_DIR/val_manifest_v2.parquet" \
  $PY scripts/demo_base_split.py "$DEMO_DIR" "$BASE_DIR" --languages "$DEMO_BASE_LANGUAGES"
stage base_tokenizer "$BASE_DIR/tokenizer/tokenizer.model" env "${base_env[@]}" $PY scripts/train_tokenizer.py
if [[ ! -e "$BASE_NEMO" ]] && compgen -G "$BASE_DIR/checkpoints/step_*.ckpt" >/dev/null; then
  base_env+=(RESUME_FROM=last)   # an interrupted base run continues from its newest checkpoint
fi
# Its validation at its last step scores it on its languages' validation rows (the closing page's
# "base" column).
stage base_train "$BASE_NEMO" \
  env "${base_env[@]}" $PY scripts/launch.py --standalone --nproc_per_node 2 train.py

# The finetune, as README orders it: INIT_MODEL first, so the tokenizer step extends the base's.
export INIT_MODEL="$BASE_NEMO"
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
t0=$SECONDS
status=0
$PY scripts/demo_summary.py --max-loss-ratio "${DEMO_MAX_LOSS_RATIO:-0.7}" \
  --base-run-dir "$DEMO_DIR/wandb_logs/$WANDB_RUN_NAME-base" || status=$?
# The closing page's own time (after the table above), so the file covers every stage of `make demo`.
printf '%-16s %4ds  (load %s)\n' summary $((SECONDS - t0)) "$(load)" >>"$TIMINGS"
printf '%-16s %4ds\n' total "$SECONDS" >>"$TIMINGS"
exit $status
