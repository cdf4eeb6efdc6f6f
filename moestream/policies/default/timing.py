"""`python -m moestream.policies.default.timing`: what one layer decision of a trained
`default` costs on this machine, and the memory its model and one decision take.

A decision per layer is everything the policy does on the compute thread for that layer: observe
the routing, predict the next `--horizon-layers`, plan the prefetch, and the eviction hooks of the
device tier's accesses and admissions (victim choices included); begin_iteration is charged to the
token's first layer. The time is wall time (perf_counter, as `bench policies` takes it): this
thread's CPU time would keep other processes out, but reading it costs about 0.75 µs here, and a
layer times some twenty hooks; the median keeps what other processes add out instead. The tokens
of --trace replay as one decode stream through a cache of --cache-ratio of the experts. Prints the
median and 90th percentile in microseconds, the model's bytes, one sequence's state, and what one
layer decision allocates (tracemalloc peak).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from moestream.cache import ExpertCache
from moestream.policies.contracts import CacheView
from moestream.policies.default.policy import Default
from moestream.policies.default.state import SequenceHistory
from moestream.policies.driver import TimedEviction
from moestream.topology import ExpertKey
from moestream.trace.format import load_trace
from moestream.trace.replay import decode_stream
from moestream.tracer import Tracer, since


@dataclass
class Figures:
    micros: np.ndarray  # [decisions] µs per layer decision
    model_bytes: int
    sequence_bytes: int
    decision_alloc_bytes: int


def measure(policy: Default, trace, cache_ratio: float, horizon: int, max_tokens: int) -> Figures:
    topology, predictor, observers = policy.topology, policy.predictor, policy.observers()
    hooks = Tracer()  # the eviction hooks' time (lane "policy")
    cache = ExpertCache(max(1, int(topology.total_experts * cache_ratio)),
                        TimedEviction(policy.make_eviction("device"), hooks))
    keys = [[ExpertKey(layer, e) for e in range(topology.num_experts)] for layer in range(topology.num_layers)]
    micros, allocs, clock = [], [], time.perf_counter
    for tokens, it in enumerate(decode_stream(trace)):
        if tokens == max_tokens:
            break
        start = clock()
        for observer in observers:
            observer.begin_iteration(it.ctx)
        carried = clock() - start
        for event in it.events:
            view = CacheView(cache.resident(), frozenset(), cache.capacity, event.layer, topology.num_layers)
            tracing = tokens == max_tokens // 2 and event.layer == topology.num_layers // 2
            if tracing:
                tracemalloc.start()
            start = clock()
            for observer in observers:  # the predictor, and the duel's ghosts
                observer.observe(event)
            policy.planner.plan(predictor.predict(event.layer, horizon), view)
            decided, before = clock() - start, hooks.totals()
            for expert in event.expert_ids.ravel().tolist():  # the mechanism's work, whose hooks alone count
                if cache.access(keys[event.layer][expert]) is None:
                    cache.admit(keys[event.layer][expert])
            micros.append((decided + since(hooks.totals(), before, "policy").seconds + carried) * 1e6)
            carried = 0.0
            if tracing:
                allocs.append(tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
        for seq in it.finished:
            predictor.end_sequence(seq)
    history = SequenceHistory(policy.config.window_tokens, topology.num_layers, topology.num_experts)
    sequence_bytes = sum(a.nbytes for a in vars(history).values() if isinstance(a, np.ndarray))
    model_bytes = predictor.weights.num_bytes + predictor.memory.nbytes
    return Figures(np.array(micros), model_bytes, sequence_bytes, max(allocs, default=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moestream.policies.default.timing", description=__doc__)
    parser.add_argument("--predictor-dir", required=True, help="a trained default directory")
    parser.add_argument("--trace", required=True, help="routing trace (.npz) to replay")
    parser.add_argument("--tokens", help="tokens jsonl of a DeepSeek routing npz")
    parser.add_argument("--max-tokens", type=int, default=2000, help="tokens to replay (default 2000)")
    parser.add_argument("--cache-ratio", type=float, default=0.25)
    parser.add_argument("--horizon-layers", type=int, default=2)
    args = parser.parse_args(argv)
    trace = load_trace(args.trace, args.tokens)
    policy = Default(trace.topology, predictor_dir=args.predictor_dir)
    figures = measure(policy, trace, args.cache_ratio, args.horizon_layers, args.max_tokens)
    micros = figures.micros
    print(f"default: {len(micros)} layer decisions; median {np.median(micros):.1f} µs, "
          f"mean {micros.mean():.1f} µs, p90 {np.percentile(micros, 90):.1f} µs per layer decision")
    print(f"model: {figures.model_bytes / 2**20:.2f} MiB of weights and token memory; state per sequence: "
          f"{figures.sequence_bytes / 2**10:.0f} KiB; one layer decision allocates "
          f"{figures.decision_alloc_bytes / 2**10:.1f} KiB (tracemalloc peak)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
