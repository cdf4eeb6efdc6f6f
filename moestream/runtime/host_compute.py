"""Experts computed where their host bytes are: the mechanism behind `--host-compute`.

For a layer step, `HostCompute.place` asks the rule (`moestream.policies.compute_placement`) which
device-tier misses compute on the host, given the cost model `measure_costs` takes when the engine
opens, and pins their host slots. `start` runs their MLPs on host threads from views of those slots, or
of its own buffers for misses only on disk (`ExpertStore.read_direct`: no tier, no link). The math and
kernel are the device's, so outputs are bit-identical where both are the CPU's; `HostWork.result` gives
the [S, H] rows that replace the device's. Where `placements` is a list, each layer step's choice is
appended. Knows no rule by name and no policy.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from moestream.policies.compute_placement import ComputeCosts, ComputeRule, compute_rule, layer_candidates
from moestream.runtime.expert_math import ExpertMath, Weights
from moestream.runtime.layer_experts import LAYER_KERNELS, LayerRows
from moestream.topology import ExpertKey


@dataclass
class HostWork:
    """A layer's experts computing on the host: their keys and the [S, H] rows they give (zero elsewhere)."""

    keys: list[ExpertKey]
    future: Future
    mask: torch.Tensor  # [S] bool on the device: rows whose expert computed on the host

    def result(self, device: torch.device) -> torch.Tensor:
        return self.future.result().to(device, non_blocking=True)  # [S, H]


class HostCompute:
    def __init__(self, rule: ComputeRule, num_threads: int, store, device: str, costs: ComputeCosts | None = None,
                 decode: Callable[[Weights], Weights] | None = None):
        """costs: None: measured by `calibrate` at the first layer; decode: a quantized decoder with host scratch."""
        self.rule, self.store, self.device, self.costs, self.decode = rule, store, device, costs, decode
        self.views: Callable[[torch.Tensor], Weights] = store.index.views
        self.num_threads = num_threads
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="moestream-host-compute")
        self.num_computed = 0  # experts computed on the host since the last take_count
        self.placements: list[tuple[int, tuple[int, ...]]] | None = None  # a list: each layer step's host experts
        self.buffers: list[torch.Tensor] = []  # where misses only on disk are read (at most DISK_CANDIDATES)

    def calibrate(self, math: ExpertMath, hidden: torch.Tensor, decode: Callable[[Weights], Weights] | None) -> None:
        slot = torch.zeros(self.store.topology.expert_bytes, dtype=torch.uint8)
        views = self.views(slot)
        weights = {k: v.clone() for k, v in (decode(views) if decode is not None else views).items()}
        self.costs = measure_costs(weights, math, hidden[:1], self.device, self.store.topology.expert_bytes,
                                   self.num_threads)

    def place(self, keys: list[ExpertKey], rows: dict[int, int]) -> dict[ExpertKey, torch.Tensor | None]:
        """The experts the rule sends to the host: their host slots, pinned before the device's fetch may
        evict them, or None for a miss only on disk; rows: each expert's row count."""
        device, host = self.store.resident("device"), self.store.resident("host")
        misses = [k for k in keys if k not in device]
        candidates = layer_candidates(misses, lambda k: rows[k.expert], host.__contains__)
        chosen = frozenset()
        if candidates:
            hits = [rows[k.expert] for k in keys if k in device]
            chosen = self.rule.place(candidates, hits, len(misses) - len(candidates), self.costs)
        if self.placements is not None and keys:
            self.placements.append((keys[0].layer, tuple(sorted(key.expert for key in chosen))))
        if not chosen:
            return {}
        held = self.store.hold_host([c.key for c in candidates if c.key in chosen and not c.from_disk])
        return held | {c.key: None for c in candidates if c.key in chosen and c.from_disk}

    def release(self, slots: dict[ExpertKey, torch.Tensor | None]) -> None:
        self.store.release_host([key for key, slot in slots.items() if slot is not None])

    def start(self, slots: dict[ExpertKey, torch.Tensor | None], math: ExpertMath, rows: LayerRows,
              spans: dict[int, tuple[int, int]], kernel: str) -> HostWork:
        held = list(slots)
        mask = torch.zeros(rows.num_rows, dtype=torch.bool, device=rows.inputs.device)
        for key in held:
            start, end = spans[key.expert]
            mask[rows.order[start:end]] = True
        future = self.pool.submit(self._compute, held, slots, math, rows, spans, kernel)
        self.num_computed += len(held)
        return HostWork(held, future, mask)

    def _compute(self, keys, slots, math, rows: LayerRows, spans, kernel: str) -> torch.Tensor:
        try:
            host = LayerRows(math, rows.inputs.to("cpu"), rows.scale.to("cpu"), rows.order.to("cpu"), rows.num_rows,
                             rows.out_dtype, self.decode)
            layer = LAYER_KERNELS.create(kernel, host)
            read = 0
            for key in keys:
                slot = slots[key]
                if slot is None:  # only on disk: read into a buffer of ours
                    slot, read = self._buffer(read), read + 1
                    self.store.read_direct(key, slot)
                layer.add(self.views(slot), *spans[key.expert])
            layer.flush()
            return layer.result()  # [S, H] on the host
        finally:
            self.release(slots)

    def _buffer(self, number: int) -> torch.Tensor:
        while len(self.buffers) <= number:
            self.buffers.append(torch.empty(self.store.topology.expert_bytes, dtype=torch.uint8))
        return self.buffers[number]

    def take_count(self) -> int:
        count, self.num_computed = self.num_computed, 0
        return count

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def host_compute_for(config, store, host_decoder: Callable[[], Callable | None]) -> HostCompute | None:
    """The engine's host compute (None: --host-compute off); host_decoder() makes a decoder with host scratch."""
    if config.host_compute == "off":
        return None
    return HostCompute(compute_rule(config.host_compute), config.host_threads, store, config.device,
                       decode=host_decoder())


def measure_costs(weights: Weights, math: ExpertMath, hidden: torch.Tensor, device: str, expert_bytes: int,
                  num_threads: int) -> ComputeCosts:
    """The cost model, measured once: one expert's MLP at 1 and 64 rows on host and device, and a copy up."""
    params = sum(v.numel() for v in weights.values())
    host_stream, host_flops = _mlp_rates(weights, math, hidden.to("cpu"), expert_bytes, params)
    device_weights = {name: v.to(device) for name, v in weights.items()}
    dev_stream, dev_flops = _mlp_rates(device_weights, math, hidden.to(device), expert_bytes, params)
    data = torch.zeros(expert_bytes, dtype=torch.uint8)
    copy_ms = _best_ms(lambda: data.to(device, copy=True), device)
    return ComputeCosts(link_bytes_per_ms=expert_bytes / copy_ms, host_bytes_per_ms=host_stream * num_threads,
                        device_bytes_per_ms=dev_stream, host_flops_per_ms=host_flops * num_threads,
                        device_flops_per_ms=dev_flops, expert_bytes=expert_bytes, expert_params=params,
                        row_bytes=hidden.shape[-1] * hidden.element_size())


def _mlp_rates(weights: Weights, math: ExpertMath, hidden: torch.Tensor, expert_bytes: int,
               params: int) -> tuple[float, float]:
    """(weight bytes per ms at one row, flops per ms of each row beyond it) of one expert's MLP."""
    one, many = hidden.new_zeros(1, hidden.shape[-1]), hidden.new_zeros(64, hidden.shape[-1])
    device = str(hidden.device)
    stream_ms = _best_ms(lambda: math.down(math.act(math.up(one, weights)), weights), device)
    compute_ms = _best_ms(lambda: math.down(math.act(math.up(many, weights)), weights), device)
    return expert_bytes / stream_ms, 2.0 * 63 * params / max(compute_ms - stream_ms, 1e-6)


def _best_ms(run: Callable[[], object], device: str, repeats: int = 3) -> float:
    """The fastest of a few runs, in ms (after one warm-up)."""
    run()
    best = float("inf")
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda device: None
    for _ in range(repeats):
        sync(device)
        began = time.perf_counter()
        run()
        sync(device)
        best = min(best, (time.perf_counter() - began) * 1e3)
    return max(best, 1e-6)
