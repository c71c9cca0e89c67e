"""``vime-gemma4 verify-checkpoint DIR``: a checkpoint's bytes against the digests recorded when it was written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vime_gemma4_bridge.cli import errors

PROG = "vime-gemma4 verify-checkpoint"
DESCRIPTION = """\
Check a checkpoint against the XXH3-128 digests recorded when this package wrote it, before it is
trusted (after a copy between nodes, or on a file system you doubt):

  torch_dist (DIR from vime-gemma4 import, or DIR/iter_*): every stored item of every .distcp
    file, and every other file of the iteration directory, against iter_*/vime_gemma4.digests.json;
  HF (DIR from export, roundtrip --output, export-live, tiny): every tensor of every safetensors
    shard against the xxh3_128:<name> entries of its header metadata.

Files are also checked to be present, complete and safe to read. The format is documented in
docs/ARCHITECTURE.md ("Digests"): it can be checked with the xxhash package alone. Exit status: 0 iff every
recorded digest matches; 1 if one does not (the damaged file, tensor and shard named); 2 on bad
input, and when DIR records no digests (a training run's save, a Hub checkpoint: nothing to check
its bytes against)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 verify-checkpoint``."""
    parser = subparsers.add_parser(
        "verify-checkpoint",
        help="check a torch_dist or HF checkpoint against the digests recorded when it was written",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", metavar="DIR", help="torch_dist checkpoint (DIR or DIR/iter_*) or HF checkpoint")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def _spans(path: Path) -> tuple[str, Path, list]:
    """(kind, what was checked, recorded spans) of ``path``; refuses what is no checkpoint or records no digests."""
    from vime_gemma4_bridge.io.digests import DIGESTS_NAME, torch_dist_spans
    from vime_gemma4_bridge.io.hf import CheckpointError, HFCheckpoint
    from vime_gemma4_bridge.io.torch_dist import TRACKER_NAME, TorchDistCheckpoint

    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass a torch_dist or HF checkpoint directory")
    if (path / TRACKER_NAME).is_file() or (path / "metadata.json").is_file():
        checkpoint = TorchDistCheckpoint(path)
        checkpoint.check_files()
        spans = torch_dist_spans(checkpoint.iteration_dir)
        if spans is None:
            raise CheckpointError(
                f"{checkpoint.iteration_dir} records no digests ({DIGESTS_NAME}): only checkpoints written by "
                "vime-gemma4 import carry them; its files are present and complete, its bytes cannot be checked"
            )
        return "torch_dist", checkpoint.iteration_dir, spans
    source = HFCheckpoint(path)
    spans = source.digest_spans()
    if not spans:
        raise CheckpointError(
            f"{path} records no digests (no xxh3_128:<name> in its safetensors headers): only checkpoints written by "
            "vime-gemma4 carry them; its shards are readable, their bytes cannot be checked"
        )
    return "HF", path, spans


def run(args: argparse.Namespace) -> int:
    """Exit 0 iff every recorded digest matches, 1 if one does not, 2 on bad input or no digests."""
    from vime_gemma4_bridge.io.digests import DamagedCheckpoint, check_spans, damaged
    from vime_gemma4_bridge.io.hf_write import progress

    try:
        kind, where, spans = _spans(Path(args.dir))
    except DamagedCheckpoint as error:  # a shard's header differs from its digest: the data is bad, not the call
        return errors.report(PROG, error, debug=False)
    except ValueError as error:
        return errors.refuse(PROG, error)
    with progress(f"Checking {where.name}", len(spans), not args.json) as advance:
        found = check_spans(spans, advance=advance)
    if found:
        return errors.report(PROG, damaged(kind, where, found), debug=False)
    nbytes = sum(span.length if span.length is not None else span.file.stat().st_size for span, _ in spans)
    files = len({span.file for span, _ in spans})
    if args.json:
        print(json.dumps({"ok": True, "kind": kind, "path": str(where), "spans": len(spans), "files": files}))
    else:
        matched = f"{len(spans)} recorded digests match ({files} files, {nbytes:,} bytes)"
        print(f"verify-checkpoint OK: {kind} {where}: {matched}")
    return 0
