"""An SGLang engine the tests drive from the outside: run by the SGLang environment's Python (``.venv-sglang``).

SGLang 0.5.23 pins torch 2.14.1+cu130 and transformers 5.19 while the suite runs Megatron-Bridge on its
own torch, so, as with vLLM (tests/vllm_engine.py), the suite starts this program as a child and speaks
one JSON object per line: requests on its stdin, answers on ``--answers-fd`` (SGLang logs to stdout and
stderr). It imports nothing of the package.

The engine is SGLang's offline ``sglang.Engine`` on the CPU (``SGLANG_USE_CPU_ENGINE=1``, set by the test):
``attention_backend="torch_native"``, no CUDA graph, no overlap schedule, no multimodal, no tokenizer.
It starts here with the libcuda stub on ``LD_LIBRARY_PATH`` (tests/libcuda_stub.c: sglang-kernel's
``common_ops`` needs a ``libcuda.so.1``) and tests/sglang_site/sitecustomize.py's harness-only changes
named in ``VIME_SGLANG_PATCHES`` (at least ``torch-native``: SGLang's argument check refuses the one
attention backend this CPU runs); the test sets both.

Requests (``op``):

* ``generate`` ``{"prompts": [[ids]], "max_tokens": N}`` → ``{"tokens": [[ids]], "logprobs": [[float]]}``
  (greedy, ``ignore_eos``, each chosen token's logprob);
* ``push`` ``{"tensor_files": [FILE, ...]}`` → miles' colocated sync (``update_weight_from_tensor.py``
  @31f1ca96 L450-545), each file one chunk miles' iterator yields: ``begin_weight_update()``, per chunk
  SGLang's own ``FlattenedTensorBucket`` (one bucket, or one per dtype where the bucket lacks
  ``supports_multi_dtypes``, as miles L477-486 decides), ``MultiprocessingSerializer.serialize(...,
  output_str=True)``, ``update_weights_from_tensor(..., load_format="flattened_bucket", flush_cache=False)``,
  then ``end_weight_update()`` and a cache flush; answers SGLang's ``(success, message)`` of every call;
* ``disk`` ``{"path": DIR}`` → ``update_weights_from_disk(DIR)`` (then ``flush_cache``);

``push`` and ``disk`` first wait (a ``flush_cache`` with a timeout) until the scheduler is idle: a request
that has answered can still be in its running batch, and SGLang 0.5.23 then fails a disk update's own
flush ("Weights were updated, but the cache was not flushed ...") though the weights did change;
* ``skipped`` → the names SGLang's loader skipped since the last ask (with ``record-skipped``);
* ``quit``.

With ``--serve PORT`` it is SGLang's HTTP server instead (``sglang.launch_server.run_server``) with the
same settings: ``python -m sglang.launch_server`` has no way to say ``enable_multimodal=False`` (its
flag only turns it on, and left unset it is on for a VL checkpoint, which then needs an image processor).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _chunk(file: str) -> list:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as handle:
        return [(name, handle.get_tensor(name)) for name in handle.keys()]


def _until_idle(engine) -> None:
    """SGLang's deferred flush (``FlushCacheReqInput.timeout_s``, scheduler_components/flush_wrapper.py)
    answers once the scheduler is fully idle; ``Engine.flush_cache()`` passes no timeout."""
    result = engine.loop.run_until_complete(engine.tokenizer_manager.flush_cache(timeout_s=60.0))
    if not result.success:
        raise RuntimeError(f"SGLang did not go idle within 60 s: {result.message}")


def _payloads(named: list) -> list[str]:
    """miles' buckets for one chunk (L477-497), with SGLang's own classes."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if getattr(FlattenedTensorBucket, "supports_multi_dtypes", False):
        groups = [named]
    else:
        by_dtype: dict = {}
        for name, tensor in named:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        groups = list(by_dtype.values())
    payloads = []
    for group in groups:
        bucket = FlattenedTensorBucket(named_tensors=group)
        data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        payloads.append(MultiprocessingSerializer.serialize(data, output_str=True))
    return payloads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF checkpoint directory to serve (Gemma4ForConditionalGeneration)")
    parser.add_argument("--answers-fd", type=int, help="file descriptor the answers are written to")
    parser.add_argument("--serve", type=int, metavar="PORT", help="run SGLang's HTTP server on 127.0.0.1:PORT")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    import sglang

    settings = dict(
        model_path=args.model,
        device="cpu",
        dtype=args.dtype,
        attention_backend="torch_native",
        disable_cuda_graph=True,
        disable_overlap_schedule=True,
        enable_multimodal=False,
        skip_tokenizer_init=True,
        max_total_tokens=1024,
        context_length=256,
        random_seed=0,
        log_level="error",
    )
    if args.serve:
        from sglang.launch_server import run_server
        from sglang.srt.server_args import ServerArgs

        run_server(ServerArgs(**settings, host="127.0.0.1", port=args.serve))
        return 0
    answers = os.fdopen(args.answers_fd, "w", buffering=1)
    os.dup2(2, 1)
    engine = sglang.Engine(**settings)
    answers.write(json.dumps({"ready": True, "version": sglang.__version__}) + "\n")
    skipped_file = os.environ.get("VIME_SGLANG_SKIPPED")
    try:
        for line in sys.stdin:
            request = json.loads(line)
            op = request["op"]
            try:
                if op == "quit":
                    answers.write(json.dumps({"ok": True}) + "\n")
                    return 0
                if op == "generate":
                    params = {"temperature": 0.0, "max_new_tokens": request["max_tokens"], "ignore_eos": True}
                    outputs = engine.generate(input_ids=request["prompts"], sampling_params=params, return_logprob=True)
                    answer = {
                        "tokens": [list(o["output_ids"]) for o in outputs],
                        "logprobs": [[s[0] for s in o["meta_info"]["output_token_logprobs"]] for o in outputs],
                    }
                elif op == "push":
                    _until_idle(engine)
                    results = [engine.begin_weight_update()]
                    for file in request["tensor_files"]:
                        for payload in _payloads(_chunk(file)):
                            results.append(
                                engine.update_weights_from_tensor(
                                    [payload], load_format="flattened_bucket", flush_cache=False
                                )
                            )
                    results.append(engine.end_weight_update())
                    engine.flush_cache()
                    answer = {"results": [repr(r) for r in results]}
                elif op == "disk":
                    _until_idle(engine)
                    result = engine.update_weights_from_disk(request["path"])
                    engine.flush_cache()
                    answer = {"results": [repr(result)]}
                elif op == "skipped":
                    names = []
                    if skipped_file and os.path.exists(skipped_file):
                        with open(skipped_file) as handle:
                            names = [n for line in handle for n in json.loads(line)]
                        os.unlink(skipped_file)
                    answer = {"skipped": names}
                else:
                    answer = {"error": f"unknown op {op!r}"}
            except Exception as error:  # the test reads the answer and fails with it
                answer = {"error": f"{type(error).__name__}: {error}"}
            answers.write(json.dumps(answer) + "\n")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
