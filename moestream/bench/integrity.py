"""`moestream bench integrity`: what the integrity checks cost beside the work they guard.

Digest check: experts read cold by the store's reader (a read batch per layer), checked as the engine
checks them (`Manifest.check_batch`): check time over read time. Finite check: a decode step's checks of
each MoE layer's output [1, H] and the logits [1, V], per token, on the compute device. Prints figures,
asserts nothing; `bench engine` prints the same figures.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from moestream.bench import add_model_flags, model_dir
from moestream.config import EngineConfig
from moestream.settings import add_arguments

NUM_LAYERS_SAMPLED = 8  # MoE layers whose experts are read (spread over the model)
EXPERTS_PER_LAYER = 8  # experts read per sampled layer, in one read batch
FINITE_REPEATS = 200  # decode steps timed for the finite check


def add_parser(kinds) -> None:
    parser = kinds.add_parser("integrity", help="cost of the expert digest check and of the finite check")
    add_model_flags(parser)
    add_arguments(parser, EngineConfig, only=("device", "direct_io"))
    parser.set_defaults(handler=run)


def run(args) -> int:
    report_integrity(model_dir(args), args.device, args.direct_io)
    return 0


def report_integrity(model: Path, device: str = "cpu", direct_io: bool = True) -> dict:
    """Measures both checks on the checkpoint, prints them, returns the figures."""
    figures = measure_digest_check(model, direct_io) | measure_finite_check(model, device)
    print(f"digest check: {figures['digest_check_ms_per_expert']:.3f} ms per expert beside a disk read of "
          f"{figures['disk_read_ms_per_expert']:.3f} ms: ratio {figures['digest_check_vs_disk_read']:.4f} "
          f"({figures['digest_bytes_per_s'] / 2**30:.1f} GiB/s, {figures['experts_sampled']} experts)")
    print(f"finite check: {figures['finite_check_us_per_token']:.1f} us per token "
          f"({figures['finite_checks_per_token']} checks: each MoE layer's expert output and the logits)")
    return figures


def measure_digest_check(model: Path, direct_io: bool = True) -> dict:
    """Cold reads of sampled experts by layer, and the digest check of the same bytes."""
    import torch

    from moestream.checkpoint.index import build_index
    from moestream.checkpoint.manifest import Manifest, digest, expert_pieces
    from moestream.progress import progress_bar
    from moestream.store.disk import DiskReader

    checkpoint = build_index(model)
    topology, locations = checkpoint.topology, checkpoint.experts.locations
    sampled = min(NUM_LAYERS_SAMPLED, topology.num_layers)
    layers = sorted({round(i * (topology.num_layers - 1) / max(sampled - 1, 1)) for i in range(sampled)})
    step = max(topology.num_experts // EXPERTS_PER_LAYER, 1)
    batches = [[key for key in locations if key.layer == layer and key.expert % step == 0][:EXPERTS_PER_LAYER]
               for layer in layers]
    pieces = expert_pieces(checkpoint)
    read_s, check_s = 0.0, 0.0
    with DiskReader(direct_io=direct_io) as reader:
        for file in {s.file for location in locations.values() for s in location.segments}:
            reader.drop_cache(file)
        for keys in progress_bar(batches, desc="digest check", unit="layer"):
            buffers = [torch.empty(topology.expert_bytes, dtype=torch.uint8) for _ in keys]  # [expert_bytes] each
            began = time.perf_counter()
            reader.read_batch([(locations[key].segments, buffer) for key, buffer in zip(keys, buffers)])
            read_s += time.perf_counter() - began
            digests = {key: tuple(digest(b.numpy()[p.slot_offset: p.slot_offset + p.nbytes]) for p in pieces[key])
                       for key, b in zip(keys, buffers)}
            manifest = Manifest(checkpoint.path, {key: pieces[key] for key in keys}, digests, {})
            began = time.perf_counter()
            manifest.check_batch(keys, buffers)
            check_s += time.perf_counter() - began
    count = sum(len(keys) for keys in batches)
    return {"experts_sampled": count, "disk_read_ms_per_expert": 1e3 * read_s / count,
            "digest_check_ms_per_expert": 1e3 * check_s / count, "digest_check_vs_disk_read": check_s / read_s,
            "digest_bytes_per_s": count * topology.expert_bytes / check_s}


def measure_finite_check(model: Path, device: str = "cpu") -> dict:
    """The checks of one decode token: [1, H] per MoE layer in the model's dtype, and [1, V] float logits."""
    import torch

    from moestream.checkpoint.index import build_index
    from moestream.runtime.finite import check_finite

    checkpoint = build_index(model)
    text = checkpoint.config.get_text_config()
    dtype = checkpoint.experts.layout[0].dtype
    outputs = [torch.randn(1, text.hidden_size, device=device).to(dtype) for _ in range(checkpoint.topology.num_layers)]
    logits = torch.randn(1, text.vocab_size, device=device)  # [1, V]
    samples = []
    for _ in range(FINITE_REPEATS):
        began = time.perf_counter()
        for layer, out in enumerate(outputs):  # [1, H] each
            check_finite(out, f"MoE layer {layer}")
        check_finite(logits, "the logits")
        samples.append(time.perf_counter() - began)
    return {"finite_check_us_per_token": 1e6 * statistics.median(samples), "finite_checks_per_token": len(outputs) + 1}
