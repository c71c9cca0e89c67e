"""How a one-shot conversion moves its weights: through the Megatron model, or streamed past it, one interface.

The general path is Megatron-Bridge's and megatron-core's alone: every HF weight loaded into the
model and saved (import), or the checkpoint loaded into the model and every weight exported
(export). At the default topology (TP1·PP1·EP1·ETP1) a streamed path may replace parts of it
(the gaps they cover are docs/UPSTREAM.md's entries on the two streaming modules): the import
writes every weight straight from the HF shards into torch_dist items
(:mod:`~vime_gemma4_bridge.convert.stream_import`); the export reads the routed
experts — and, when every chunk is stored whole, all other weights — straight from the torch_dist
files (:mod:`~vime_gemma4_bridge.convert.stream_export`). Which path applies is decided here once
(:func:`import_path`, :func:`export_path`); the jobs (:mod:`~vime_gemma4_bridge.convert.torch_dist_jobs`)
run the same steps on whichever they get.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.convert import stream_export, stream_import
from vime_gemma4_bridge.convert.model import export_to_rank0, is_rank0
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io import torch_dist
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.io.torch_dist_reader import TorchDistReader

__all__ = ["ExportPath", "ImportPath", "export_path", "import_path"]


class ImportPath:
    """The general import: Megatron-Bridge loads every HF weight into the model, megatron-core saves all."""

    #: Whether weights bypass the model (the report's ``experts_streamed``).
    streamed = False
    #: What the load phase's progress line adds.
    how = ""

    def __init__(self, bridge: Any, model: list[nn.Module]) -> None:
        self.bridge, self.model = bridge, model

    @contextlib.contextmanager
    def writing(self, iteration_dir: Path) -> Iterator[None]:
        """The span of :meth:`load` and megatron-core's save into ``iteration_dir``."""
        yield

    def load(self) -> None:
        """Every weight this path converts (collective)."""
        self.bridge.load_hf_weights(self.model)

    def leave_out(self) -> Collection[str]:
        """Parameters whose torch_dist items this path writes itself (megatron-core saves the rest)."""
        return ()

    def digests(self) -> dict[tuple[str, int, int], str]:
        """Digests of the items this path wrote, by (file, offset, length), hashed as they were written."""
        return {}


class _StreamedImportPath(ImportPath):
    """Every weight from the HF shards straight into torch_dist items, written by rank 0 alone."""

    streamed = True
    how = " (every weight streamed from the HF shards into torch_dist items)"

    def __init__(self, bridge: Any, model: list[nn.Module], plan: stream_import.ImportPlan) -> None:
        super().__init__(bridge, model)
        self.plan = plan
        self._stream: Any = None
        self._written: list[Any] = []

    @contextlib.contextmanager
    def writing(self, iteration_dir: Path) -> Iterator[None]:
        if not is_rank0():  # one writer: the other ranks hold replicas
            yield
            return
        with self.plan.streaming(iteration_dir) as stream:
            self._stream = stream
            try:
                yield
            finally:
                self._stream = None
        self._written = stream.written

    def load(self) -> None:
        if self._stream is not None:
            self._stream.convert(seams.model_bridge_of(self.bridge), self.bridge.hf_pretrained.state)

    def leave_out(self) -> Collection[str]:
        return self.plan.streamed_params()

    def digests(self) -> dict[tuple[str, int, int], str]:
        return {(item.file, item.offset, item.length): item.digest for item in self._written}


def import_path(bridge: Any, model: list[nn.Module], source: HFCheckpoint, topology: Topology) -> ImportPath:
    """The path of an import at ``topology``: streamed at the default topology when the model allows it."""
    plan = stream_import.plan_import(bridge, model, source) if topology == Topology() else None
    return ImportPath(bridge, model) if plan is None else _StreamedImportPath(bridge, model, plan)


class ExportPath:
    """The general export: megatron-core loads the checkpoint into the model, Megatron-Bridge exports all."""

    streamed = False
    how = ""
    #: The report's ``loader``: who reads the checkpoint.
    loader = "dist_checkpointing"

    def __init__(self, bridge: Any, model: list[nn.Module]) -> None:
        self.bridge, self.model = bridge, model

    def load(self, iteration_dir: Path) -> None:
        """Read what the export needs from the checkpoint (collective)."""
        torch_dist.load_torch_dist(self.model, iteration_dir)

    def export(self, signature: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
        """``(hf_name, tensor or lazy tensor)`` on rank 0 as each arrives, nothing elsewhere (every rank
        iterates: collectives); ``signature``: the source's."""
        return export_to_rank0(self.bridge, self.model)


class _StreamedExportPath(ExportPath):
    """The routed experts from the torch_dist files to the HF shards; the rest through the model."""

    streamed = True
    how = " (routed experts streamed to the HF shards)"

    def __init__(
        self, bridge: Any, model: list[nn.Module], plan: stream_export.ExportPlan, reader: TorchDistReader
    ) -> None:
        super().__init__(bridge, model)
        self.plan, self.reader = plan, reader

    def load(self, iteration_dir: Path) -> None:
        torch_dist.load_torch_dist(self.model, iteration_dir, streamed=self.plan.experts.modules())

    def export(self, signature: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
        yield from export_to_rank0(self.bridge, self.model, conversion_tasks=self.plan.other_tasks)
        yield from self._experts()

    def _experts(self) -> Iterable[tuple[str, Any]]:
        return stream_export.streamed_export_tensors(self.plan.experts, self.reader).items() if is_rank0() else ()


class _DirectExportPath(_StreamedExportPath):
    """Every weight read from its stored chunks: no megatron-core load, and rank 0 alone works.

    Reading whole chunks and exporting at TP1·PP1·EP1 involves no collective, so the other ranks
    would only compete for the same cores.
    """

    loader = "direct"

    def load(self, iteration_dir: Path) -> None:
        if is_rank0():
            self.plan.check_direct(self.reader)  # every chunk stored whole: read as the writer needs it

    def export(self, signature: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
        if is_rank0():
            yield from self.plan.lazy_tensors(self.bridge, self.model, self.reader, signature).items()
            yield from self._experts()


@contextlib.contextmanager
def export_path(bridge: Any, model: list[nn.Module], topology: Topology, iteration_dir: Path) -> Iterator[ExportPath]:
    """The path of an export at ``topology`` (its checkpoint reader, if any, open while the block runs)."""
    if topology != Topology():
        yield ExportPath(bridge, model)
        return
    with contextlib.closing(TorchDistReader(iteration_dir)) as reader:
        plan = stream_export.plan_export(bridge, model, reader)
        if plan is None:
            yield ExportPath(bridge, model)
        elif plan.direct is None:
            yield _StreamedExportPath(bridge, model, plan, reader)
        else:
            yield _DirectExportPath(bridge, model, plan, reader)
