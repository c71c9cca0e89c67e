"""The tied-embedding rule, in one place.

Gemma 4 ties ``lm_head`` to ``embed_tokens`` (``tie_word_embeddings=True``): HF checkpoints
carry only ``embed_tokens``; vLLM skips ``lm_head`` when tied. In Megatron, with one pipeline
stage the output layer *is* the embedding; with PP > 1 the last stage holds its own copy
(``output_layer.weight``) that training keeps equal by an all-reduce of the gradients.

* Import fills both: the mapping table maps only the embedding, and :func:`broadcast_tied_embeddings`
  (the bridge's ``_broadcast_shared_embeddings``) copies stage 0's embedding into the last stage's
  output layer. The step is owned here because builds differ: vime's fork reads the last stage's
  first virtual chunk, which at VPP holds no output layer (``AssertionError: Output layer not
  found``); the release reads its last chunk, as this does.
* Export emits ``embed_tokens`` exactly once and never ``lm_head``: no ``output_layer`` mapping
  exists and upstream drops ``output_layer`` tasks when tied. (Emitting both was the duplicate
  tensor of the original bug report.)
* Before export, :func:`check_tied_embeddings` proves the last stage's copy still equals the
  embedding; a silent divergence would make vLLM (which uses the embedding) differ from training.
  Not when the caller hands in its own conversion tasks: vime does, and in colocated mode its
  actor sleeps during the sync (its GPU memory paused, the tasks carrying CPU backups), so the
  export may read the task weights and nothing else. The tasks hold no output layer (upstream
  builds none when tied), so there is nothing to compare; the check runs on every export whose
  tasks the bridge builds itself (``export``, ``export-live``, ``save_hf_pretrained``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from vime_gemma4_bridge.core.bitwise import bits


class TiedEmbeddingMismatch(ValueError):
    """The last pipeline stage's output layer differs from stage 0's embedding."""


def _tied_across_stages(models: list) -> bool:
    config = models[0].config
    return bool(getattr(config, "share_embeddings_and_output_weights", False)) and (
        parallel_state.get_pipeline_model_parallel_world_size() > 1
    )


def broadcast_tied_embeddings(megatron_model: Any) -> None:
    """Collective over the embedding group: the last stage's output layer := stage 0's embedding.

    Chunk 0 of the first stage holds the embedding, the last chunk of the last stage the output
    layer (megatron-core's placement, with or without virtual pipeline stages).
    """
    models = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
    if not _tied_across_stages(models) or not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    group = parallel_state.get_embedding_group()
    source = torch.distributed.get_process_group_ranks(group)[0]
    if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        weight = models[0].embedding.word_embeddings.weight
    else:
        weight = models[-1].output_layer.weight
    torch.distributed.broadcast(weight.data, src=source, group=group)


#: Bytes of the embedding shard sent and compared at a time: the check's extra memory is about one such block.
_BLOCK_BYTES = 4 << 20


def check_tied_embeddings(megatron_model: Any) -> None:
    """Collective over all ranks: raise :class:`TiedEmbeddingMismatch` if the tied copies differ.

    Stage 0 broadcasts its shard a block of rows at a time and the last stage compares each block by
    bytes as it arrives: the check holds one block beside the weights, not a copy of the shard
    (0.7 GB for 26B-A4B's embedding at TP2), and no float64 difference of it.
    """
    models = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
    if not _tied_across_stages(models):
        return
    device = next(models[0].parameters()).device
    found = torch.zeros(2, dtype=torch.float64, device=device)  # [any byte differs, max |Δ| for the message]
    if parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        group = parallel_state.get_embedding_group()
        source = torch.distributed.get_process_group_ranks(group)[0]
        first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        weight = (models[0].embedding.word_embeddings if first_stage else models[-1].output_layer).weight.detach()
        rows = max(1, _BLOCK_BYTES // max(1, weight[:1].numel() * weight.element_size()))
        block = None if first_stage else torch.empty_like(weight[:rows])
        for start in range(0, weight.shape[0], rows):
            mine = weight[start : start + rows].contiguous()  # a view: the shard's rows are contiguous
            if first_stage:
                torch.distributed.broadcast(mine, src=source, group=group)
                continue
            theirs = block[: mine.shape[0]]
            torch.distributed.broadcast(theirs, src=source, group=group)
            differs = bits(mine) != bits(theirs)  # bytes: a NaN is its own tied copy
            if differs.any():
                found[0] = 1.0
                delta = (mine[differs].double() - theirs[differs].double()).abs().max()
                found[1] = torch.maximum(found[1], delta)
    torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
    if found[0].item():
        raise TiedEmbeddingMismatch(
            "tied embeddings diverged: the last pipeline stage's output_layer.weight differs from stage 0's "
            f"embedding (max |Δ|={found[1].item():.6g}); the HF export carries only embed_tokens, so fix the "
            "training run (embedding-group gradient all-reduce) or re-tie before exporting"
        )
