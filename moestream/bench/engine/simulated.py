"""The engine's replayed runs in the simulator: the same trace rows, iteration by iteration, under a cost
model calibrated from the engine's own measurements. Used for the physical limit of `bench engine`
(what the offline `oracle` must move) and for `bench fidelity` (engine vs simulator).

Figures are over the decode iterations only, as the engine's (prefill iterations run first and
warm the caches). Knows no policy by name beyond the offline bound it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moestream.bench.sim.config import SimConfig
from moestream.bench.sim.cost import CostModel
from moestream.bench.sim.engine import StreamSimulator
from moestream.bench.sim.replay import decode_stream, iteration
from moestream.contracts import Policy
from moestream.topology import ExpertKey, Topology
from moestream.trace.replay import Iteration
from moestream.trace.schema import Trace


@dataclass(frozen=True)
class Replayed:
    """The rows one engine run processed, as a trace of their own, and its iterations' shapes."""

    trace: Trace  # rows in processing order; one sequence per prompt
    sizes: list[int]  # tokens of each engine iteration
    prefill: list[bool]  # whether each engine iteration was a prompt's prefill


def replayed(trace: Trace, iterations: list[list[int]], prefill: list[bool], model: Topology,
             token_ids: list[list[int]] | None = None, tokens: list[list[str]] | None = None,
             embeddings: list[list[list[float]]] | None = None) -> Replayed:
    """The sub-trace of the rows fed to each iteration (repeated rows, after a wrap, are new rows), with
    the replaying model's topology: its expert size, not the recorded model's, sets the bytes moved.
    token_ids / tokens / embeddings ([T, H] each): the engine's own per iteration (what its policy saw), in
    place of the trace's."""
    rows = np.concatenate([np.asarray(r, dtype=np.int64) for r in iterations])  # [N]
    sizes = [len(r) for r in iterations]
    prompt = np.repeat(np.cumsum(prefill) - 1, sizes)  # [N] the prompt of each row
    starts = np.flatnonzero(np.r_[True, prompt[1:] != prompt[:-1]])
    positions = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
    is_prefill = np.repeat(np.asarray(prefill, dtype=bool), sizes)
    sub = Trace(topology=model, experts=trace.experts[rows], seq_ids=prompt.astype(np.int32),
                positions=positions.astype(np.int32), is_prefill=is_prefill,
                gate_weights=None if trace.gate_weights is None else trace.gate_weights[rows],
                token_ids=_flat(token_ids, sizes, np.int32), tokens=_flat(tokens, sizes, list),
                embeddings=_flat(embeddings, sizes, np.float32),
                source=f"replayed rows of {trace.source}")
    return Replayed(sub, sizes, list(prefill))


def _flat(per_iteration: list[list] | None, sizes: list[int], kind):
    """One value per row from per-iteration lists of the iterations' sizes; None unless all are there."""
    if not per_iteration or [len(values) for values in per_iteration] != sizes:
        return None
    flat = [value for values in per_iteration for value in values]
    return np.asarray(flat, dtype=kind) if kind is not list else flat


def engine_iterations(run: Replayed) -> list[Iteration]:
    """The engine's iterations exactly: a prompt's prefill as one iteration, then one per decode token."""
    bounds = np.r_[0, np.cumsum(run.sizes)]
    ends = [i + 1 == len(run.prefill) or run.prefill[i + 1] for i in range(len(run.prefill))]
    return [iteration(run.trace, np.arange(bounds[i], bounds[i + 1]), i,
                      (int(run.trace.seq_ids[bounds[i]]),) if ends[i] else ())
            for i in range(len(run.sizes))]


def sim_ratio(device_slots: int, topology: Topology) -> float:
    """The cache ratio whose slot count (`Topology.slots_for_ratio`) is the engine's device slots."""
    return min(1.0, (device_slots + 0.5) / topology.total_experts)


def simulate(policy: Policy, run: Replayed, iterations: list[Iteration], ratio: float, cost: CostModel,
             expert_order: str = "ready", modelled_link: bool = True, link_figures=None,
             host_compute: str = "off", compute_costs=None, warm: list[ExpertKey] = (), warm_host: list[ExpertKey] = (),
             host_slots: int = 0, sync: bool = False, num_expert_chunks: int = SimConfig.num_expert_chunks,
             chunks_in_flight: int = SimConfig.chunks_in_flight) -> dict:
    """Decode-phase figures of a replay of run's rows (iterations of prompt rows are not counted):
    hit rate, stall and bytes per token, TPOT, and where host compute runs, its choice at every layer step
    (prefill's too, as the engine's `host_placements`). The other arguments are SimConfig's: "loaded" for a
    --sync engine; no modelled link where the engine ran without one, the engine's own figures where it ran
    with them; its host slots and chunks. warm, warm_host: what the engine's device and host tiers held when
    it began (its warm-up's), admitted in that order first."""
    sim = StreamSimulator(policy, SimConfig(cache_ratio=ratio, cost=cost, expert_order=expert_order,
                                            modelled_link=modelled_link, link_figures=link_figures,
                                            host_compute=host_compute, compute_costs=compute_costs,
                                            host_slots=host_slots, sync=sync,
                                            num_expert_chunks=num_expert_chunks,
                                            chunks_in_flight=chunks_in_flight))
    for tier, keys in ((sim.device, warm), (sim.host, warm_host if sim.host is not None else ())):
        for key in keys:
            tier.admit(key)
    decode = {"hits": 0, "accesses": 0, "on_host": 0, "stall_ms": 0.0, "bytes": 0, "tokens": 0, "ms": 0.0, "steps": 0}
    for it in iterations:
        before = _snapshot(sim)
        sim.run([it])
        if run.trace.is_prefill[it.rows].any():
            continue
        after = _snapshot(sim)
        for name in decode:
            decode[name] += after[name] - before[name]
    tokens = max(decode["tokens"], 1)
    return {
        "hit_rate": decode["hits"] / lookups if (lookups := decode["accesses"] - decode["on_host"]) else 1.0,
        "stall_ms_per_token": decode["stall_ms"] / tokens,
        "bytes_per_token": decode["bytes"] / tokens,
        "tpot_ms": decode["ms"] / max(decode["steps"], 1),
        "decode_tokens": decode["tokens"],
    } | ({} if sim.host_compute is None else {
        "host_placements": [[layer, list(experts)] for layer, experts in sim.host_compute.placements]})


def _snapshot(sim: StreamSimulator) -> dict:
    counters = sim.counters
    return {"hits": counters.layers.total_hits, "accesses": counters.layers.total_accesses,
            "on_host": counters.host_computed,  # not the device's lookups, as in the engine's hit rate
            "stall_ms": counters.stall_ms, "bytes": sum(counters.bytes_by_link.values()),  # every link, as the engine's
            "tokens": counters.num_tokens, "ms": sim.now, "steps": counters.num_iterations}


def oracle_bytes_per_token(run: Replayed, ratio: float, cost: CostModel) -> float:
    """What the offline oracle moves per decode token at this ratio, the rows replayed one token per
    iteration (the order the offline future index knows), its speculation one expert a round: the bound of
    the forecast, not of the round size (a round of several moves a prefetch a later plan displaces)."""
    from moestream.policies import POLICIES

    oracle = POLICIES.create("oracle", run.trace.topology)
    oracle.prepare(run.trace)
    return simulate(oracle, run, list(decode_stream(run.trace)), ratio, cost,
                    chunks_in_flight=SimConfig.num_expert_chunks)["bytes_per_token"]
