"""Cold read bandwidth of the disk tier, measured with the store's own DiskReader.

Used by `moestream bench engine` to report what the disk delivers (the O_DIRECT bandwidth of its
physical limit; under --streaming, the reference its streaming is held against). Files are dropped from
the page cache first and read with O_DIRECT where the filesystem allows it, so the figures are disk
figures, not memory copies. `cold_read_samples` takes one sample
of each way of reading: a file front to back (the sequential reference, two ways), random experts a
decode step's top_k at a time, and a layer pass (every expert of a few layers, one batch per layer,
as the store reads a layer whose tokens route to all its experts); a `ColdReadLog` keeps the samples
of a benchmark in the order taken, so that a run between two samples is compared with the disk's
speed at that time. Knows no experts beyond locations.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from moestream.checkpoint.layout import ExpertIndex, ExpertLocation, Segment
from moestream.store.disk import BLOCK_BYTES, NUM_WORKERS, STAGING_BYTES, DiskReader
from moestream.store.pool import SlotPool
from moestream.topology import ExpertKey

DEFAULT_BLOCK_BYTES = 16 * 2**20
SEQUENTIAL_BYTES = 256 * 2**20  # read per sequential sample
RANDOM_EXPERT_BATCHES = 16  # batches of top_k random experts per random-read sample
LAYERS_PER_PASS = 4  # layers read per layer-pass sample
COLD_READ_METHODS = ("sequential", "sequential_reader", "random_experts", "layer_pass")


def cold_read_samples(shard: Path, index: ExpertIndex, seed: int, direct_io: bool = True) -> dict[str, float]:
    """Bytes per second of each method of COLD_READ_METHODS: the shard's first SEQUENTIAL_BYTES front to
    back (16 MiB requests one at a time; the store's reader), random experts (a layer's top_k per read
    batch) and a layer pass (each layer's experts in one read batch), both chosen by seed."""
    topology = index.topology
    return {
        "sequential": sequential_read_bandwidth(shard, SEQUENTIAL_BYTES, direct_io=direct_io),
        "sequential_reader": sequential_read_bandwidth(shard, SEQUENTIAL_BYTES, direct_io=direct_io,
                                                       request_bytes=STAGING_BYTES, num_workers=NUM_WORKERS),
        "random_experts": expert_stream_bandwidth(random_experts(index, seed), direct_io, batch=topology.top_k),
        "layer_pass": expert_stream_bandwidth(layer_pass(index, seed), direct_io, batch=topology.num_experts),
    }


class ColdReadLog:
    """Cold read samples taken over a benchmark: each method's rates (bytes per second) in the order taken."""

    def __init__(self):
        self.rates: dict[str, list[float]] = {method: [] for method in COLD_READ_METHODS}

    def take(self, shard: Path, index: ExpertIndex, seed: int, direct_io: bool = True) -> None:
        """Appends one sample of each method (see cold_read_samples)."""
        for method, rate in cold_read_samples(shard, index, seed, direct_io).items():
            self.rates[method].append(rate)

    def medians(self) -> dict[str, float]:
        return {method: float(np.median(rates)) if rates else 0.0 for method, rates in self.rates.items()}

    def reference(self) -> float:
        """The sequential reference: the better median of the two ways of reading a file front to back."""
        medians = self.medians()
        return max(medians["sequential"], medians["sequential_reader"])

    def reference_around(self, position: int) -> float:
        """The mean sequential reference (the better way, per sample) of samples position and position + 1
        (the last sample alone): the disk's speed around a run taken between them."""
        pairs = list(zip(self.rates["sequential"], self.rates["sequential_reader"]))[position : position + 2]
        if not pairs:
            raise ValueError(f"no cold read sample at position {position}")
        return sum(max(pair) for pair in pairs) / len(pairs)


def drop_page_cache(files: Iterable[str | Path]) -> None:
    """Asks the kernel to drop the files' cached pages, so that their next reads come from disk."""
    with DiskReader(direct_io=False) as reader:
        for file in files:
            reader.drop_cache(file)


def random_experts(index: ExpertIndex, seed: int) -> list[ExpertLocation]:
    """RANDOM_EXPERT_BATCHES batches of top_k distinct experts of a random layer each."""
    topology = index.topology
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(RANDOM_EXPERT_BATCHES):
        layer = int(rng.integers(topology.num_layers))
        experts = rng.choice(topology.num_experts, size=min(topology.top_k, topology.num_experts), replace=False)
        batches += [index.locations[ExpertKey(layer, int(e))] for e in experts]
    return batches


def layer_pass(index: ExpertIndex, seed: int) -> list[ExpertLocation]:
    """Every expert of LAYERS_PER_PASS consecutive layers (from a layer chosen by seed), layer by layer."""
    topology = index.topology
    first = seed * LAYERS_PER_PASS % topology.num_layers
    layers = [(first + i) % topology.num_layers for i in range(min(LAYERS_PER_PASS, topology.num_layers))]
    return [index.locations[ExpertKey(layer, e)] for layer in layers for e in range(topology.num_experts)]


def sequential_read_bandwidth(path: str | Path, nbytes: int | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
                              direct_io: bool = True, request_bytes: int | None = None,
                              num_workers: int = 1) -> float:
    """Bytes per second reading the first nbytes of path (all of it by default) in block_bytes reads.

    Each block is one read request by default; with request_bytes, a block is cut into requests of
    that size, num_workers of them in flight together."""
    path = Path(path)
    nbytes = min(nbytes or os.path.getsize(path), os.path.getsize(path))
    if nbytes < 1 or block_bytes < 1:
        raise ValueError(f"nothing to read: {path} gives {nbytes} bytes in blocks of {block_bytes}")
    dst = SlotPool(1, block_bytes).slot(0)  # [block_bytes], block-aligned: whole blocks land in place
    request = -(-(request_bytes or block_bytes) // BLOCK_BYTES) * BLOCK_BYTES
    with DiskReader(direct_io=direct_io, staging_bytes=request, num_workers=num_workers) as reader:
        reader.drop_cache(path)
        began = time.perf_counter()
        for offset in range(0, nbytes, block_bytes):
            reader.read([Segment(path, offset, min(block_bytes, nbytes - offset))], dst)
        return nbytes / (time.perf_counter() - began)


def expert_stream_bandwidth(locations: Sequence[ExpertLocation], direct_io: bool = True, batch: int = 1) -> float:
    """Bytes per second reading the experts at locations, `batch` experts per read call (in flight together)."""
    if not locations or batch < 1:
        raise ValueError("need expert locations to read and a batch of at least 1")
    pool = SlotPool(batch, max(loc.nbytes for loc in locations))
    with DiskReader(direct_io=direct_io) as reader:
        for file in {seg.file for loc in locations for seg in loc.segments}:
            reader.drop_cache(file)
        began = time.perf_counter()
        for i in range(0, len(locations), batch):
            group = locations[i : i + batch]
            reader.read_batch([(loc.segments, pool.slot(j, loc.residue(BLOCK_BYTES))) for j, loc in enumerate(group)])
        return sum(loc.nbytes for loc in locations) / (time.perf_counter() - began)
