#!/usr/bin/env bash
# Gemma 4 26B-A4B GRPO with vime, --megatron-to-hf-mode bridge, on ONE node of 8 GPUs, disaggregated:
# GPUs 0-3 = Megatron actor (TP2·PP1·EP4·ETP1), GPUs 4-7 = 2 vLLM engines x TP2.
# Needs 80 GB GPUs (A800/A100/H800/H100 80 GB, H200): the 4 actor GPUs hold all 25.23e9 parameters
# (arithmetic at PERF_ARGS). On one node of 40 GB cards use gemma4-26b-a4b-colocated.sh instead.
#
#   bash recipes/gemma4-26b-a4b-1x8.sh                         # launch (Ray head on this node)
#   DRY_RUN=1 bash recipes/gemma4-26b-a4b-1x8.sh               # print the resolved command only
#   UPDATE_WEIGHT_TRANSPORT=disk bash recipes/gemma4-26b-a4b-1x8.sh   # the reported disk sync path, on one node
#
# Pre-step (once), same converter as the 4x8 recipe, at this recipe's topology:
#   vime-gemma4 import --hf-checkpoint "$HF_CKPT" --save "$TORCH_DIST" --tp 2 --pp 1 --ep 4 --etp 1 --nproc 4
# (torch_dist reshards on load, so the 4x8 recipe's TP2·PP2·EP4 import also works: set TORCH_DIST to it.)
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
VIME_DIR=${VIME_DIR:-/root/vime}               # vime checkout (train.py)
MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-/root/Megatron-LM}
BASE_DIR=${BASE_DIR:-/root}

# Actor parallelism (memory notes at PERF_ARGS).
TP=${TP:-2}
PP=${PP:-1}
EP=${EP:-4}
ETP=${ETP:-1}
CP=${CP:-1}

HF_CKPT=${HF_CKPT:-${BASE_DIR}/gemma-4-26B-A4B-it}
TORCH_DIST=${TORCH_DIST:-${BASE_DIR}/gemma-4-26B-A4B-it_torch_dist_tp${TP}pp${PP}ep${EP}etp${ETP}}  # from `vime-gemma4 import`
REF_LOAD=${REF_LOAD:-${TORCH_DIST}}
OUTPUT_DIR=${OUTPUT_DIR:-${BASE_DIR}/vime_output/gemma4-26b-a4b-1x8}
SAVE_DIR=${SAVE_DIR:-${OUTPUT_DIR}/ckpt}
SAVE_INTERVAL=${SAVE_INTERVAL:-20}
UPDATE_WEIGHT_TRANSPORT=${UPDATE_WEIGHT_TRANSPORT:-nccl}  # nccl (vime's default) or disk
UPDATE_WEIGHT_DISK_DIR=${UPDATE_WEIGHT_DISK_DIR:-${OUTPUT_DIR}/weight_sync}  # used with disk; one host, local is fine
KEEP_WEIGHT_FILES=${KEEP_WEIGHT_FILES:-0}      # disk only: keep weight_vNNNNNN dirs (~50.5 GB each)
CHECK_WEIGHT_UPDATE_EQUAL=${CHECK_WEIGHT_UPDATE_EQUAL:-1}

PROMPT_DATA=${PROMPT_DATA:-${BASE_DIR}/datasets/dapo-math-17k/dapo-math-17k.jsonl}
INPUT_KEY=${INPUT_KEY:-prompt}
LABEL_KEY=${LABEL_KEY:-label}
RM_TYPE=${RM_TYPE:-math}
CHAT_TEMPLATE_KWARGS=${CHAT_TEMPLATE_KWARGS:-'{}'}

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ACTOR_NUM_NODES=${ACTOR_NUM_NODES:-1}
ACTOR_GPUS_PER_NODE=${ACTOR_GPUS_PER_NODE:-4}
ROLLOUT_NUM_GPUS=${ROLLOUT_NUM_GPUS:-4}
ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-2}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}

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

VLLM_GPU_MEMORY_UTILIZATION=${VLLM_GPU_MEMORY_UTILIZATION:-0.85}
VLLM_MAX_NUM_SEQS=${VLLM_MAX_NUM_SEQS:-128}
VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE=${VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE:-${VLLM_MAX_NUM_SEQS}}
VLLM_SERVER_CONCURRENCY=${VLLM_SERVER_CONCURRENCY:-256}
UPDATE_WEIGHT_BUFFER_SIZE=${UPDATE_WEIGHT_BUFFER_SIZE:-$((512 * 1024 * 1024))}

# ------------------------------------------------------------------------------------------------
# Plugin activation: the package's .pth imports vime_gemma4_bridge in every Python process when this is
# set, so Megatron-Bridge's AutoBridge resolves Gemma 4 to the plugin's bridges; vime is not edited.
# ------------------------------------------------------------------------------------------------
export VIME_GEMMA4_BRIDGE_AUTOLOAD=1
export PYTHONUNBUFFERED=1
if [[ "${DRY_RUN}" != 1 || "${SKIP_PREFLIGHT}" != 1 ]]; then
  "${PYTHON}" -c "import vime_gemma4_bridge" || {
    echo "vime_gemma4_bridge is not importable by ${PYTHON}: run 'pip install --no-deps -e <vime_gemma4_bridge checkout>'" >&2
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
  --actor-num-nodes "${ACTOR_NUM_NODES}"            # [vime] one node
  --actor-num-gpus-per-node "${ACTOR_GPUS_PER_NODE}" # [vime] 4 actor GPUs = TP2 x DP2 (experts: EP4)
  --rollout-num-gpus "${ROLLOUT_NUM_GPUS}"           # [vime] the other 4 GPUs of the node run vLLM
  --num-gpus-per-node "${GPUS_PER_NODE}"             # [vime] 8: rollout engines start at GPU 4 (after the actor)
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
  --rollout-batch-size "${ROLLOUT_BATCH_SIZE}"       # [vime] 16 prompts ...
  --n-samples-per-prompt "${N_SAMPLES_PER_PROMPT}"   # [vime] ... x 8 samples
  --rollout-max-response-len "${ROLLOUT_MAX_RESPONSE_LEN}"  # [vime]
  --rollout-temperature "${ROLLOUT_TEMPERATURE}"     # [vime]
  --num-steps-per-rollout "${NUM_STEPS_PER_ROLLOUT}" # [vime]
  --global-batch-size "${GLOBAL_BATCH_SIZE}"         # [megatron, default reset by vime] = 16 x 8 / 1 = 128
  --balance-data                   # [vime] balance the 2 data-parallel ranks
)

# Memory per actor GPU (25.23e9 params; PP1 keeps one copy of the tied embedding):
#   dense   (1.65e9 attention+MLP of 30 layers + 0.74e9 embedding) / TP2 + 11e6 router/norms ~ 1.20e9
#   experts 30 layers x 761.3e6 / (EP4 x ETP1)                                            = 5.71e9
#   => 6.91e9 params/GPU: bf16 weights 13.8 GB + fp32 grad buffer 27.7 GB = 41.5 GB (38.6 GiB) before
#      activations: more than a 40 GB card, ~half of an 80 GB one. Adam (12 B/param, distributed over
#      dense DP = 4/TP2 = 2 and expert DP = 4/(ETP1·EP4·PP1) = 1) would add 1.20e9x12/2 + 5.71e9x12 =
#      75.7 GB/GPU, so it lives on the host (--optimizer-cpu-offload): 4 x 75.7 = 303 GB of host RAM.
#   With 4 actor GPUs the 22.84e9 expert params are >= 5.71e9 per GPU whatever the split (PP2 would need
#   ETP·EP·PP = 8 GPUs for EP4), which is why this recipe needs 80 GB cards.
PERF_ARGS=(
  --tensor-model-parallel-size "${TP}"     # [megatron] TP2 (16 heads / 8 KV heads / 2 global KV heads divide)
  --sequence-parallel                      # [megatron]
  --pipeline-model-parallel-size "${PP}"   # [megatron] PP1: no pipeline on one node's 4 actor GPUs
  --context-parallel-size "${CP}"          # [megatron]
  --expert-model-parallel-size "${EP}"     # [megatron] EP4: 32 experts per GPU, the reported EP boundaries
  --expert-tensor-parallel-size "${ETP}"   # [megatron] ETP1: whole expert GEMMs (ETP·EP·PP = 4 = actor GPUs)
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
  --optimizer-cpu-offload          # [megatron] 75.7 GB/GPU of Adam state to the host (see above)
  --overlap-cpu-optimizer-d2h-h2d  # [megatron]
  --use-precision-aware-optimizer  # [megatron]
  # no --dist-ckpt-optim-fully-reshardable: on a single node vime warns it can OOM the host at save time
)

# Rollout: 2 engines x TP2 on GPUs 4-7: 25.2 GB (23.5 GiB) of bf16 weights per GPU, ~40 GiB of KV cache
# at 0.85 of an 80 GB card. TP2 divides the heads (16), KV heads (8) and global KV heads (2).
VLLM_ARGS=(
  --rollout-num-gpus-per-engine "${ROLLOUT_GPUS_PER_ENGINE}"  # [vime] 2 GPUs per engine -> 2 engines
  --vllm-gpu-memory-utilization "${VLLM_GPU_MEMORY_UTILIZATION}"  # [vllm]
  --vllm-max-model-len "$(( ROLLOUT_MAX_RESPONSE_LEN + PROMPT_BUDGET ))"  # [vllm]
  --vllm-max-num-seqs "${VLLM_MAX_NUM_SEQS}"                  # [vllm]
  --vllm-max-cudagraph-capture-size "${VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE}"  # [vllm]
  --vllm-server-concurrency "${VLLM_SERVER_CONCURRENCY}"      # [vime-vllm]
  --vllm-language-model-only                                  # [vllm] text model only, as the bridge publishes
)

MISC_ARGS=(
  --accumulate-allreduce-grads-in-fp32   # [megatron] fp32 grad buffer (counted above)
  --loss-mask-type gemma4                # [vime]
  --megatron-to-hf-mode bridge           # [vime] this plugin's bridge for Megatron->HF
  --update-weight-mode full              # [vime]
  --update-weight-transport "${UPDATE_WEIGHT_TRANSPORT}"  # [vime] nccl: broadcast to the engines; disk: via files
  --update-weight-buffer-size "${UPDATE_WEIGHT_BUFFER_SIZE}"  # [vime] 512 MiB export chunks
)
if [[ "${UPDATE_WEIGHT_TRANSPORT}" == disk ]]; then
  MISC_ARGS+=(--update-weight-disk-dir "${UPDATE_WEIGHT_DISK_DIR}")  # [vime] required by disk transport
  if [[ "${KEEP_WEIGHT_FILES}" == 1 ]]; then
    MISC_ARGS+=(--update-weight-disk-keep-files)  # [vime]
  fi
fi
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
  echo "RECIPE=gemma4-26b-a4b-1x8"
  echo "NNODES=${NNODES}"
  echo "GPUS_PER_NODE=${GPUS_PER_NODE}"
  echo "VIME_GEMMA4_BRIDGE_AUTOLOAD=$(printenv VIME_GEMMA4_BRIDGE_AUTOLOAD || true)"
  printf 'CMD:'; printf ' %q' "${SUBMIT_CMD[@]}"; echo
  exit 0
fi

# ------------------------------------------------------------------------------------------------
# Launch
# ------------------------------------------------------------------------------------------------
for path in "${HF_CKPT}/config.json" "${REF_LOAD}" "${PROMPT_DATA}" "${VIME_DIR}/train.py"; do
  [[ -e "${path}" ]] || { echo "missing: ${path} (see recipes/README.md for the conversion pre-step)" >&2; exit 1; }
done
mkdir -p "${SAVE_DIR}"
if [[ "${UPDATE_WEIGHT_TRANSPORT}" == disk ]]; then mkdir -p "${UPDATE_WEIGHT_DISK_DIR}"; fi

if [[ "${SKIP_TOPOLOGY_CHECK:-0}" != 1 ]]; then
  "${PYTHON}" - "${HF_CKPT}/config.json" "${TP}" "${PP}" "${EP}" "${ETP}" "$(( ACTOR_NUM_NODES * ACTOR_GPUS_PER_NODE ))" <<'PY'
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
