"""Does a running vLLM or SGLang server serve an HF checkpoint's weights? Its greedy tokens and logprobs
against transformers'.

What a vime or miles user runs when rollouts look wrong (``vime-gemma4 rollout-check``): fixed token-id
prompts go to the server greedy, with ``ignore_eos`` and each chosen token's logprob: to vLLM's
OpenAI-compatible ``/v1/completions`` (``logprobs: 1``, ``return_tokens_as_token_ids``), or, on a server
that answers SGLang's ``/model_info`` (``srt/entrypoints/http_server.py`` @0.5.23), to SGLang's native
``/generate`` with ``input_ids`` and ``return_logprob`` (a server started with ``--skip-tokenizer-init``,
as miles' engines are, has no detokenizer for ``/v1/completions``). Transformers then scores the very same token
sequences with the HF checkpoint (teacher forcing), so every served token is compared, before and
after a divergence: its logprob, and whether transformers' argmax agrees. Only the Python standard
library speaks HTTP, so the check needs nothing an engine brings.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Default ``max |Δlogprob|`` by the checkpoint's dtype: fp32 engines agree with transformers to ~1e-6
#: (measured: tests/test_vllm.py); bf16 kernels differ in rounding, a real fault moves logprobs by far more.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.2, "float16": 0.2}


class ServerError(ValueError):
    """The server cannot be asked (down, wrong model, another vocabulary): input refused, exit 2."""


@dataclass
class RolloutCheck:
    """The outcome: served tokens, the largest logprob gap, and the first token that disagrees."""

    server: str
    model: str
    prompts: int
    tokens: int
    tolerance: float
    max_abs: float = 0.0
    first_divergence: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def summary_line(self) -> str:
        head = f"{self.prompts} prompts x {self.tokens} tokens, max|dlogprob|={self.max_abs:.3g}"
        head += f" (tolerance {self.tolerance:g})"
        if self.ok:
            return f"rollout-check OK: {self.server} serves the checkpoint's weights: {head}, greedy tokens identical"
        d = self.first_divergence
        return (
            f"rollout-check FAILED: {self.server} does not serve the checkpoint's weights: prompt {d['prompt']} "
            f"diverges at token {d['token']} (served {d['served']} logprob {d['served_logprob']:.6g}, "
            f"transformers argmax {d['argmax']} logprob of the served token {d['hf_logprob']:.6g}); {head}"
        )


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def served_model(server: str, model: str | None) -> str:
    """The model name to query: ``model`` if the server serves it, else the one model it serves."""
    try:
        served = [entry["id"] for entry in _request(f"{server}/v1/models", timeout=10.0)["data"]]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as error:
        reason = getattr(error, "reason", error)
        raise ServerError(f"cannot reach a server at {server} ({reason}); start one or check --server") from None
    if model is not None and model not in served:
        raise ServerError(f"{server} serves {', '.join(served) or 'no model'}, not {model!r}: wrong model (--model)")
    if model is None and len(served) != 1:
        raise ServerError(f"{server} serves {len(served)} models ({', '.join(served)}); name one with --model")
    return model or served[0]


def is_sglang(server: str) -> bool:
    """Feature detection, not a version: SGLang's HTTP server answers ``/model_info`` with
    ``is_generation``; vLLM's has no such route."""
    try:
        return "is_generation" in _request(f"{server}/model_info", timeout=10.0)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def complete(
    server: str, model: str, prompt: list[int], max_tokens: int, vocab_size: int, sglang: bool = False
) -> list[tuple[int, float]]:
    """Greedy completion of token ids: ``(token id, logprob)`` per generated token."""
    if sglang:
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True},
            "return_logprob": True,
        }
        return _checked(server, vocab_size, lambda: _sglang_tokens(_request(f"{server}/generate", body)))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    return _checked(server, vocab_size, lambda: _openai_tokens(_request(f"{server}/v1/completions", body)))


def _sglang_tokens(answer: dict[str, Any]) -> list[tuple[int, float]]:
    return [(int(token), float(lp)) for lp, token, *_ in answer["meta_info"]["output_token_logprobs"]]


def _openai_tokens(answer: dict[str, Any]) -> list[tuple[int, float]]:
    logprobs = answer["choices"][0]["logprobs"]
    return [
        (int(token.removeprefix("token_id:")), float(lp))
        for token, lp in zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True)
    ]


def _checked(server: str, vocab_size: int, ask: Any) -> list[tuple[int, float]]:
    """``ask()``'s tokens, with a refused or unreachable request, or a token beyond the vocabulary, as a ServerError."""
    try:
        served = ask()
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
        raise ServerError(f"{server} refused a completion (HTTP {error.code}): {text.strip()[:200]}") from None
    except (urllib.error.URLError, OSError) as error:
        raise ServerError(f"cannot reach a server at {server} ({getattr(error, 'reason', error)})") from None
    beyond = [token for token, _ in served if token >= vocab_size]
    if beyond:
        raise ServerError(
            f"vocab mismatch: {server} generated token id {beyond[0]}, beyond the checkpoint's vocab_size "
            f"{vocab_size}; it serves another model"
        )
    return served


def _check_vocabulary(server: str, model: str, vocab_size: int, sglang: bool) -> None:
    """A server with a smaller vocabulary refuses the checkpoint's last token id: told by how the server answers
    (the last id refused, id 0 served), not by the wording of its error, which is each engine's own."""
    try:
        complete(server, model, [vocab_size - 1], 1, vocab_size, sglang)
    except ServerError as refused:
        try:
            complete(server, model, [0], 1, vocab_size, sglang)
        except ServerError:
            raise refused from None
        raise ServerError(
            f"vocab mismatch: {server} refuses token id {vocab_size - 1}, below the checkpoint's vocab_size "
            f"{vocab_size}, and serves token id 0; it serves another model"
        ) from None


def rollout_check(
    hf_checkpoint: str,
    server: str,
    *,
    model: str | None = None,
    prompts: int = 4,
    prompt_len: int = 8,
    max_tokens: int = 12,
    tolerance: float | None = None,
    device: str = "cpu",
) -> RolloutCheck:
    """Greedy continuations of fixed prompts from ``server``, scored by transformers with ``hf_checkpoint``
    on ``device``."""
    import torch

    from vime_gemma4_bridge.core.hf_layout import declared_dtype
    from vime_gemma4_bridge.verify.parity import excluded_token_ids, fixed_token_ids, hf_logits

    server = server.rstrip("/")
    config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    text = config.get("text_config", config)
    vocab_size = int(text["vocab_size"])
    dtype = str(declared_dtype(config) or torch.bfloat16).removeprefix("torch.")
    bound = DEFAULT_TOLERANCE.get(dtype, 0.2) if tolerance is None else tolerance
    name = served_model(server, model)
    sglang = is_sglang(server)
    _check_vocabulary(server, name, vocab_size, sglang)
    ids = fixed_token_ids(vocab_size, prompts, prompt_len, excluded_token_ids(config))
    check = RolloutCheck(server=server, model=name, prompts=prompts, tokens=max_tokens, tolerance=bound)
    served = [complete(server, name, prompt, max_tokens, vocab_size, sglang) for prompt in ids.tolist()]
    empty = [index for index, tokens in enumerate(served) if not tokens]
    if empty:
        raise ServerError(f"{server} generated no token for prompt {empty[0]} (asked for {max_tokens})")
    # A server may stop some completions early (its context length): pad after the served tokens, which
    # leaves the logits of every served position as they are (causal attention), and score only those.
    longest = max(len(tokens) for tokens in served)
    continued = [[token for token, _ in tokens] + [0] * (longest - len(tokens)) for tokens in served]
    sequences = torch.cat([ids, torch.tensor(continued, dtype=ids.dtype)], dim=1)
    # one forward, every prompt; a layer's weights in memory at a time (the checkpoint may not fit in a node's)
    logits = hf_logits(hf_checkpoint, sequences, getattr(torch, dtype), layer_by_layer=True, device=device).float()
    logprobs = torch.log_softmax(logits[:, prompt_len - 1 : -1, :vocab_size], dim=-1)
    for index, tokens in enumerate(served):
        for step, (token, served_logprob) in enumerate(tokens):
            hf_logprob = float(logprobs[index, step, token])
            argmax = int(logprobs[index, step].argmax())
            gap = abs(hf_logprob - served_logprob) if math.isfinite(served_logprob) else math.inf
            check.max_abs = max(check.max_abs, gap)
            tied = float(logprobs[index, step, argmax]) - hf_logprob <= bound  # a near-tie may break either way
            if check.first_divergence is None and (gap > bound or (argmax != token and not tied)):
                check.first_divergence = {
                    "prompt": index,
                    "token": step,
                    "served": token,
                    "served_logprob": served_logprob,
                    "argmax": argmax,
                    "hf_logprob": hf_logprob,
                }
    return check
