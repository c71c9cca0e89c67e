"""The tiny checkpoints' weights: every tensor drawn from its own generator, and proven distinct.

transformers' default init leaves norms, scales and ``layer_scalar`` at one, so a wrong mapping
between two of them would still round-trip bit-exactly. :func:`randomize_` therefore redraws *every*
saved tensor (seeded from the spec seed and the tensor name) until it is distinct, and
:func:`assert_all_distinct` refuses any state dict in which two tensors, two experts of one stacked
tensor or two leading-dimension slices are equal, or a tensor is constant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from vime_gemma4_bridge.verify.fingerprint import tensor_digest

# Value ranges of the random draw: small enough that a forward pass stays finite in float16,
# wide enough that every value is distinct at bfloat16 precision.
_SCALE_STD = 0.1  # 1-D multiplicative scales (norm weights, router scales): 1 + 0.1 * N(0, 1)
_LAYER_SCALAR_RANGE = (0.5, 1.5)  # layer_scalar: uniform, always positive
_MAX_REDRAWS = 64


def _tensor_seed(seed: int, name: str, salt: int) -> int:
    """Stable per-tensor seed (``hash()`` is salted per process, sha256 is not)."""
    digest = hashlib.sha256(f"vime-gemma4-tiny:{seed}:{name}:{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw(name: str, shape: torch.Size, seed: int, salt: int) -> torch.Tensor:
    """Draw one tensor in float32 from its own generator.

    1-D tensors are all multiplicative scales in Gemma 4 (RMSNorm weights are used as ``x * w``,
    not ``x * (1 + w)``; router ``scale`` / ``per_expert_scale``), so they are drawn near one;
    ``layer_scalar`` multiplies the whole residual stream and is kept positive. Everything else
    (projections, embeddings, stacked experts, the vision position table) is ``N(0, 1/fan_in)``
    with ``fan_in`` the last dimension, which keeps activations O(1) through the norms.
    """
    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name, salt))
    if name.endswith("layer_scalar"):
        lo, hi = _LAYER_SCALAR_RANGE
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)
    if len(shape) <= 1:
        return 1.0 + _SCALE_STD * torch.randn(shape, generator=gen, dtype=torch.float32)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen, dtype=torch.float32) / fan_in**0.5


def _own_problems(name: str, t: torch.Tensor) -> list[str]:
    """Problems of one tensor on its own: non-finite, constant, or repeated slices."""
    problems = []
    flat = t.detach().reshape(-1).float()
    if not torch.isfinite(flat).all():
        problems.append(f"{name}: non-finite values")
    if flat.numel() > 1 and bool((flat == flat[0]).all()):
        problems.append(f"{name}: constant tensor ({flat[0].item()})")
    if flat.numel() == 1 and flat.item() in (0.0, 1.0):
        problems.append(f"{name}: scalar left at init value {flat.item()}")
    if t.dim() >= 3:  # stacked experts [E, ...] and the vision position table [2, ...]
        seen: dict[str, int] = {}
        for i in range(t.shape[0]):
            fp = tensor_digest(t[i], with_shape=False)
            if fp in seen:
                problems.append(f"{name}: slices {seen[fp]} and {i} are equal")
            seen.setdefault(fp, i)
    return problems


def assert_all_distinct(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise ``AssertionError`` unless every tensor is distinguishable from every other.

    Checks: no two tensors have equal flattened contents (any shape); within every tensor of
    rank >= 3 (stacked experts ``[E, ...]``) no two leading slices are equal; no tensor of more
    than one element is constant (catches norms/scales left at ones or zeros); no one-element
    tensor (``layer_scalar``) is 0 or 1; all values finite. Called before saving, after
    read-back, and by the tests: a checkpoint that fails is never published.
    """
    problems: list[str] = []
    owners: dict[str, str] = {}
    for name in sorted(state_dict):
        t = state_dict[name]
        problems += _own_problems(name, t)
        fp = tensor_digest(t, with_shape=False)
        if fp in owners:
            problems.append(f"{name} equals {owners[fp]}")
        owners.setdefault(fp, name)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise AssertionError(f"{len(problems)} indistinct tensor(s):\n  {shown}{more}")


def saved_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as ``save_pretrained`` writes it: tied aliases (``lm_head``) dropped.

    Parameters and persistent buffers both appear; the first name of each storage wins, which
    for Gemma 4 is the embedding (``lm_head.weight`` comes last and is the tied alias).
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def on_disk(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (:func:`saved_tensors`) under the names ``save_pretrained`` writes them as: transformers
    renames some on save (the 12B's vision embedder: ``embed_vision.patch_*`` → ``vision_embedder.patch_*``)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(tensors))


def randomize_(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Overwrite every saved parameter and persistent buffer in place, deterministically.

    Each tensor comes from a generator seeded with (seed, name, salt). If the draw, cast to the
    model dtype, collides with an earlier tensor, is constant, or repeats a slice, the salt is
    bumped and the tensor redrawn, so the result is deterministic and always distinct.
    Returns the saved tensors (tied aliases dropped) by name.
    """
    tensors = saved_tensors(model)
    owners: set[str] = set()
    with torch.no_grad():
        for name in sorted(tensors):
            target = tensors[name]
            for salt in range(_MAX_REDRAWS):
                value = _draw(name, target.shape, seed, salt).to(target.dtype)
                fp = tensor_digest(value, with_shape=False)
                if fp not in owners and not _own_problems(name, value):
                    break
            else:  # pragma: no cover - needs a pathological spec (e.g. a 1-element tensor per layer in int8)
                raise RuntimeError(f"could not draw a distinct value for {name} in {_MAX_REDRAWS} tries")
            target.copy_(value)
            owners.add(fp)
    return tensors
