"""megatron-core's ``TransformerLayer`` with its private feed-forward steps under public names.

``TransformerLayer.forward`` (megatron-core 0.19.2, ``transformer/transformer_layer.py``) runs the
feed-forward as ``_forward_mlp`` (pre-MLP norm, MLP), which ends in ``_forward_post_mlp`` (bias,
dropout, residual add). It has no public hook for either step, and Gemma 4 changes both (three MoE
inputs; a post-FFN norm and ``layer_scalar``). :class:`TransformerLayerHooks` is the one place that
overrides the private methods: each calls a public method a subclass replaces, whose default is
upstream's own step, so a build that renames a step is followed here and nowhere in core/.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from vime_gemma4_bridge.compat import seams


class TransformerLayerHooks(TransformerLayer):
    """``TransformerLayer`` whose ``_forward_mlp`` / ``_forward_post_mlp`` are :meth:`forward_mlp` /
    :meth:`forward_post_mlp`, and whose per-sample MoE packing is :meth:`unflatten_for_moe` /
    :meth:`reflatten_from_moe`."""

    _forward_mlp = seams.hands_to("forward_mlp")

    def forward_mlp(self, *args: Any, **kwargs: Any) -> Any:
        """The feed-forward step (megatron-core's ``_forward_mlp``, called as upstream calls it)."""
        return super()._forward_mlp(*args, **kwargs)

    _forward_post_mlp = seams.hands_to("forward_post_mlp")

    def forward_post_mlp(self, *args: Any, **kwargs: Any) -> Any:
        """What follows the MLP: bias, dropout, residual (megatron-core's ``_forward_post_mlp``)."""
        return super()._forward_post_mlp(*args, **kwargs)

    def unflatten_for_moe(
        self, hidden_states: Tensor, padding_mask: Tensor | None, packed_seq_params: Any
    ) -> tuple[Tensor, Tensor | None, Any]:
        """``(moe_input, padding_mask, mbs)``: a packed batch per sample for the MoE, as upstream's MoE layer
        takes it (megatron-core >= 0.16 ``_maybe_unflatten_for_moe``); unchanged, ``mbs`` None, where the
        build has no such step."""
        if hasattr(self, "_maybe_unflatten_for_moe"):
            return self._maybe_unflatten_for_moe(hidden_states, padding_mask, packed_seq_params)
        return hidden_states, padding_mask, None

    def reflatten_from_moe(self, output: Tensor, packed_seq_params: Any, mbs: Any) -> Tensor:
        """The MoE's output packed again where :meth:`unflatten_for_moe` unpacked it (``_maybe_reflatten_from_moe``)."""
        if mbs is None:
            return output
        return self._maybe_reflatten_from_moe(output, packed_seq_params, mbs)
