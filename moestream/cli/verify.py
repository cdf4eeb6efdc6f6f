"""`moestream verify --model DIR`: check every shard once (e.g. after a download) and record per-expert
digests, which the engine then checks on every read of an expert from disk."""

from __future__ import annotations

import sys
from pathlib import Path

from moestream.budget import format_bytes
from moestream.checks import require_checkpoint_dir
from moestream.progress import DeferredBar


def add_parser(commands) -> None:
    parser = commands.add_parser("verify", help="check a checkpoint's shards and write its expert digests")
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (safetensors + config.json)")
    parser.add_argument("--rewrite", action="store_true",
                        help="record the digests afresh instead of comparing with the manifest already there")
    parser.set_defaults(handler=run)


def run(args) -> int:
    require_checkpoint_dir(args.model)
    from moestream.checkpoint.manifest import MANIFEST_FILE
    from moestream.checkpoint.verify import verify

    with DeferredBar(desc="verify", unit="B", unit_scale=True, unit_divisor=1024) as bar:  # drawn once sized
        report = verify(args.model, bar.update, rewrite=args.rewrite, on_start=bar.start)
    published = (f"sha256 matched the published digest of {report.num_published} of {report.num_shards} shards"
                 if report.num_published else "no published digest to compare (not a Hugging Face cache snapshot)")
    action = "wrote" if report.manifest_written else "matched"
    print(f"verified {report.num_shards} shard{'s' if report.num_shards != 1 else ''}, {format_bytes(report.bytes_checked)} in {report.seconds:.1f} s "
          f"({format_bytes(int(report.bytes_per_s))}/s); {published}; {action} the digests of "
          f"{report.num_experts} experts in {report.path / MANIFEST_FILE}")
    if report.manifest_written and not report.num_published:
        print("moestream: nothing to compare the shards with, so these digests record them as they are now: if "
              "they may already be damaged, download them again before verifying", file=sys.stderr)
    return 0
