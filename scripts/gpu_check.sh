#!/usr/bin/env bash
# The TE/CUDA path, on a machine with one GPU and Transformer Engine (vime's image): the TE build of the
# model, bitwise round trips and fp32 parity at TP1 and at EP/TP splits that fit one GPU (ranks share it),
# vime's weight sync and HF save, and vLLM generating after every weight road (tests/test_vllm.py). Prints one
# line per check and a summary; about 12 minutes at most.
# Run from the repository root:  bash scripts/gpu_check.sh   (record what it prints in docs/GPU.md)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
CLI="$PY -m vime_gemma4_bridge.cli"
OUT=$(mktemp -d)
# GPU_CHECK_LOGS=FILE.tar.gz keeps every check's full log (the lines below show their last lines only).
trap '[ -n "${GPU_CHECK_LOGS:-}" ] && tar -czf "$GPU_CHECK_LOGS" -C "$OUT" $(cd "$OUT" && ls -- *.log); rm -rf "$OUT"' EXIT
failures=0

check() {  # check NAME COMMAND...: run it under a cap (CAP seconds, default 150), print PASS/FAIL with its last line
  local name=$1; shift
  local start=$SECONDS log="$OUT/$name.log"
  if timeout "${CAP:-150}" "$@" >"$log" 2>&1; then
    echo "PASS  $name ($((SECONDS - start)) s): $(tail -n 1 "$log")"
  else
    failures=$((failures + 1))
    echo "FAIL  $name ($((SECONDS - start)) s): $(tail -n 3 "$log" | tr '\n' ' ')"
  fi
}

echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
$PY - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import transformer_engine
    print("transformer_engine", transformer_engine.__version__)
except Exception as error:  # the checks below then run the CPU twins on the GPU
    print("transformer_engine: not importable:", error)
PY
check env $CLI env
check tiny-vl $CLI tiny "$OUT/vl"
check tiny-causal $CLI tiny "$OUT/causal" --causal-lm
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
for ckpt in vl causal; do
  check "roundtrip-tp1-$ckpt" $CLI roundtrip --hf-checkpoint "$OUT/$ckpt"
  check "roundtrip-ep2-$ckpt" $CLI roundtrip --hf-checkpoint "$OUT/$ckpt" --ep 2 --nproc 2
  check "roundtrip-tp2-ep2-$ckpt" $CLI roundtrip --hf-checkpoint "$OUT/$ckpt" --tp 2 --ep 2 --nproc 2
done
check parity-tp1 $CLI parity --hf-checkpoint "$OUT/vl" --dtype float32
check parity-ep2 $CLI parity --hf-checkpoint "$OUT/vl" --dtype float32 --ep 2 --nproc 2
check export-live-pp2 $CLI export-live --hf-checkpoint "$OUT/vl" --pp 2 --ep 2 --nproc 4 --buffer-size 60000 \
  --dump "$OUT/dump"
check verify-update $CLI verify-update --hf-checkpoint "$OUT/vl" --dump "$OUT/dump"
# vLLM itself on the GPU (tests/test_vllm.py with the image's vLLM): every weight road, and the FP8 dump served.
# A machine without vLLM (a bare CUDA image: its wheels are far larger than what can be carried) says so.
VLLM_PY=${VLLM_PYTHON:-$(command -v python3 || command -v python)}
if "$VLLM_PY" -c 'import vllm' >/dev/null 2>&1; then
  VIME_VLLM_PYTHON=$VLLM_PY CAP=420 check vllm-roads $PY -m pytest -q -x tests/test_vllm.py
else
  echo "SKIP  vllm-roads: $VLLM_PY cannot import vllm (set VLLM_PYTHON to a Python with vLLM)"
fi
echo "== gpu_check: $failures failed"
exit $((failures > 0))
