#!/usr/bin/env bash
# Gemma 4 26B-A4B GRPO with miles (radixark/miles v0.1.0 / main @31f1ca96), --megatron-to-hf-mode bridge,
# with this plugin serving Gemma 4: miles' own recipe (scripts/run_gemma_4_26b_a4b.py, its resolved command
# tests/snapshots/launch_scripts/py/scripts/run_gemma_4_26b_a4b.py/full_train.txt) on ONE node of 8 x H200,
# COLOCATED, actor TP4·EP8·ETP1, two SGLang engines x TP4, plus one flag: the plugin's init hook.
#
#   bash recipes/miles-gemma4-26b-a4b-1x8-h200.sh             # launch (needs miles' image + this plugin)
#   DRY_RUN=1 bash recipes/miles-gemma4-26b-a4b-1x8-h200.sh   # print the command only
#
# What the plugin changes in miles: nothing in its files. --custom-megatron-init-path runs
# vime_gemma4_bridge.miles_init(args) on every training rank before the model is built
# (miles/backends/megatron_utils/initialize.py L129-133): it registers the plugin's Gemma 4 bridges (they win
# over the fork's Gemma4VLBridge whatever the import order) and refuses, in one line, a launch miles cannot
# carry with Gemma 4 (raw mode, non-colocated sync, the release's two-field export, FP8 with stacked experts).
# Flag sources: [miles] miles/utils/arguments.py; [sglang] SGLang ServerArgs re-exported as --sglang-* by
# miles/backends/sglang_utils/arguments.py; [megatron] megatron/training/arguments.py.
set -euo pipefail

DRY_RUN=${DRY_RUN:-0}                          # 1: print the resolved command and exit 0, launch nothing
SKIP_PREFLIGHT=${SKIP_PREFLIGHT:-0}            # 1 with DRY_RUN=1: skip the plugin preflight (repeated dry runs)
PYTHON=${PYTHON:-python3}                      # interpreter of miles' image (the plugin must be installed in it)
MILES_DIR=${MILES_DIR:-/root/miles}
MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-/root/Megatron-LM}
BASE_DIR=${BASE_DIR:-/root}

TP=${TP:-4}
EP=${EP:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-4}
HF_CKPT=${HF_CKPT:-${BASE_DIR}/models/gemma-4-26B-A4B-it}
SAVE_DIR=${SAVE_DIR:-${BASE_DIR}/miles_output/gemma4-26b-a4b-1x8-h200/checkpoints}
PROMPT_DATA=${PROMPT_DATA:-${BASE_DIR}/datasets/dapo-math-17k/dapo-math-17k.jsonl}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}

# ------------------------------------------------------------------------------------------------
# Plugin activation and preflight: `vime-gemma4 env --miles` exits 1, with the reason, when miles' bridge road
# cannot use this image's Megatron-Bridge (miles unpacks the fork's three-field export). Not under DRY_RUN,
# which may run on another machine.
# ------------------------------------------------------------------------------------------------
export VIME_GEMMA4_BRIDGE_AUTOLOAD=1
export PYTHONUNBUFFERED=1
if [[ "${DRY_RUN}" != 1 || "${SKIP_PREFLIGHT}" != 1 ]]; then
  "${PYTHON}" -c "import vime_gemma4_bridge" || {
    echo "vime_gemma4_bridge is not importable by ${PYTHON}: run 'pip install --no-deps -e <vime_gemma4_bridge checkout>' in miles' image" >&2
    exit 1
  }
  PREFLIGHT=(env)
  [[ "${DRY_RUN}" == 1 ]] || PREFLIGHT+=(--miles)
  "${PYTHON}" -m vime_gemma4_bridge.cli "${PREFLIGHT[@]}" >&2 || {
    echo "preflight failed: see 'vime-gemma4 ${PREFLIGHT[*]}' above" >&2
    exit 1
  }
fi

# scripts/models/gemma-4-26b-a4b-it.py @31f1ca96: Megatron's validate_args needs the shape; the model itself is
# built by the bridge's provider from --hf-checkpoint (model_provider.py L163-196).
MODEL_ARGS=(
  --disable-bias-linear --group-query-attention  # [megatron]
  --num-attention-heads 16 --num-query-groups 8 --kv-channels 256  # [megatron] sliding layers' attention
  --num-layers 30 --hidden-size 2816 --ffn-hidden-size 2112        # [megatron]
  --normalization RMSNorm --norm-epsilon 1e-06   # [megatron]
  --position-embedding-type rope --rotary-base 1000000  # [megatron]
  --vocab-size 262144 --make-vocab-size-divisible-by 128 --max-position-embeddings 262144  # [megatron]
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 704  # [megatron]
  --moe-router-score-function softmax --moe-grouped-gemm --moe-router-dtype fp32  # [megatron]
  --moe-router-load-balancing-type seq_aux_loss --moe-router-bias-update-rate 0 --moe-aux-loss-coeff 0  # [megatron]
)
CKPT_ARGS=(
  --hf-checkpoint "${HF_CKPT}"     # [miles] SGLang's weights and the bridge's model config
  --ref-load "${HF_CKPT}"          # [miles] an HF directory: loaded through the bridge (checkpoint.py L179-187)
  --megatron-to-hf-mode bridge     # [miles] Megatron -> HF through Megatron-Bridge (the plugin's bridge)
  --custom-megatron-init-path vime_gemma4_bridge.miles_init  # [miles] the plugin's hook (see the header)
  --load "${SAVE_DIR}" --save "${SAVE_DIR}" --save-interval 20  # [megatron]
)
ROLLOUT_ARGS=(
  --prompt-data "${PROMPT_DATA}" --input-key prompt --label-key label  # [miles]
  --apply-chat-template --rollout-shuffle --balance-data --rm-type gemma_math  # [miles]
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8  # [miles]
  --rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256  # [miles] / [megatron]
)
# Per GPU: 25.23e9 params; TP4 splits the dense part (~2.4e9 / 4), EP8 the experts (22.84e9 / 8): ~3.4e9
# params, 6.9 GB bf16 + 13.7 GB fp32 grads + Adam 12 B/param over DP2 (dense) / 1 (experts) ~37 GB: fits 141 GB.
PERF_ARGS=(
  --tensor-model-parallel-size "${TP}" --sequence-parallel  # [megatron]
  --pipeline-model-parallel-size 1 --context-parallel-size 1  # [megatron]
  --expert-model-parallel-size "${EP}" --expert-tensor-parallel-size 1  # [megatron]
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1  # [megatron]
  --use-dynamic-batch-size --max-tokens-per-gpu 1024  # [miles]
)
GRPO_ARGS=(
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl  # [miles]
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28  # [miles]
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98  # [megatron]
)
SGLANG_ARGS=(
  --rollout-num-gpus-per-engine "${ROLLOUT_GPUS_PER_ENGINE}"  # [miles] 2 engines x TP4
  --sglang-mem-fraction-static 0.55          # [sglang]
  --sglang-attention-backend triton          # [sglang] global head_dim 512 exceeds FlashAttention's 256
  --sglang-moe-runner-backend triton         # [sglang]
  --sglang-disable-custom-all-reduce --sglang-disable-cuda-graph  # [sglang]
  --sglang-disable-overlap-schedule --sglang-disable-radix-cache  # [sglang]
  --no-offload-train --no-offload-rollout    # [miles] H200s hold both sides
  --use-rollout-routing-replay               # [miles]
)
MISC_ARGS=(
  --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32  # [megatron]
  --no-gradient-accumulation-fusion --no-check-for-nan-in-loss-and-grad  # [megatron]
  --attention-softmax-in-fp32 --attention-backend unfused --qkv-format bshd  # [megatron]
  --colocate                                 # [miles] the only road on which miles syncs Gemma 4's full weights
  --actor-num-nodes 1 --actor-num-gpus-per-node "${GPUS_PER_NODE}" --num-gpus-per-node "${GPUS_PER_NODE}"  # [miles]
)

TRAIN_ARGS=(
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}"
  "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}"
)
RUNTIME_ENV_JSON="{\"env_vars\": {\"PYTHONPATH\": \"${MILES_DIR}:${MEGATRON_LM_DIR}\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\", \"NCCL_NVLS_ENABLE\": \"0\", \"VIME_GEMMA4_BRIDGE_AUTOLOAD\": \"${VIME_GEMMA4_BRIDGE_AUTOLOAD}\"}}"
SUBMIT_CMD=(
  ray job submit --address="http://127.0.0.1:${RAY_DASHBOARD_PORT}" --runtime-env-json="${RUNTIME_ENV_JSON}"
  -- "${PYTHON}" "${MILES_DIR}/train.py" "${TRAIN_ARGS[@]}"
)

if [[ "${DRY_RUN}" == 1 ]]; then
  echo "RECIPE=miles-gemma4-26b-a4b-1x8-h200"
  echo "NNODES=1"
  echo "GPUS_PER_NODE=${GPUS_PER_NODE}"
  printf 'CMD:'; printf ' %q' "${SUBMIT_CMD[@]}"; echo
  exit 0
fi

for path in "${HF_CKPT}/config.json" "${PROMPT_DATA}" "${MILES_DIR}/train.py"; do
  [[ -e "${path}" ]] || { echo "missing: ${path}" >&2; exit 1; }
done
mkdir -p "${SAVE_DIR}"
cd "${MILES_DIR}"
ray start --head --node-ip-address 127.0.0.1 --num-gpus "${GPUS_PER_NODE}" --disable-usage-stats \
  --dashboard-port="${RAY_DASHBOARD_PORT}"
"${SUBMIT_CMD[@]}"
