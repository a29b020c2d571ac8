#!/usr/bin/env bash
# The DAPO paper's 32B run (arXiv 2503.14476, Sec. 4.1), as plain statements.
# Launch it on every node with NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT set, e.g. on node 0:
#   NNODES=16 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_32b.sh
# Check the memory plan first (no GPU needed):  bash run_32b.sh --plan
# Every node needs the same paths; checkpoints are written by all ranks, so OUT must be on a
# shared file system.
set -euo pipefail

NNODES=${NNODES:-16}                  # the paper: 16 nodes x 8 GPUs (H800 in the reproduction)
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

MODEL=${MODEL:-Qwen/Qwen2.5-32B}                      # the base model, not the instruct one
TRAIN=${TRAIN:-data/dapo-math-17k.parquet}            # BytedTsinghua-SIA/DAPO-Math-17k
EVAL=${EVAL:-data/aime-2024.parquet}                  # BytedTsinghua-SIA/AIME-2024 (30 x 32 rows)
OUT=${OUT:-runs/dapo-qwen2.5-32b}

args=(
  --model "$MODEL" --train-data "$TRAIN" --eval-data "$EVAL" --out-dir "$OUT"
  --prompts-per-step 512 --group-size 16        # 512 prompts x 16 responses per rollout step
  --gen-batch-size 1536 --max-gen-batches 10    # verl: 3 x 512 prompts per generation batch
  --num-mini-batches 16                         # 16 gradient updates per rollout step
  --max-prompt-len 2048
  --max-response-len 20480 --overlong-cache-len 4096   # 16,384 expected + 4,096 soft cache
  --eps-low 0.2 --eps-high 0.28                 # Clip-Higher
  --dynamic-sampling --token-level-loss --soft-overlong-punishment
  --no-overlong-filtering                       # the 50-point reference run used only the soft punishment
  --lr 1e-6 --warmup-steps 20 --weight-decay 0.1 --grad-clip 1.0   # no KL term anywhere
  --temperature 1.0 --top-p 1.0
  --eval-samples 32 --eval-temperature 1.0 --eval-top-p 0.7 --eval-every 5   # avg@32 on AIME 2024
  --tp-size 4                                   # 32B in bf16 is 66 GB: TP 4 leaves 80 GB GPUs room for KV cache
  --gpu-memory-utilization 0.7                  # vLLM's share while generating (weights + KV cache)
  --vllm-sleep                                  # vLLM frees its memory while the trainer updates
  --grad-checkpointing                          # activations of one layer at a time
  --micro-batch-tokens 22528                    # token budget per micro-batch: one max-length sequence (2,048 + 20,480)
  --logprob-chunk 1024                          # never a full fp32 (T, 152k) log-softmax
  --steps 320                                   # ~5k gradient steps, as in the paper's curves
  --save-every 10 --keep-checkpoints 3
)

if [ "${1:-}" = "--plan" ]; then
  shift
  exec python dapo.py "${args[@]}" --plan --plan-nodes "$NNODES" --plan-gpus-per-node "$GPUS_PER_NODE" "$@"
fi

exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  dapo.py "${args[@]}" "$@"
