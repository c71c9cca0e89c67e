#!/usr/bin/env bash
# Gemma 4 26B-A4B GRPO with vime, --megatron-to-hf-mode bridge, on the layout of the bug report:
# 4 nodes x 8 A800 40 GB, disaggregated: actor = 2 whole nodes (16 GPUs, TP2·PP2·EP4·ETP1),
# rollout = the other 2 nodes (16 GPUs, 4 vLLM engines x TP4), full weight updates written to a
# shared directory (--update-weight-transport disk) and checked bitwise (--check-weight-update-equal).
#
# Run the SAME script on every node (it exports the plugin switch before `ray start` on each):
#   head   : MASTER_ADDR=<head ip> NODE_RANK=0 bash recipes/gemma4-26b-a4b-4x8-a800-disaggregated-disk.sh
#   workers: MASTER_ADDR=<head ip> NODE_RANK=1|2|3 bash recipes/gemma4-26b-a4b-4x8-a800-disaggregated-disk.sh
# Print the resolved command without launching anything: DRY_RUN=1 bash recipes/<this file>
#
# Pre-step (once): HF -> torch_dist with the plugin's converter (see recipes/README.md):
#   vime-gemma4 import --hf-checkpoint "$HF_CKPT" --save "$TORCH_DIST" --tp 2 --pp 2 --ep 4 --etp 1 --nproc 8
# Post-step: check a published weight directory, or export a trained checkpoint back to HF:
#   vime-gemma4 verify-update --hf-checkpoint "$HF_CKPT" --dump "$UPDATE_WEIGHT_DISK_DIR/weight_v000001"
#   vime-gemma4 export --load "$SAVE_DIR" --hf-checkpoint "$HF_CKPT" --output "$HF_OUT" --tp 2 --pp 2 --ep 4 --etp 1 --nproc 8
#
# Where flags come from (checked against vllm-project/vime and megatron-core 0.19.2):
#   [vime]    vime/utils/arguments.py (get_vime_extra_args_provider)
#   [vllm]    vLLM EngineArgs, re-exported with a --vllm- prefix by vime/backends/vllm_utils/arguments.py
#   [vime-vllm] vime-only --vllm-* knob defined in vime/backends/vllm_utils/arguments.py
#   [megatron] megatron/training/arguments.py (vime parses Megatron's arguments, ignore_unknown_args)
set -euo pipefail

# ------------------------------------------------------------------------------------------------
# Settings (every one can be overridden from the environment)
# ------------------------------------------------------------------------------------------------
DRY_RUN=${DRY_RUN:-0}                          # 1: print the resolved command and exit 0, launch nothing
SKIP_PREFLIGHT=${SKIP_PREFLIGHT:-0}            # 1 with DRY_RUN=1: skip the plugin preflight (repeated dry runs)
PYTHON=${PYTHON:-python3}                      # interpreter of the vime image (the plugin must be installed in it)
VIME_DIR=${VIME_DIR:-/root/vime}               # vime checkout (train.py lives here)
MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-/root/Megatron-LM}  # put on PYTHONPATH of the Ray job, as vime's own scripts do
BASE_DIR=${BASE_DIR:-/root}

# Actor parallelism (see the memory notes at PERF_ARGS / OPTIMIZER_ARGS).
TP=${TP:-2}
PP=${PP:-2}
EP=${EP:-4}
ETP=${ETP:-1}
CP=${CP:-1}

HF_CKPT=${HF_CKPT:-${BASE_DIR}/gemma-4-26B-A4B-it}                  # original HF checkpoint (VL, text under model.language_model.*)
TORCH_DIST=${TORCH_DIST:-${BASE_DIR}/gemma-4-26B-A4B-it_torch_dist_tp${TP}pp${PP}ep${EP}etp${ETP}}  # written by `vime-gemma4 import`
REF_LOAD=${REF_LOAD:-${TORCH_DIST}}                                  # reference / initial weights
OUTPUT_DIR=${OUTPUT_DIR:-${BASE_DIR}/vime_output/gemma4-26b-a4b-4x8}
SAVE_DIR=${SAVE_DIR:-${OUTPUT_DIR}/ckpt}                             # Megatron checkpoints of this run (resume from here)
SAVE_INTERVAL=${SAVE_INTERVAL:-20}
# Must be ONE filesystem mounted at the same path on all 4 nodes (NFS/Lustre/...): actor rank 0 writes,
# the rollout nodes read (vime scripts/README-disk-weight-sync.md).
UPDATE_WEIGHT_DISK_DIR=${UPDATE_WEIGHT_DISK_DIR:-${OUTPUT_DIR}/weight_sync}
KEEP_WEIGHT_FILES=${KEEP_WEIGHT_FILES:-1}      # 1: keep every weight_vNNNNNN dir for `vime-gemma4 verify-update`
                                               #    (each is ~50.5 GB: 25.23e9 params x 2 B) -- set 0 for long runs
CHECK_WEIGHT_UPDATE_EQUAL=${CHECK_WEIGHT_UPDATE_EQUAL:-1}

PROMPT_DATA=${PROMPT_DATA:-${BASE_DIR}/datasets/dapo-math-17k/dapo-math-17k.jsonl}
INPUT_KEY=${INPUT_KEY:-prompt}
LABEL_KEY=${LABEL_KEY:-label}
RM_TYPE=${RM_TYPE:-math}
CHAT_TEMPLATE_KWARGS=${CHAT_TEMPLATE_KWARGS:-'{}'}

# Cluster: 4 nodes x 8 GPUs = 32 GPUs = 16 actor + 16 rollout.
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ACTOR_NUM_NODES=${ACTOR_NUM_NODES:-2}
ACTOR_GPUS_PER_NODE=${ACTOR_GPUS_PER_NODE:-8}
ROLLOUT_NUM_GPUS=${ROLLOUT_NUM_GPUS:-16}
ROLLOUT_GPUS_PER_ENGINE=${ROLLOUT_GPUS_PER_ENGINE:-4}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
NODE_RANK=${NODE_RANK:-0}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}

NUM_ROLLOUT=${NUM_ROLLOUT:-100}
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-32}
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
VLLM_MAX_NUM_SEQS=${VLLM_MAX_NUM_SEQS:-64}
VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE=${VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE:-${VLLM_MAX_NUM_SEQS}}
VLLM_SERVER_CONCURRENCY=${VLLM_SERVER_CONCURRENCY:-128}
UPDATE_WEIGHT_BUFFER_SIZE=${UPDATE_WEIGHT_BUFFER_SIZE:-$((512 * 1024 * 1024))}

# ------------------------------------------------------------------------------------------------
# Plugin activation: with VIME_GEMMA4_BRIDGE_AUTOLOAD=1 the package's .pth imports vime_gemma4_bridge
# in every Python process (the Ray actors included), which registers the plugin's Gemma 4 bridges with
# Megatron-Bridge's AutoBridge. vime itself is not edited. Exported before `ray start` (Ray workers
# inherit the raylet's environment) and repeated in the job's runtime env below.
# ------------------------------------------------------------------------------------------------
export VIME_GEMMA4_BRIDGE_AUTOLOAD=1
export PYTHONUNBUFFERED=1
# Preflight: fail fast (on every node) if the plugin is not installed in this image.
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
  --actor-num-nodes "${ACTOR_NUM_NODES}"            # [vime] nodes of the Megatron actor (2 whole nodes)
  --actor-num-gpus-per-node "${ACTOR_GPUS_PER_NODE}" # [vime] actor GPUs per node: 2 x 8 = 16 = TP2·PP2 x DP4
  --rollout-num-gpus "${ROLLOUT_NUM_GPUS}"           # [vime] vLLM GPUs (the other 2 nodes). vime makes ONE PACK placement
                                                     #   group sorted by (node ip, gpu) and gives the first 16 bundles to the
                                                     #   actor (vime/ray/placement_group.py): whole nodes, so every TP pair and
                                                     #   EP4 group stays on one node's NVLink; only PP2 send/recv crosses nodes
  --num-gpus-per-node "${GPUS_PER_NODE}"             # [vime] GPUs per node, used to place the rollout engines
)

# Megatron model flags. In bridge mode vime does NOT build the model from these: model_provider.py calls
# AutoBridge.from_hf_pretrained(--hf-checkpoint).to_megatron_provider() (this plugin's Gemma 4 provider),
# copies TP/PP/EP/ETP/SP/CP, recompute, dispatcher and aux-loss settings onto it, and copies other args
# only where the provider has no such field. They are still required because (1) Megatron's own
# validate_args needs num-layers/hidden-size/num-attention-heads and num-experts for EP>1, and
# (2) vime's _hf_validate_args (vime/backends/megatron_utils/arguments.py) asserts them EQUAL to the HF
# config: hidden_size, num_attention_heads, num_hidden_layers, moe_intermediate_size, rms_norm_eps and
# tie_word_embeddings (so --untie-embeddings-and-output-weights must NOT be passed: Gemma 4 ties them).
# Deliberately absent: --spec and --custom-model-provider-path (vime's raw-mode Gemma 4 model from
# scripts/models/gemma4-26B-A4B.sh): a custom provider takes precedence over the bridge provider in
# model_provider.py and would bypass this plugin. Also absent: flags the provider owns in bridge mode
# (--attention-backend, --attention-dropout, --hidden-dropout, --attention-softmax-in-fp32,
# --moe-router-*, --moe-grouped-gemm): vime would ignore them (provider fields win).
MODEL_ARGS=(
  --num-layers 30                  # [megatron] = num_hidden_layers (checked by vime against the HF config)
  --hidden-size 2816               # [megatron] = hidden_size (checked)
  --ffn-hidden-size 2112           # [megatron] = intermediate_size of the dense MLP every layer also has
  --num-attention-heads 16         # [megatron] = num_attention_heads (checked)
  --group-query-attention          # [megatron] GQA: fewer KV heads than query heads
  --num-query-groups 8             # [megatron] = num_key_value_heads of the sliding layers (full layers: 2, k_eq_v)
  --kv-channels 256                # [megatron] = head_dim of the sliding layers (full layers: global_head_dim 512)
  --normalization RMSNorm          # [megatron] Gemma uses RMSNorm
  --norm-epsilon 1e-6              # [megatron] = rms_norm_eps (checked; Megatron's default 1e-5 would fail the check)
  --qk-layernorm                   # [megatron] Gemma 4 normalises q and k
  --disable-bias-linear            # [megatron] no linear biases
  --position-embedding-type rope   # [megatron] rotary embeddings
  --rotary-base 10000              # [megatron] rope_theta of the sliding layers (the provider sets per-layer rope)
  --vocab-size 262144              # [megatron] = vocab_size (already a multiple of 128 x TP: no padding)
  --num-experts 128                # [megatron] = num_experts; Megatron requires it for --expert-model-parallel-size > 1
  --moe-ffn-hidden-size 704        # [megatron] = moe_intermediate_size (checked)
  --moe-router-topk 8              # [megatron] = top_k_experts (vime's FLOPs/balance estimates read args)
  --moe-token-dispatcher-type alltoall  # [megatron] copied onto the provider by vime; alltoall is what EP4 needs
                                        #   (vime replaces allgather by alltoall for variable-length batches anyway)
  --moe-aux-loss-coeff 0           # [megatron] copied onto the provider by vime; no load-balancing loss in RL
)

CKPT_ARGS=(
  --hf-checkpoint "${HF_CKPT}"     # [vime] HF checkpoint: vLLM loads it, the tokenizer comes from it, and in bridge
                                   #   mode the Megatron model is built from its config.json
  --ref-load "${REF_LOAD}"         # [vime] reference/initial weights: the torch_dist dir from `vime-gemma4 import`
                                   #   (in bridge mode an HF directory also works: vime then loads it with the bridge)
  --save "${SAVE_DIR}"             # [megatron, default reset by vime] where Megatron checkpoints of this run go
  --save-interval "${SAVE_INTERVAL}"  # [megatron, default reset by vime] save every N rollouts
)
if [[ -f "${SAVE_DIR}/latest_checkpointed_iteration.txt" ]]; then
  # Resume. In bridge mode vime uses --load as given; only a Megatron checkpoint dir may be passed.
  CKPT_ARGS+=(--load "${SAVE_DIR}")  # [megatron, default reset by vime] resume model + optimizer from this run
else
  # First run: no --load, so vime loads --ref-load (vime_validate_args: args.load = ref_load or hf_checkpoint).
  # Unlike raw mode, bridge mode does not set finetune/no-load-optim for us, and the converted checkpoint
  # has no optimizer/rng state.
  CKPT_ARGS+=(
    --finetune                     # [megatron] start at iteration 0 (assumed anyway for a 'release' checkpoint)
    --no-load-optim                # [megatron] the converted checkpoint carries no optimizer state
    --no-load-rng                  # [megatron] ... and no RNG state
  )
fi

ROLLOUT_ARGS=(
  --prompt-data "${PROMPT_DATA}"   # [vime] jsonl prompts
  --input-key "${INPUT_KEY}"       # [vime] prompt field
  --label-key "${LABEL_KEY}"       # [vime] label field (for the reward)
  --apply-chat-template            # [vime] render prompts with the checkpoint's chat template
  --apply-chat-template-kwargs "${CHAT_TEMPLATE_KWARGS}"  # [vime] extra template kwargs (JSON)
  --rollout-shuffle                # [vime] shuffle prompts
  --rm-type "${RM_TYPE}"           # [vime] built-in reward (math); use --custom-rm-path for your own
  --num-rollout "${NUM_ROLLOUT}"   # [vime] number of rollout/train iterations
  --rollout-batch-size "${ROLLOUT_BATCH_SIZE}"       # [vime] prompts per rollout
  --n-samples-per-prompt "${N_SAMPLES_PER_PROMPT}"   # [vime] GRPO group size
  --rollout-max-response-len "${ROLLOUT_MAX_RESPONSE_LEN}"  # [vime] max_tokens of a response
  --rollout-temperature "${ROLLOUT_TEMPERATURE}"     # [vime] sampling temperature
  --num-steps-per-rollout "${NUM_STEPS_PER_ROLLOUT}" # [vime] optimizer steps per rollout
  --global-batch-size "${GLOBAL_BATCH_SIZE}"         # [megatron, default reset by vime] samples per step; vime asserts
                                                     #   = rollout-batch-size x n-samples / num-steps (here 32x8/1 = 256)
  --balance-data                   # [vime] balance tokens across the 4 data-parallel ranks
)

# Memory per actor GPU, 25.23e9 params in total (HF config: 22.84e9 in the 30 x 128 experts, 0.74e9 tied
# embedding, 1.65e9 attention + dense MLP). PP2 puts 15 layers on each stage; stage 1 also holds the tied
# output layer. TP2 halves attention/MLP/embedding; EP4 x ETP1 gives each GPU 32 of the 128 experts:
#   dense   (0.83e9 attention+MLP of 15 layers + 0.74e9 embedding or tied output layer) / TP2
#           + 6e6 replicated router/norm params                              ~ 0.79e9 params
#   experts 15 layers x 761.3e6 / (EP4 x ETP1)                                = 2.85e9 params
#   => 3.64e9 params/GPU: bf16 weights 2 B -> 7.3 GB; fp32 grad buffer 4 B (--accumulate-allreduce-grads-
#      in-fp32) -> 14.6 GB; Adam fp32 master+m+v 12 B sharded by the distributed optimizer over DP
#      (dense DP = 16/(TP2·PP2) = 4, expert DP = 16/(ETP1·EP4·PP2) = 2): 0.79e9x12/4 + 2.85e9x12/2 = 19.5 GB
#   => 41.4 GB (38.5 GiB) of a 40 GB A800 (~39.5 GiB usable) before a single activation: it cannot fit,
#      hence --optimizer-cpu-offload (OPTIMIZER_ARGS): 19.5 GB/GPU = 156 GB host RAM per actor node, and
#      20.4 GiB stays on the GPU for weights + grads, leaving ~19 GiB for activations, logits and NCCL.
# ETP1 vs ETP2: TP2·PP2·EP4 fits 16 GPUs either way (ETP·EP·PP = 8 or 16 divides 16); both are bitwise
#   round-trip tested by the plugin. ETP1 (default) keeps each expert's 704-wide GEMMs whole and adds no
#   tensor-parallel collectives inside the MoE layer; it is what vime's own Gemma 4 script and the
#   `vime-gemma4 import --etp` default use. ETP2 halves expert weights+grads on the GPU (2.85e9 -> 1.43e9
#   params: 20.4 -> 12.4 GiB static) but not the optimizer (ETP x expert-DP = 2 either way, still 17.1 GB
#   of expert Adam state per GPU), at the cost of 352-wide GEMM shards and extra collectives. Use ETP=2
#   (and the same --etp at import) if activations OOM at your MAX_TOKENS_PER_GPU.
PERF_ARGS=(
  --tensor-model-parallel-size "${TP}"     # [megatron] TP2: 16 heads, 8 KV heads and 2 global KV heads all divide by 2
  --sequence-parallel                      # [megatron] shard norms/dropout activations over the TP pair
  --pipeline-model-parallel-size "${PP}"   # [megatron] PP2: 15 + 15 of the 30 layers
  --context-parallel-size "${CP}"          # [megatron] no context parallelism
  --expert-model-parallel-size "${EP}"     # [megatron] EP4: experts 0-31 | 32-63 | 64-95 | 96-127 (the reported boundaries)
  --expert-tensor-parallel-size "${ETP}"   # [megatron] ETP1 (see above)
  --recompute-granularity full             # [megatron] recompute whole layers in backward ...
  --recompute-method uniform               # [megatron] ... uniformly over the stage ...
  --recompute-num-layers 1                 # [megatron] ... one layer per recompute unit: only layer inputs are kept
  --use-dynamic-batch-size                 # [vime] pack micro-batches up to --max-tokens-per-gpu
  --max-tokens-per-gpu "${MAX_TOKENS_PER_GPU}"  # [vime] 8192 >= one full sample (2048 prompt + 4096 response). The
                                           #   biggest transient is the last stage's logits: 8192 tok x 262144/TP2 vocab
                                           #   x 4 B = 4.3 GB (fp32), about twice that inside the loss; lower to 4096 on OOM
  --calculate-per-token-loss               # [megatron, reset by vime] average the loss over real (non-padded) tokens
)

GRPO_ARGS=(
  --advantage-estimator grpo       # [vime] group-relative advantages
  --entropy-coef 0.0               # [vime] no entropy bonus
  --eps-clip 0.2                   # [vime] PPO clip (low)
  --eps-clip-high 0.28             # [vime] PPO clip (high), DAPO-style asymmetric clipping
)
if [[ "${USE_KL_LOSS}" == 1 ]]; then
  GRPO_ARGS+=(
    --use-kl-loss                  # [vime] KL to the reference model (loads --ref-load a second time as 'ref')
    --kl-loss-coef "${KL_LOSS_COEF}"  # [vime] its weight (a 0.0 coefficient would only cost a forward pass)
    --kl-loss-type low_var_kl      # [vime] k3-style low-variance estimator
  )
fi

OPTIMIZER_ARGS=(
  --optimizer adam                 # [megatron] Adam(W)
  --lr "${LR}"                     # [megatron, default reset by vime] learning rate
  --lr-decay-style constant        # [megatron] constant LR
  --weight-decay 0.1               # [megatron] decoupled weight decay
  --adam-beta1 0.9                 # [megatron]
  --adam-beta2 0.98                # [megatron]
  --optimizer-cpu-offload          # [megatron] keep the 19.5 GB/GPU of Adam state on the host (arithmetic above)
  --overlap-cpu-optimizer-d2h-h2d  # [megatron] overlap the CPU step with the grad D2H and param H2D copies
  --use-precision-aware-optimizer  # [megatron] TE precision-aware Adam (main params/states dtypes configurable;
                                   #   the combination vime's own offload scripts use)
)
if (( ACTOR_NUM_NODES >= 2 )); then
  # vime/backends/megatron_utils/arguments.py: precision-aware optimizer + CPU offload checkpoints fail to
  # reload ("Cannot merge two lists with different lengths") unless the optimizer checkpoint is fully
  # reshardable; that costs host RAM at save time, which vime says fits on >= 2 actor nodes.
  OPTIMIZER_ARGS+=(--dist-ckpt-optim-fully-reshardable)  # [megatron]
fi

# Rollout: 4 engines x TP4 on the 16 rollout GPUs. bf16 weights are 50.5 GB, so one 40 GB card cannot hold
# an engine; TP4 puts 12.6 GB (11.8 GiB) of weights on each GPU and, at 0.85 utilisation (~33.6 GiB), leaves
# ~20 GiB for KV cache and CUDA graphs. TP4 divides the 16 heads and 8 KV heads; the 2 global KV heads are
# replicated (4 % 2 == 0). Engines stay inside one node.
VLLM_ARGS=(
  --rollout-num-gpus-per-engine "${ROLLOUT_GPUS_PER_ENGINE}"  # [vime] GPUs per vLLM engine = its TP size
  --vllm-gpu-memory-utilization "${VLLM_GPU_MEMORY_UTILIZATION}"  # [vllm] fraction of each rollout GPU for vLLM
  --vllm-max-model-len "$(( ROLLOUT_MAX_RESPONSE_LEN + PROMPT_BUDGET ))"  # [vllm] prompt budget + response
  --vllm-max-num-seqs "${VLLM_MAX_NUM_SEQS}"                  # [vllm] concurrent sequences per engine
  --vllm-max-cudagraph-capture-size "${VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE}"  # [vllm] capture CUDA graphs up to the
                                                              #   max batch (= max-num-seqs) and no larger
  --vllm-server-concurrency "${VLLM_SERVER_CONCURRENCY}"      # [vime-vllm] max in-flight requests vime sends an engine
  --vllm-language-model-only                                  # [vllm] serve the text model only (no vision tower):
                                                              #   the bridge publishes language-model tensors only
)

MISC_ARGS=(
  --accumulate-allreduce-grads-in-fp32   # [megatron] fp32 gradient buffer and all-reduce (counted above)
  --loss-mask-type gemma4                # [vime] Gemma 4 chat-turn loss mask (choice present in recent vime)
  --megatron-to-hf-mode bridge           # [vime] Megatron->HF through Megatron-Bridge, i.e. this plugin's bridge
  --update-weight-mode full              # [vime] publish every tensor at every sync
  --update-weight-transport disk         # [vime] actor writes a complete HF checkpoint, engines reload it
                                         #   (vime: disk sync requires non-colocated training and rollout)
  --update-weight-disk-dir "${UPDATE_WEIGHT_DISK_DIR}"  # [vime] shared dir; one weight_vNNNNNN/ per sync
  --update-weight-buffer-size "${UPDATE_WEIGHT_BUFFER_SIZE}"  # [vime] bytes per export chunk (512 MiB, vime's default):
                                         #   in disk mode one chunk = one safetensors shard (~100 shards); a chunk is
                                         #   gathered on actor GPUs, so keep it small on 40 GB cards
)
if [[ "${KEEP_WEIGHT_FILES}" == 1 ]]; then
  MISC_ARGS+=(--update-weight-disk-keep-files)  # [vime] keep the weight_vNNNNNN dirs (for vime-gemma4 verify-update)
fi
if [[ "${CHECK_WEIGHT_UPDATE_EQUAL}" == 1 ]]; then
  # [vime] engines snapshot the HF weights they loaded, reset them, and after the first actor->rollout
  # update compare (train.py, vime/ray/placement_group.py): HF1 == HF1 -> Megatron -> HF2 on the live path.
  MISC_ARGS+=(--check-weight-update-equal)
fi

TRAIN_ARGS=(
  "${CLUSTER_ARGS[@]}" "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}"
  "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${VLLM_ARGS[@]}" "${MISC_ARGS[@]}"
)

# Environment of every Ray worker of the job (PYTHONPATH as in vime's scripts; CUDA_DEVICE_MAX_CONNECTIONS=1
# is what Megatron needs for TP/SP communication ordering; the plugin switch once more).
RUNTIME_ENV_JSON="{\"env_vars\": {\"PYTHONPATH\": \"${MEGATRON_LM_DIR}\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\", \"VIME_GEMMA4_BRIDGE_AUTOLOAD\": \"${VIME_GEMMA4_BRIDGE_AUTOLOAD}\"}}"
SUBMIT_CMD=(
  ray job submit --address="http://127.0.0.1:${RAY_DASHBOARD_PORT}" --runtime-env-json="${RUNTIME_ENV_JSON}"
  -- "${PYTHON}" "${VIME_DIR}/train.py" "${TRAIN_ARGS[@]}"
)

if [[ "${DRY_RUN}" == 1 ]]; then
  echo "RECIPE=gemma4-26b-a4b-4x8-a800-disaggregated-disk"
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
  # Worker node: join the head's Ray cluster and stay there; vime places actors and engines.
  exec ray start --address="${MASTER_ADDR}:${RAY_PORT}" --num-gpus "${GPUS_PER_NODE}" --disable-usage-stats --block
fi

for path in "${HF_CKPT}/config.json" "${REF_LOAD}" "${PROMPT_DATA}" "${VIME_DIR}/train.py"; do
  [[ -e "${path}" ]] || { echo "missing: ${path} (see recipes/README.md for the conversion pre-step)" >&2; exit 1; }
done
mkdir -p "${SAVE_DIR}" "${UPDATE_WEIGHT_DISK_DIR}"

# Fail before reserving 32 GPUs if the topology cannot split this checkpoint (imports megatron.bridge).
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
# vime waits (and logs) until all 32 GPUs of its placement group are registered, i.e. until the
# three worker nodes have joined.
"${SUBMIT_CMD[@]}"
