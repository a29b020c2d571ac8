#!/usr/bin/env bash
# The first hour on a new GPU node: every check in order, everything logged to ONE file to attach to a bug
# report. From the repository root:
#
#   bash tools/first_hour.sh --model models/Qwen2.5-7B --small-model models/Qwen2.5-0.5B-Instruct \
#       --train-data data/dapo-math-17k.parquet --eval-data data/aime-2024.parquet
#
#   --model        the README's 8-GPU model (Qwen/Qwen2.5-7B), a local directory (hf download ... --local-dir)
#   --small-model  a model small enough for one GPU, whose attention heads split in 2 (Qwen2.5-0.5B-Instruct)
#   --train-data, --eval-data   the data files of the README's command
#   --gpus N       GPUs to use (default: all that nvidia-smi lists)
#   --log FILE     the log (default: first_hour_<date>.log here; each rank's own log under torchrun, and the trainer
#                  checks' JSON, in <log>_ranks/); --out-dir DIR: the 7B run's (runs/first_hour_<date>)
#   --dry-run      check the arguments and print each command without running it
#   -- FLAGS       more dapo.py flags for both 7B commands (they follow the ones below, so they win)
#
# Steps, each timed and logged with its exit status; a failing step does not stop the next:
#   1. nvidia-smi, its topology matrix and the library versions
#   2. pytest -m gpu                                      the GPU tests (minutes, nothing downloaded)
#   3. tools/trainer_check.py on 1 GPU, no vLLM           the README's 1.5B and 7B's width, at their lengths
#   4. tools/gpu_check.py on 1 GPU                        the small model, the README's 1-GPU lengths
#   5. tools/gpu_check.py under torchrun, N ranks, TP 2   the small model, the README's layout
#   6. tools/trainer_check.py under torchrun, N ranks     7B at the README's lengths (2,048 + 20,480): one
#                                                         micro-batch a rank and AdamW's step, beside the plan
#   7. tools/plan.py on the command of step 8             what the plan says each GPU will hold
#   8. the README's 8-GPU command, small: 3 steps, saved  (one step at its full lengths takes hours)
#   9. the same command with --resume, for one more step
#   vLLM logs at INFO (its KV cache, CUDA-graph memory, what sleep frees: the lines the plan's allowances are
#   checked against); under torchrun each rank also writes its own log (torchrun --log-dir --tee). nvidia-smi
#   samples every GPU's memory while 8 and 9 run; the log ends with each GPU's peak (GPU i is rank i:
#   torchrun's local rank picks the device) and a summary line per step.
set -uo pipefail

MODEL="" SMALL="" TRAIN="" EVAL="" GPUS="" LOG="" OUT="" DRY=0 EXTRA=()
fail() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=${2:-}; shift 2 ;;
    --small-model) SMALL=${2:-}; shift 2 ;;
    --train-data) TRAIN=${2:-}; shift 2 ;;
    --eval-data) EVAL=${2:-}; shift 2 ;;
    --gpus) GPUS=${2:-}; shift 2 ;;
    --log) LOG=${2:-}; shift 2 ;;
    --out-dir) OUT=${2:-}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) fail "unknown argument $1 (see the top of tools/first_hour.sh)" ;;
  esac
done

# Every check on the arguments first, each one line and exit 2.
[ -f dapo.py ] || fail "run this from the repository root (no dapo.py in $(pwd))"
for pair in "--model:$MODEL" "--small-model:$SMALL"; do
  flag=${pair%%:*} dir=${pair#*:}
  [ -n "$dir" ] || fail "$flag is missing: give a local model directory (hf download Qwen/Qwen2.5-7B --local-dir models/Qwen2.5-7B)"
  [ -f "$dir/config.json" ] || fail "$flag $dir is not a model directory with config.json: download it first (hf download <name> --local-dir $dir)"
  compgen -G "$dir/*.safetensors" > /dev/null || fail "$flag $dir has no *.safetensors weights (an incomplete download?)"
done
for pair in "--train-data:$TRAIN" "--eval-data:$EVAL"; do
  flag=${pair%%:*} file=${pair#*:}
  [ -n "$file" ] || fail "$flag is missing: give the data file of the README's command (BytedTsinghua-SIA/DAPO-Math-17k, AIME-2024)"
  [ -f "$file" ] || fail "$flag $file: no such file"
done
if [ -z "$GPUS" ]; then
  if [ "$DRY" = 1 ]; then GPUS=8; else
    command -v nvidia-smi > /dev/null || fail "no nvidia-smi here: this script is for a GPU node (--dry-run prints its commands)"
    GPUS=$(nvidia-smi -L | grep -c '^GPU')
  fi
fi
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || fail "--gpus $GPUS must be a positive whole number"
stamp=$(date +%Y%m%d_%H%M%S)
LOG=${LOG:-first_hour_$stamp.log}
OUT=${OUT:-runs/first_hour_$stamp}
[ -e "$OUT" ] && fail "--out-dir $OUT exists: give a new directory (the 7B run starts fresh there)"
touch "$LOG" 2> /dev/null || fail "--log $LOG cannot be written"
LOG=$(cd "$(dirname "$LOG")" && pwd)/$(basename "$LOG")
RANKS=${LOG%.log}_ranks   # each rank's log under torchrun, and the trainer checks' tables (JSON)
# vLLM's start-up and sleep lines (available KV cache memory, CUDA-graph memory, memory freed by sleep): dapo.py
# keeps vLLM at ERROR unless this says otherwise
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}

# The README's 8-GPU command, with small sizes for a first try: 2 prompts per GPU, 8 responses of at most
# 1,024 tokens each, 2 mini-batches. --grad-checkpointing: without it tools/plan.py puts the training peak
# at 75 of 80 GB even at these sizes (the default 4 sequences packed in one row, no recomputation).
SEVEN_B=(dapo.py --model "$MODEL" --train-data "$TRAIN" --eval-data "$EVAL" --tp-size 2
         --prompts-per-step $((2 * GPUS)) --group-size 8 --gen-batch-size $((6 * GPUS)) --num-mini-batches 2
         --max-prompt-len 1024 --max-response-len 1024 --overlong-cache-len 256 --grad-checkpointing
         --eval-samples 2 --eval-max-prompts 8 --out-dir "$OUT")
TORCHRUN=(torchrun --standalone --nproc_per_node="$GPUS" --log-dir "$RANKS" --tee 3)

exec > >(tee -a "$LOG") 2>&1
echo "first_hour: logging to $LOG"
echo "first_hour: $(date), $(hostname), $GPUS GPU(s), git $(git rev-parse --short HEAD 2> /dev/null || echo '?')"
declare -a SUMMARY=()

step() {  # step NAME COMMAND...: run it (or print it under --dry-run), timed, its status kept for the summary
  local name=$1; shift
  echo; echo "=== $name"; echo "\$ $(printf '%q ' "$@")"
  if [ "$DRY" = 1 ]; then SUMMARY+=("printed  $name"); return 0; fi
  local start=$SECONDS
  "$@"
  local rc=$?
  SUMMARY+=("$( [ $rc = 0 ] && echo "ok      " || echo "FAILED ($rc)") $name ($((SECONDS - start)) s)")
}

skip() { echo; echo "=== $1"; echo "skipped: $2"; SUMMARY+=("skipped  $1: $2"); }

step "1. nvidia-smi and versions" bash -c 'nvidia-smi; nvidia-smi topo -m; python -c "import torch, vllm, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version(), \"vllm\", vllm.__version__, \"transformers\", transformers.__version__)"'
step "2. pytest -m gpu" python -m pytest -m gpu -v -rs
step "3. trainer_check, 1 GPU, no vLLM" env CUDA_VISIBLE_DEVICES=0 python tools/trainer_check.py --json "$RANKS/trainer_check_1gpu.json"
step "4. gpu_check, 1 GPU, the 1-GPU command's lengths" env CUDA_VISIBLE_DEVICES=0 python tools/gpu_check.py --model "$SMALL" --max-prompt-len 2048 --max-response-len 4096
if [ "$GPUS" -ge 2 ] && [ $((GPUS % 2)) = 0 ]; then
  step "5. gpu_check, torchrun $GPUS ranks, TP 2" "${TORCHRUN[@]}" tools/gpu_check.py --model "$SMALL" --tp-size 2
  step "6. trainer_check, torchrun $GPUS ranks, 7B at 2048 + 20480 tokens" "${TORCHRUN[@]}" tools/trainer_check.py --models 7b --checks memory --json "$RANKS/trainer_check_7b.json"
  step "7. the plan of step 8" python tools/plan.py "${SEVEN_B[@]:1}" --steps 3 --plan-gpus-per-node "$GPUS" ${EXTRA[@]+"${EXTRA[@]}"}
  samples=$(mktemp)
  if [ "$DRY" = 0 ]; then
    nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits -lms 500 > "$samples" &
    sampler=$!
  fi
  step "8. the README's 8-GPU command, 3 steps, saved" "${TORCHRUN[@]}" "${SEVEN_B[@]}" --steps 3 ${EXTRA[@]+"${EXTRA[@]}"}
  step "9. the same, --resume for one more step" "${TORCHRUN[@]}" "${SEVEN_B[@]}" --steps 4 --resume ${EXTRA[@]+"${EXTRA[@]}"}
  if [ "$DRY" = 0 ]; then
    kill "$sampler" 2> /dev/null; wait "$sampler" 2> /dev/null
    echo; echo "=== nvidia-smi: each GPU's peak memory while steps 8 and 9 ran (GPU i = rank i), MiB"
    awk -F', *' '$2 > peak[$1] {peak[$1] = $2; total[$1] = $3} END {for (g in peak) printf "  GPU %s: %s of %s\n", g, peak[g], total[g]}' "$samples" | sort -V
  fi
  rm -f "$samples"
else
  for s in "5. gpu_check under torchrun, TP 2" "6. trainer_check under torchrun" "7. the plan" "8. the README's 8-GPU command" "9. its --resume"; do
    skip "$s" "TP 2 needs an even number of GPUs ($GPUS here)"
  done
fi

echo; echo "=== summary"
printf '  %s\n' "${SUMMARY[@]}"
echo "first_hour: the log is $LOG, each rank's and the trainer checks' in $RANKS: attach both to a bug report"
! printf '%s\n' "${SUMMARY[@]}" | grep -q '^FAILED'
