#!/usr/bin/env bash
# Gemma 4 26B-A4B GRPO with vime, --megatron-to-hf-mode bridge, COLOCATED: the Megatron actor and the vLLM
# engines share every GPU and take turns (vime offloads the idle side). Defaults to one node of 8 x 40 GB
# A800 at the reported actor layout TP2·PP2·EP4·ETP1 (same EP boundaries: experts 0-31 | 32-63 | 64-95 |
# 96-127); NNODES=4 runs the same layout on 32 GPUs (data parallel 8).
#
# Run the SAME script on every node:
#   NODE_RANK=0 bash recipes/gemma4-26b-a4b-colocated.sh                       # 1 node: just this
#   NNODES=4 MASTER_ADDR=<head ip> NODE_RANK=0|1|2|3 bash recipes/gemma4-26b-a4b-colocated.sh
#   DRY_RUN=1 bash recipes/gemma4-26b-a4b-colocated.sh                         # print the command only
#
# Pre-step (once):
#   vime-gemma4 import --hf-checkpoint "$HF_CKPT" --save "$TORCH_DIST" --tp 2 --pp 2 --ep 4 --etp 1 --nproc 8
# Weight sync: colocated engines get the weights over CUDA IPC (vime's UpdateWeightFromTensor), not through
# NCCL broadcast or files; vime's disk transport is for non-colocated runs only (scripts/README-disk-weight-
# sync.md), so --update-weight-transport is not set here. --check-weight-update-equal works the same way.
# Flag sources: [vime] vime/utils/arguments.py; [vllm] vLLM EngineArgs re-exported as --vllm-* by
# vime/backends/vllm_utils/arguments.py; [vime-vllm] vime-only knob of that file; [megatron]
# megatron/training/arguments.py. The 4x8 recipe explains the shared flags at more length.
set -euo pipefail

# ------------------------------------------------------------------------------------------------
# Settings (every one can be overridden from the environment)
# ------------------------------------------------------------------------------------------------
DRY_RUN=${DRY_RUN:-0}                          # 1: print the resolved command and exit 0, launch nothing
SKIP_PREFLIGHT=${SKIP_PREFLIGHT:-0}            # 1 with DRY_RUN=1: skip the plugin preflight (repeated dry runs)
PYTHON=${PYTHON:-python3}                      # interpreter of the vime image (the plugin must be installed in it)
VIME_DIR=${VIME_DIR:-/root/vime}
MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-/root/Megatron-LM}
BASE_DIR=${BASE_DIR:-/root}

# Actor parallelism (memory notes at PERF_ARGS).
TP=${TP:-2}
PP=${PP:-2}
EP=${EP:-4}
ETP=${ETP:-1}
CP=${CP:-1}

HF_CKPT=${HF_CKPT:-${BASE_DIR}/gemma-4-26B-A4B-it}
TORCH_DIST=${TORCH_DIST:-${BASE_DIR}/gemma-4-26B-A4B-it_torch_dist_tp${TP}pp${PP}ep${EP}etp${ETP}}  # from `vime-gemma4 import`
REF_LOAD=${REF_LOAD:-${TORCH_DIST}}
OUTPUT_DIR=${OUTPUT_DIR:-${BASE_DIR}/vime_output/gemma4-26b-a4b-colocated}
SAVE_DIR=${SAVE_DIR:-${OUTPUT_DIR}/ckpt}
SAVE_INTERVAL=${SAVE_INTERVAL:-20}
CHECK_WEIGHT_UPDATE_EQUAL=${CHECK_WEIGHT_UPDATE_EQUAL:-1}

PROMPT_DATA=${PROMPT_DATA:-${BASE_DIR}/datasets/dapo-math-17k/dapo-math-17k.jsonl}
INPUT_KEY=${INPUT_KEY:-prompt}
LABEL_KEY=${LABEL_KEY:-label}
RM_TYPE=${RM_TYPE:-math}
CHAT_TEMPLATE_KWARGS=${CHAT_TEMPLATE_KWARGS:-'{}'}

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-4}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
NODE_RANK=${NODE_RANK:-0}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
TOTAL_GPUS=$(( NNODES * GPUS_PER_NODE ))        # actor and rollout both use all of them

NUM_ROLLOUT=${NUM_ROLLOUT:-100}
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-16}
N_SAMPLES_PER_PROMPT=${N_SAMPLES_PER_PROMPT:-8}
NUM_STEPS_PER_ROLLOUT=${NUM_STEPS_PER_ROLLOUT:-1}
GLOBAL_BATCH_SIZE=$(( ROLLOUT_BATCH_SIZE * N_SAMPLES_PER_PROMPT / NUM_STEPS_PER_ROLLOUT ))
ROLLOUT_MAX_RESPONSE_LEN=${ROLLOUT_MAX_RESPONSE_LEN:-4096}
PROMPT_BUDGET=${PROMPT_BUDGET:-2048}
ROLLOUT_TEMPERATURE=${ROLLOUT_TEMPERATURE:-1.0}
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-8192}
LR=${LR:-1e-6}
USE_KL_LOSS=${USE_KL_LOSS:-0}
KL_LOSS_COEF=${KL_LOSS_COEF:-0.001}

VLLM_GPU_MEMORY_UTILIZATION=${VLLM_GPU_MEMORY_UTILIZATION:-0.7}
VLLM_MAX_NUM_SEQS=${VLLM_MAX_NUM_SEQS:-64}
VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE=${VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE:-${VLLM_MAX_NUM_SEQS}}
VLLM_SERVER_CONCURRENCY=${VLLM_SERVER_CONCURRENCY:-128}
UPDATE_WEIGHT_BUFFER_SIZE=${UPDATE_WEIGHT_BUFFER_SIZE:-$((512 * 1024 * 1024))}

# ------------------------------------------------------------------------------------------------
# Plugin activation: the package's .pth imports vime_gemma4_bridge in every Python process when this is
# set, so Megatron-Bridge's AutoBridge resolves Gemma 4 to the plugin's bridges; vime is not edited.
# Exported before `ray start` on every node and repeated in the job's runtime env.
# ------------------------------------------------------------------------------------------------
export VIME_GEMMA4_BRIDGE_AUTOLOAD=1
export PYTHONUNBUFFERED=1
if [[ "${DRY_RUN}" != 1 || "${SKIP_PREFLIGHT}" != 1 ]]; then
  "${PYTHON}" -c "import vime_gemma4_bridge" || {
    echo "vime_gemma4_bridge is not importable by ${PYTHON}: run 'pip install --no-deps -e <vime_gemma4_bridge checkout>' on every node" >&2
    exit 1
  }
  # Preflight: the plugin registers, its model builds with this host's modules, and (except under
  # DRY_RUN, which may run on a machine other than the actor image) vime's bridge mode can use this
  # Megatron-Bridge build: `vime-gemma4 env --vime` prints what it found and exits 1 with the reason.
  PREFLIGHT=(env)
  [[ "${DRY_RUN}" == 1 ]] || PREFLIGHT+=(--vime)
  "${PYTHON}" -m vime_gemma4_bridge.cli "${PREFLIGHT[@]}" >&2 || {
    echo "preflight failed: see 'vime-gemma4 ${PREFLIGHT[*]}' above" >&2
    exit 1
  }
fi

# ------------------------------------------------------------------------------------------------
# Arguments of vime's train.py
# ------------------------------------------------------------------------------------------------
CLUSTER_ARGS=(
  --actor-num-nodes "${NNODES}"                # [vime] every node trains ...
  --actor-num-gpus-per-node "${GPUS_PER_NODE}" # [vime] ... on all its GPUs (8 = TP2·PP2 x DP2 at NNODES=1)
  --rollout-num-gpus "${TOTAL_GPUS}"           # [vime] ... and rolls out on the same GPUs (vime forces this to the
                                               #   actor GPU count under --colocate; given explicitly for clarity)
  --num-gpus-per-node "${GPUS_PER_NODE}"       # [vime] GPUs per node (vime also sets it from the actor under --colocate)
  --colocate                                   # [vime] share GPUs; implies --offload-train and --offload-rollout:
                                               #   the actor sleeps (torch_memory_saver) during rollout, vLLM sleeps
                                               #   (sleep mode, added by vime) during training
)

# Model flags: needed for Megatron's validate_args and vime's HF-config equality check; the model itself is
# built by the bridge provider from --hf-checkpoint (vime/backends/megatron_utils/model_provider.py). No
# --spec / --custom-model-provider-path (they would bypass the bridge), no --untie-embeddings-and-output-weights
# (Gemma 4 ties them; vime checks it), no provider-owned flags (ignored in bridge mode).
MODEL_ARGS=(
  --num-layers 30                  # [megatron] = num_hidden_layers (checked by vime)
  --hidden-size 2816               # [megatron] = hidden_size (checked)
  --ffn-hidden-size 2112           # [megatron] = intermediate_size (dense MLP of every layer)
  --num-attention-heads 16         # [megatron] = num_attention_heads (checked)
  --group-query-attention          # [megatron] GQA
  --num-query-groups 8             # [megatron] = num_key_value_heads (sliding layers)
  --kv-channels 256                # [megatron] = head_dim (sliding layers; full layers use 512)
  --normalization RMSNorm          # [megatron]
  --norm-epsilon 1e-6              # [megatron] = rms_norm_eps (checked)
  --qk-layernorm                   # [megatron]
  --disable-bias-linear            # [megatron]
  --position-embedding-type rope   # [megatron]
  --rotary-base 10000              # [megatron] sliding-layer rope_theta
  --vocab-size 262144              # [megatron] = vocab_size
  --num-experts 128                # [megatron] = num_experts (required for EP > 1)
  --moe-ffn-hidden-size 704        # [megatron] = moe_intermediate_size (checked)
  --moe-router-topk 8              # [megatron] = top_k_experts
  --moe-token-dispatcher-type alltoall  # [megatron] copied onto the provider by vime
  --moe-aux-loss-coeff 0           # [megatron] copied onto the provider by vime
)

CKPT_ARGS=(
  --hf-checkpoint "${HF_CKPT}"     # [vime] vLLM weights, tokenizer, and (bridge mode) the Megatron model config
  --ref-load "${REF_LOAD}"         # [vime] torch_dist from `vime-gemma4 import` (an HF dir also works in bridge mode)
  --save "${SAVE_DIR}"             # [megatron, default reset by vime]
  --save-interval "${SAVE_INTERVAL}"  # [megatron, default reset by vime]
)
if [[ -f "${SAVE_DIR}/latest_checkpointed_iteration.txt" ]]; then
  CKPT_ARGS+=(--load "${SAVE_DIR}")  # [megatron, default reset by vime] resume this run
else
  # First run: vime loads --ref-load; bridge mode does not add these for us (raw mode does).
  CKPT_ARGS+=(
    --finetune                     # [megatron] iteration 0
    --no-load-optim                # [megatron] converted checkpoint: no optimizer state
    --no-load-rng                  # [megatron] ... and no RNG state
  )
fi

ROLLOUT_ARGS=(
  --prompt-data "${PROMPT_DATA}"   # [vime]
  --input-key "${INPUT_KEY}"       # [vime]
  --label-key "${LABEL_KEY}"       # [vime]
  --apply-chat-template            # [vime]
  --apply-chat-template-kwargs "${CHAT_TEMPLATE_KWARGS}"  # [vime]
  --rollout-shuffle                # [vime]
  --rm-type "${RM_TYPE}"           # [vime]
  --num-rollout "${NUM_ROLLOUT}"   # [vime]
  --rollout-batch-size "${ROLLOUT_BATCH_SIZE}"       # [vime]
  --n-samples-per-prompt "${N_SAMPLES_PER_PROMPT}"   # [vime]
  --rollout-max-response-len "${ROLLOUT_MAX_RESPONSE_LEN}"  # [vime]
  --rollout-temperature "${ROLLOUT_TEMPERATURE}"     # [vime]
  --num-steps-per-rollout "${NUM_STEPS_PER_ROLLOUT}" # [vime]
  --global-batch-size "${GLOBAL_BATCH_SIZE}"         # [megatron, default reset by vime] = 16 x 8 / 1 = 128
  --balance-data                   # [vime]
)

# Memory per GPU while training (vLLM asleep); 25.23e9 params in total, the same per-GPU shard as the
# 4x8 recipe (PP2: 15 layers per stage; TP2 halves attention/MLP/embedding; EP4 x ETP1: 32 experts/GPU):
#   dense ~0.79e9 + experts 15 x 761.3e6 / (EP4 x ETP1) = 2.85e9 => 3.64e9 params/GPU:
#   bf16 weights 7.3 GB + fp32 grad buffer 14.6 GB = 21.9 GB (20.4 GiB) static on a ~39.5 GiB A800.
#   Adam 12 B/param over dense DP = 8/(TP2·PP2) = 2 and expert DP = 8/(ETP1·EP4·PP2) = 1:
#   0.79e9x12/2 + 2.85e9x12/1 = 39.0 GB/GPU -> cannot stay on the GPU: --optimizer-cpu-offload puts it on
#   the host, 8 x 39.0 = 312 GB of host RAM per node at NNODES=1 (NNODES=4: DP 8, expert DP 4 ->
#   9.75 GB/GPU, 78 GB per node). While rolling out, the sleeping actor gives its GPU memory back.
PERF_ARGS=(
  --tensor-model-parallel-size "${TP}"     # [megatron] TP2 (16 heads / 8 KV heads / 2 global KV heads divide)
  --sequence-parallel                      # [megatron]
  --pipeline-model-parallel-size "${PP}"   # [megatron] PP2: 15 + 15 layers
  --context-parallel-size "${CP}"          # [megatron]
  --expert-model-parallel-size "${EP}"     # [megatron] EP4: 32 experts per GPU (ETP·EP·PP = 8 = one node)
  --expert-tensor-parallel-size "${ETP}"   # [megatron] ETP1: whole expert GEMMs, no expert-TP collectives
  --recompute-granularity full             # [megatron]
  --recompute-method uniform               # [megatron]
  --recompute-num-layers 1                 # [megatron]
  --use-dynamic-batch-size                 # [vime]
  --max-tokens-per-gpu "${MAX_TOKENS_PER_GPU}"  # [vime] >= one 6144-token sample; logits 8192 x 131072 x 4 B = 4.3 GB
  --calculate-per-token-loss               # [megatron, reset by vime]
)

GRPO_ARGS=(
  --advantage-estimator grpo       # [vime]
  --entropy-coef 0.0               # [vime]
  --eps-clip 0.2                   # [vime]
  --eps-clip-high 0.28             # [vime]
)
if [[ "${USE_KL_LOSS}" == 1 ]]; then
  GRPO_ARGS+=(
    --use-kl-loss                  # [vime]
    --kl-loss-coef "${KL_LOSS_COEF}"  # [vime]
    --kl-loss-type low_var_kl      # [vime]
  )
fi

OPTIMIZER_ARGS=(
  --optimizer adam                 # [megatron]
  --lr "${LR}"                     # [megatron, default reset by vime]
  --lr-decay-style constant        # [megatron]
  --weight-decay 0.1               # [megatron]
  --adam-beta1 0.9                 # [megatron]
  --adam-beta2 0.98                # [megatron]
  --optimizer-cpu-offload          # [megatron] Adam state on the host (arithmetic above)
  --overlap-cpu-optimizer-d2h-h2d  # [megatron]
  --use-precision-aware-optimizer  # [megatron]
)
if (( NNODES >= 2 )); then
  OPTIMIZER_ARGS+=(--dist-ckpt-optim-fully-reshardable)  # [megatron] resumable PAO+offload checkpoints (vime's advice
                                                         #   for >= 2 nodes; on one node it can OOM the host at save)
fi

# Rollout while the actor sleeps: TOTAL_GPUS / 4 engines x TP4 (2 engines on one node). Each GPU holds
# 12.6 GB (11.8 GiB) of bf16 weights; 0.7 of ~39.5 GiB = 27.7 GiB leaves ~14 GiB for KV cache and CUDA
# graphs, and ~12 GiB for what the sleeping actor process still holds (CUDA context, allocator).
VLLM_ARGS=(
  --rollout-num-gpus-per-engine "${ROLLOUT_GPUS_PER_ENGINE}"  # [vime] TP4 engines inside a node
  --vllm-gpu-memory-utilization "${VLLM_GPU_MEMORY_UTILIZATION}"  # [vllm] share of each GPU vLLM may take
  --vllm-max-model-len "$(( ROLLOUT_MAX_RESPONSE_LEN + PROMPT_BUDGET ))"  # [vllm]
  --vllm-max-num-seqs "${VLLM_MAX_NUM_SEQS}"                  # [vllm]
  --vllm-max-cudagraph-capture-size "${VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE}"  # [vllm]
  --vllm-server-concurrency "${VLLM_SERVER_CONCURRENCY}"      # [vime-vllm]
  --vllm-language-model-only                                  # [vllm] text model only: no vision tower in GPU memory
)

MISC_ARGS=(
  --accumulate-allreduce-grads-in-fp32   # [megatron] fp32 grad buffer (counted above)
  --loss-mask-type gemma4                # [vime]
  --megatron-to-hf-mode bridge           # [vime] this plugin's bridge for Megatron->HF
  --update-weight-mode full              # [vime] every tensor at every sync (over CUDA IPC when colocated)
  --update-weight-buffer-size "${UPDATE_WEIGHT_BUFFER_SIZE}"  # [vime] 512 MiB chunks: the transient GPU copy
                                         #   while vLLM is awake must stay small
)
if [[ "${CHECK_WEIGHT_UPDATE_EQUAL}" == 1 ]]; then
  MISC_ARGS+=(--check-weight-update-equal)  # [vime] bitwise check of the first actor->rollout update
fi

TRAIN_ARGS=(
  "${CLUSTER_ARGS[@]}" "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}"
  "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${VLLM_ARGS[@]}" "${MISC_ARGS[@]}"
)
RUNTIME_ENV_JSON="{\"env_vars\": {\"PYTHONPATH\": \"${MEGATRON_LM_DIR}\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\", \"VIME_GEMMA4_BRIDGE_AUTOLOAD\": \"${VIME_GEMMA4_BRIDGE_AUTOLOAD}\"}}"
SUBMIT_CMD=(
  ray job submit --address="http://127.0.0.1:${RAY_DASHBOARD_PORT}" --runtime-env-json="${RUNTIME_ENV_JSON}"
  -- "${PYTHON}" "${VIME_DIR}/train.py" "${TRAIN_ARGS[@]}"
)

if [[ "${DRY_RUN}" == 1 ]]; then
  echo "RECIPE=gemma4-26b-a4b-colocated"
  echo "NNODES=${NNODES}"
  echo "GPUS_PER_NODE=${GPUS_PER_NODE}"
  echo "VIME_GEMMA4_BRIDGE_AUTOLOAD=$(printenv VIME_GEMMA4_BRIDGE_AUTOLOAD || true)"
  printf 'CMD:'; printf ' %q' "${SUBMIT_CMD[@]}"; echo
  exit 0
fi

# ------------------------------------------------------------------------------------------------
# Launch
# ------------------------------------------------------------------------------------------------
if (( NODE_RANK > 0 )); then
  exec ray start --address="${MASTER_ADDR}:${RAY_PORT}" --num-gpus "${GPUS_PER_NODE}" --disable-usage-stats --block
fi

for path in "${HF_CKPT}/config.json" "${REF_LOAD}" "${PROMPT_DATA}" "${VIME_DIR}/train.py"; do
  [[ -e "${path}" ]] || { echo "missing: ${path} (see recipes/README.md for the conversion pre-step)" >&2; exit 1; }
done
mkdir -p "${SAVE_DIR}"

if [[ "${SKIP_TOPOLOGY_CHECK:-0}" != 1 ]]; then
  "${PYTHON}" - "${HF_CKPT}/config.json" "${TP}" "${PP}" "${EP}" "${ETP}" "${TOTAL_GPUS}" <<'PY'
import json, sys
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.model_split import validate_model_topology
config_path, tp, pp, ep, etp, world = sys.argv[1], *map(int, sys.argv[2:])
topology = Topology(tp=tp, pp=pp, ep=ep, etp=etp)
topology.validate(world)
with open(config_path) as f:
    validate_model_topology(json.load(f), topology)
print(f"topology OK: {topology} on {world} actor GPUs")
PY
fi

cd "${VIME_DIR}"
ray start --head --node-ip-address "${MASTER_ADDR}" --port "${RAY_PORT}" --num-gpus "${GPUS_PER_NODE}" \
  --disable-usage-stats --dashboard-host=0.0.0.0 --dashboard-port="${RAY_DASHBOARD_PORT}"
"${SUBMIT_CMD[@]}"
