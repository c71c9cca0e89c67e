"""Complete HF saves of a checkpoint whose bridge converts only part of it (docs/UPSTREAM.md 30).

``AutoBridge.save_hf_pretrained`` / ``save_hf_weights`` (0.6.2: ``auto_bridge.py``; vime calls it in
``hf_checkpoint_saver.save_hf_model_bridge_to_path``) stream the bridge's export into the
checkpoint's ``SafeTensorsStateSource.save_generator``, which writes each source shard once all of
its tensors have been yielded and, being strict, fails when any source tensor was not
(``state.py``: "N tensors from the original checkpoint were not written"). A Gemma 4 VL
checkpoint keeps its vision / audio towers beside the language model, often in the same shard,
and those never enter Megatron: the save wrote nothing and raised.

The plugin's bridge has each of its exports first call :func:`complete_saves_from_source`, which
wraps ``save_generator`` on that one source object (the checkpoint the bridge was opened on, nothing
global): after the export's own tensors it yields, bitwise from the source, the tensors the bridge
declares it does not convert. Everything the
bridge does convert must still come from the export, so upstream's strictness keeps catching a
missing language-model tensor. The export a save consumes is also put in the checkpoint's own
layout (the bridge's ``in_checkpoint_layout``: experts stacked, whatever the live sync's
``VIME_GEMMA4_EXPERT_LAYOUT`` says). The live weight stream is untouched: it never reaches
``save_generator``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_MARK = "_vime_gemma4_completes_from_source"


def complete_saves_from_source(
    hf_pretrained: Any,
    converted: Callable[[str], bool],
    in_checkpoint_layout: Callable[[Iterable[Any]], Iterable[Any]],
) -> None:
    """Make every save of ``hf_pretrained``'s safetensors source complete it from the source. Idempotent.

    ``converted(name)`` says whether the bridge's export yields the source tensor ``name``; the
    others are copied from the source. ``in_checkpoint_layout`` wraps the export on every rank (each
    rank consumes it in ``save_generator``, writing or not). A source without ``save_generator`` (a
    model held in memory, another build) is left as it is.
    """
    state = getattr(hf_pretrained, "state", None)
    source = getattr(state, "source", None)
    save = getattr(source, "save_generator", None)
    if save is None or getattr(save, _MARK, False):
        return
    passed_through = [name for name in source.get_all_keys() if not converted(name)]

    def save_generator(generator: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
        generator = in_checkpoint_layout(generator)
        # Only the writing ranks read the source: rank 0, or every rank of a distributed save.
        distributed = kwargs.get("distributed_save", args[2] if len(args) > 2 else False)
        if distributed or not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            generator = _then_from_source(generator, source, passed_through)
        return save(generator, *args, **kwargs)

    setattr(save_generator, _MARK, True)
    source.save_generator = save_generator


def _then_from_source(generator: Iterable[Any], source: Any, names: list[str]) -> Iterator[Any]:
    """The export's items, then each passed-through tensor as the build's ``HFWeightTuple``.

    The build's own tuple type, because consumers differ: the release's ``save_generator`` unpacks
    ``name, tensor``, the fork's reads ``item.param_name`` / ``item.weight``.
    """
    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple

    yield from generator
    for name in names:  # one at a time: a shard is written (and its tensors freed) once complete
        yield HFWeightTuple(name, source.load_tensors([name])[name])
