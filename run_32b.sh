#!/usr/bin/env bash
# The DAPO paper's 32B run (arXiv 2503.14476, Sec. 4.1), as plain statements.
# Check the memory plan first (no GPU, model or data needed):  bash run_32b.sh --plan
#
# Before launching:
#  - The repository, MODEL, the data files and OUT must be on a file system that every node
#    mounts at the same path (NFS, Lustre, GPFS, ...): every rank writes its own checkpoint
#    shards under OUT, and resume reads them back from any node.
#  - Download the model ONCE into that file system; a hub name would make 128 ranks resolve and
#    download it at the same time:
#      hf download Qwen/Qwen2.5-32B --local-dir models/Qwen2.5-32B
#  - Data: BytedTsinghua-SIA/DAPO-Math-17k and BytedTsinghua-SIA/AIME-2024 (parquet) under data/.
# Then, on EVERY node, from the repository root (cd to it first), with the same NNODES,
# MASTER_ADDR and MASTER_PORT and that node's NODE_RANK, e.g. on node 0:
#   NNODES=16 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash run_32b.sh
# Each node checks that the repository, MODEL and the data are there before it launches.
#
# Network (torchrun passes the environment on to every rank; set these before the command
# when the defaults pick the wrong interface, and the same on every node):
#   NCCL_SOCKET_IFNAME  interface NCCL bootstraps on, and carries data over when there is no
#                       InfiniBand (e.g. eth0 or ib0; by default NCCL prefers ib*, then anything
#                       but lo and docker*, which may not be the one nodes reach each other on).
#                       NCCL carries the FSDP all-gathers/reduce-scatters between nodes (and the
#                       weight sync's), and vLLM's tensor-parallel all-reduces within a node.
#   NCCL_IB_HCA         the InfiniBand adapters to use (e.g. mlx5_0,mlx5_1); NCCL_DEBUG=INFO
#                       prints the transport each rank picked (check it on the first launch).
#   GLOO_SOCKET_IFNAME  interface of gloo, which carries the CPU collectives: the exchange of
#                       rollout samples between ranks after every generation batch (large at
#                       20k-token responses), rank 0's broadcasts and vLLM's start-up.
#                       Gloo otherwise uses the address the hostname resolves to; if other nodes
#                       cannot reach that, the first CPU collective hangs until the timeout.
#   MASTER_ADDR must be reachable from every node (it is where torchrun's rendezvous listens).
set -euo pipefail

NNODES=${NNODES:-16}                  # the paper: 16 nodes x 8 GPUs (H800 in the reproduction)
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

MODEL=${MODEL:-models/Qwen2.5-32B}                    # Qwen/Qwen2.5-32B, the base model (not instruct), downloaded
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
  --dual-clip 10                                # the reference run's dual clip (c = 10) for negative advantages
  --dynamic-sampling --token-level-loss --soft-overlong-punishment
  --no-overlong-filtering                       # verl's DAPO recipe README: the best run had no overlong filtering
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
  --collective-timeout-min 180                  # ranks meet after each generation batch: outlast its 20k-token tail
)

if [ "${1:-}" = "--plan" ]; then
  shift
  exec python tools/plan.py "${args[@]}" --plan-nodes "$NNODES" --plan-gpus-per-node "$GPUS_PER_NODE" "$@"
fi

# Preflight, on every node before it starts 8 ranks: one line and exit 2 on the first problem.
fail() { echo "error: $*" >&2; exit 2; }
[ -f dapo.py ] || fail "run this from the repository root (no dapo.py in $(pwd)): cd to it on every node"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || fail "NNODES=$NNODES must be a positive whole number"
[[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] || fail "NODE_RANK=$NODE_RANK must be one of 0..$((NNODES - 1)) (NNODES=$NNODES)"
case "$NNODES:$MASTER_ADDR" in
  1:*) ;;
  *:127.*|*:localhost) fail "MASTER_ADDR=$MASTER_ADDR with NNODES=$NNODES: set it to node 0's address, the same on every node" ;;
esac
[ -f "$MODEL/config.json" ] || fail "MODEL=$MODEL is not a local model directory with config.json: download it once to the shared file system (hf download Qwen/Qwen2.5-32B --local-dir models/Qwen2.5-32B) and point MODEL there"
compgen -G "$MODEL/*.safetensors" > /dev/null || fail "MODEL=$MODEL has no *.safetensors weights (an incomplete download?)"
for f in "$TRAIN" "$EVAL"; do
  [ -f "$f" ] || fail "data file $f not found on this node (node $NODE_RANK, $(hostname)): put the data on the shared file system, or set TRAIN/EVAL"
done
fstype=$(stat -f -c %T . 2>/dev/null || echo unknown)
case "$NNODES:$fstype" in
  1:*) ;;
  *:ext2/ext3|*:xfs|*:btrfs|*:tmpfs|*:overlayfs)
    echo "warning: $(pwd) is on a local $fstype file system; every node must see the same repository, data and OUT" >&2 ;;
esac
# Not set here: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. It would keep the trainer's varying
# micro-batch shapes from fragmenting the CUDA cache, but vLLM turns it off only inside its sleep-mode
# pool, and at TP > 1 its custom all-reduce registers CUDA-graph buffers through CUDA IPC, which rejects
# expandable-segment memory (vLLM #42609): a crash at start-up. See docs/gpu.md.
echo "node $NODE_RANK of $NNODES ($(hostname)): rendezvous at $MASTER_ADDR:$MASTER_PORT;" \
  "$(env | grep -E '^(NCCL_|GLOO_SOCKET_IFNAME=)' | sort | tr '\n' ' ' || true)"

exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  dapo.py "${args[@]}" "$@"
