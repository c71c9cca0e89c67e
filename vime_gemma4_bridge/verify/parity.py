"""Numerical parity: the Megatron model computes what transformers computes, logit for logit (``vime-gemma4 parity``).

A bitwise round trip proves that every tensor comes back, not that the Megatron model *uses*
it the way Gemma 4 does: q/k heads permuted inside ``linear_qkv``, gate and up swapped in
``linear_fc1``, a norm applied at the wrong place or the wrong RoPE on a global layer all
round-trip perfectly. :func:`parity_job` loads a HF checkpoint into the Megatron model through the
bridge at a topology, runs one forward pass over fixed token ids (a pipelined forward across
PP/VPP stages, TP-gathered logits), runs transformers' own forward on the same ids and
compares the logits over the real vocabulary (Megatron pads it).

Tolerances: float32 — max |Δlogit| ≤ 2e-5 (MoE) / 5e-5 (dense) and every argmax equal, tight
enough that a scale error a following RMSNorm hides up to its eps (doubling the routed experts'
output, as an expert-TP double reduction does: ~4e-5) fails; ``--fp32-max-abs`` sets another bound
(deep, wide models accumulate more rounding); bfloat16 — argmax agreement ≥ 0.99 (bf16 rounding
differs between the two implementations' op orders, so only the prediction is compared). The last line printed is always
``max|dlogit|=<x> mean|dlogit|=<y> argmax_agreement=<z>``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from vime_gemma4_bridge.convert.topology import Topology

if TYPE_CHECKING:  # torch and megatron are imported where used: argument parsing stays instant
    import torch
    from megatron.bridge import AutoBridge

#: ``--dtype`` choices.
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")
#: float32: largest |Δlogit| accepted by default (the two implementations differ only in op order), by
#: model kind: measured ~6e-6 (MoE) and ~2e-5 (dense) on the tiny checkpoints; a doubled routed-expert
#: output (the expert-TP double reduction this project found) gives ~4e-5 and must fail.
FLOAT32_MAX_ABS_TOLERANCE = {"moe": 2e-5, "dense": 5e-5}
#: bfloat16: smallest fraction of positions whose argmax must agree.
BFLOAT16_MIN_ARGMAX_AGREEMENT = 0.99
#: Seed of the fixed token ids: the same ids on every rank, in every run.
TOKEN_SEED = 1234
#: Default batch size of the forward pass.
DEFAULT_BATCH = 2


@dataclass(frozen=True)
class ParityResult:
    """Figures of one comparison (rank 0's, given to every rank)."""

    max_abs: float
    mean_abs: float
    argmax_agreement: float
    dtype: str
    topology: str
    batch: int
    seq_len: int
    vocab_size: int
    padded_vocab_size: int
    passed: bool

    def summary_line(self) -> str:
        """The command's last line (its format is part of the interface)."""
        return (
            f"max|dlogit|={self.max_abs:.3e} mean|dlogit|={self.mean_abs:.3e} "
            f"argmax_agreement={self.argmax_agreement:.4f}"
        )


def within_tolerance(dtype: str, max_abs: float, argmax_agreement: float, fp32_max_abs: float) -> bool:
    """The acceptance rule of the command, per dtype."""
    if dtype == "float32":
        return max_abs <= fp32_max_abs and argmax_agreement == 1.0
    return argmax_agreement >= BFLOAT16_MIN_ARGMAX_AGREEMENT


def default_fp32_bound(text_config: Any) -> float:
    """The default float32 bound for this model kind (``FLOAT32_MAX_ABS_TOLERANCE``)."""
    return FLOAT32_MAX_ABS_TOLERANCE["moe" if getattr(text_config, "enable_moe_block", False) else "dense"]


def default_seq_len(text_config: Mapping[str, Any]) -> int:
    """Three sliding windows (so sliding layers really drop context), rounded up to a multiple of 8."""
    window = int(text_config.get("sliding_window") or 0)
    if window <= 0:
        return 64
    return max(16, -(-3 * window // 8) * 8)


def excluded_token_ids(config: Mapping[str, Any]) -> list[int]:
    """Ids transformers' VL model replaces before embedding (image/video/audio placeholders).

    A VL checkpoint's forward swaps these ids for padding before the language model sees them,
    which the Megatron language model does not; text-only ids keep both sides comparable.
    """
    ids = {config.get(key) for key in ("image_token_id", "video_token_id", "audio_token_id")}
    return sorted(int(i) for i in ids if isinstance(i, int))


def fixed_token_ids(
    vocab_size: int, batch: int, seq_len: int, excluded: Sequence[int] = (), seed: int = TOKEN_SEED
) -> torch.Tensor:
    """Deterministic ``[batch, seq_len]`` token ids drawn uniformly from the vocabulary minus ``excluded``."""
    import torch

    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in excluded if 0 <= i < vocab_size]] = False
    candidates = allowed.nonzero().flatten()
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, candidates.numel(), (batch, seq_len), generator=generator)
    return candidates[picks]


# --------------------------------------------------------------------------------------------
# The Megatron side
# --------------------------------------------------------------------------------------------


def set_checkpoint_dtype(bridge: AutoBridge, dtype: torch.dtype) -> None:
    """Make the bridge build Megatron parameters in ``dtype`` instead of the checkpoint's dtype.

    The provider takes its ``params_dtype`` from the HF config (``provider_bridge`` in
    :mod:`vime_gemma4_bridge.core.bridge`), the VL text config first; loading then casts every HF
    tensor into the parameters (``Tensor.copy_``), which is the same rounding transformers
    applies with ``from_pretrained(dtype=...)``.
    """
    config = bridge.hf_pretrained.config
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None:
            cfg.dtype = dtype


def pipelined_forward(
    model: list[torch.nn.Module], input_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor | None:
    """One forward pass of all model chunks of this rank, in pipeline order, without gradients.

    Returns the TP-gathered logits ``[batch, seq, padded_vocab]`` on the ranks of the last
    pipeline stage, ``None`` elsewhere. Stages hand hidden states ``[seq, batch, hidden]`` (with
    ``variable_seq_lengths``, any shape, sent first: the dense model's ``[hidden | carried]``) to
    the next stage with point-to-point send/recv over the pipeline group (megatron-core's
    schedules allocate on CUDA, so they do not run on CPU ranks); with virtual pipelining the
    chunks run in the interleaved order stage 0 chunk 0, stage 1 chunk 0, ..., stage 0 chunk 1.
    A single micro-batch needs no overlap, so this is the schedule's data flow exactly.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    config = get_model_config(model[0])
    pp_size = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group() if pp_size > 1 else None
    batch, seq_len = input_ids.shape
    hidden_shape = (seq_len, batch, config.hidden_size)
    hidden_dtype = config.pipeline_dtype or config.params_dtype
    device = next(model[0].parameters()).device
    input_ids = input_ids.to(device)
    position_ids = position_ids.to(device)
    logits = None
    with torch.no_grad():
        for chunk_index, chunk in enumerate(model):
            chunk.eval()
            first = chunk_index == 0 and pp_rank == 0
            last = chunk_index == len(model) - 1 and pp_rank == pp_size - 1
            if not first:
                shape = hidden_shape
                if config.variable_seq_lengths:  # the shape comes first, as in megatron-core's p2p exchange
                    sent = torch.empty(3, dtype=torch.int64, device=device)
                    dist.recv(sent, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
                    shape = tuple(sent.tolist())
                received = torch.empty(shape, dtype=hidden_dtype, device=device)
                dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
                get_attr_wrapped_model(chunk, "set_input_tensor")(received)
            output = chunk(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=None,
                runtime_gather_output=True,
            )
            if last:
                logits = output
            else:
                next_rank = ps.get_pipeline_model_parallel_next_rank()
                if config.variable_seq_lengths:
                    dist.send(torch.tensor(output.shape, dtype=torch.int64, device=device), dst=next_rank, group=group)
                dist.send(output.contiguous(), dst=next_rank, group=group)
    return logits


def megatron_logits_on_rank0(model: list[torch.nn.Module], input_ids: torch.Tensor) -> torch.Tensor | None:
    """Forward on every rank; return the full logits on global rank 0 (``None`` on other ranks).

    Rank 0 is the first stage of its pipeline; the last stage of that pipeline sends it the
    (TP-gathered) logits as one tensor, not pickled: for a real vocabulary they are large.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    batch, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(batch, seq_len)
    logits = pipelined_forward(model, input_ids, position_ids)
    rank = dist.get_rank()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return logits.cpu() if rank == 0 else None
    if ps.get_pipeline_model_parallel_first_rank() != 0:
        return None  # another data-parallel replica: nothing to hand over
    dtype = get_model_config(model[0]).params_dtype
    last = ps.get_pipeline_model_parallel_last_rank()
    if rank == last:
        dist.send(logits.to(dtype).contiguous(), dst=0)
        return None
    if rank == 0:
        vocab = get_attr_wrapped_model(model[0], "vocab_size")
        device = next(model[0].parameters()).device
        received = torch.empty((batch, seq_len, vocab), dtype=dtype, device=device)
        dist.recv(received, src=last)
        return received.cpu()
    return None


# --------------------------------------------------------------------------------------------
# The transformers side and the comparison
# --------------------------------------------------------------------------------------------


def hf_logits(
    hf_checkpoint: str,
    input_ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    layer_by_layer: bool = False,
    device: str = "cpu",
) -> torch.Tensor:
    """transformers' logits for ``input_ids``: the checkpoint's own class, eager attention, ``dtype``.

    ``layer_by_layer``: each decoder layer's weights are read from the checkpoint's files when its
    forward runs and dropped after it (accelerate's disk offload, straight from the safetensors: nothing
    is copied), the vision / audio towers never; the rest of the language model (embedding, final norm)
    is held. ``rollout-check`` scores a 26B-A4B checkpoint this way in a login node's memory, where the
    eager load holds the whole VL checkpoint (~52 GB). The logits are the same (tests/test_rollout.py).
    ``device``: where the held modules live and every layer runs (``"cuda"``: each offloaded layer is
    moved there for its forward); the logits come back on the CPU.
    """
    import tempfile

    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_checkpoint)
    architecture = (config.architectures or ["Gemma4ForCausalLM"])[0]
    model_cls = getattr(transformers, architecture)
    with contextlib.ExitStack() as stack:
        placement = {}
        if layer_by_layer:
            offload = stack.enter_context(tempfile.TemporaryDirectory(prefix="vime-gemma4-offload-"))
            placement = {"device_map": _layer_by_layer(model_cls, config, device), "offload_folder": offload}
        elif device != "cpu":
            placement = {"device_map": device}
        model = model_cls.from_pretrained(hf_checkpoint, dtype=dtype, attn_implementation="eager", **placement)
        with torch.no_grad():
            return model.eval()(input_ids=input_ids.to(device), use_cache=False).logits.cpu()


def _layer_by_layer(model_cls: type, config: Any, device: str = "cpu") -> dict[str, str]:
    """accelerate's device map: each decoder layer and every module outside the language model on ``disk``
    (read when it runs), the rest of the language model and the root's own modules (``lm_head``) on
    ``device`` (accelerate runs the offloaded layers on the first device that is not ``cpu`` or ``disk``)."""
    import torch

    from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX

    language_model = LANGUAGE_MODEL_PREFIX[model_cls.__name__].rstrip(".")
    layers = f"{language_model}.layers"
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = model_cls(config)
    device_map: dict[str, str] = {}

    def place(module: Any, path: str) -> None:
        for name, child in module.named_children():
            full = f"{path}.{name}" if path else name
            if full == layers:
                device_map.update({f"{full}.{index}": "disk" for index, _ in child.named_children()})
            elif layers.startswith(full + "."):
                place(child, full)
            else:
                device_map[full] = device if full.startswith(language_model + ".") or not path else "disk"

    place(model, "")
    return device_map


def compare_logits(megatron: torch.Tensor, reference: torch.Tensor, vocab_size: int) -> tuple[float, float, float]:
    """``(max |Δ|, mean |Δ|, argmax agreement)`` over the real vocabulary, computed in float64."""
    import torch

    if megatron.shape[:2] != reference.shape[:2] or megatron.shape[-1] < vocab_size:
        raise ValueError(
            f"logit shapes differ: Megatron {tuple(megatron.shape)}, transformers {tuple(reference.shape)}"
        )
    ours = megatron[..., :vocab_size].double()
    theirs = reference[..., :vocab_size].double()
    diff = (ours - theirs).abs()
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).double().mean()
    if not torch.isfinite(ours).all():
        return float("inf"), float("inf"), float(agreement)
    return float(diff.max()), float(diff.mean()), float(agreement)


def parity_job(
    hf_checkpoint: str,
    topology: Topology,
    dtype: str,
    seq_len: int,
    batch: int,
    after_load: Callable[[list[torch.nn.Module]], None] | None = None,
    fp32_max_abs: float | None = None,
) -> dict[str, Any]:
    """Runs on every rank. Returns rank 0's :class:`ParityResult` (as a dict) on all ranks.

    ``after_load(model_chunks)``, if given, runs on every rank between loading and the forward
    pass (a module-level function, so that it reaches the ranks): tests use it to break the
    model on purpose and prove that the comparison notices.
    """
    import torch

    from vime_gemma4_bridge.convert.integrity import verify_sources
    from vime_gemma4_bridge.convert.model import broadcast_from_rank0, is_rank0, loaded_model, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    torch_dtype = getattr(torch, dtype)
    init_model_parallel(topology)
    verify_sources(hf_checkpoint)  # the digests it records, before its bytes are used
    bridge = open_bridge(hf_checkpoint)
    set_checkpoint_dtype(bridge, torch_dtype)
    config = bridge.hf_pretrained.config
    text_config = getattr(config, "text_config", config)
    vocab_size = int(text_config.vocab_size)
    input_ids = fixed_token_ids(vocab_size, batch, seq_len, excluded_token_ids(config.to_dict()))

    with contextlib.redirect_stdout(sys.stderr):  # megatron-core's and the bridge's chatter: stdout is the report's
        model = loaded_model(bridge, topology)
    if after_load is not None:
        after_load(model)
    logits = megatron_logits_on_rank0(model, input_ids)
    del model

    result: dict[str, Any] | None = None
    if is_rank0():
        reference = hf_logits(hf_checkpoint, input_ids, torch_dtype)
        max_abs, mean_abs, agreement = compare_logits(logits, reference, vocab_size)
        result = asdict(
            ParityResult(
                max_abs=max_abs,
                mean_abs=mean_abs,
                argmax_agreement=agreement,
                dtype=dtype,
                topology=str(topology),
                batch=batch,
                seq_len=seq_len,
                vocab_size=vocab_size,
                padded_vocab_size=int(logits.shape[-1]),
                passed=within_tolerance(dtype, max_abs, agreement, fp32_max_abs or default_fp32_bound(text_config)),
            )
        )
    return broadcast_from_rank0(result)
