"""`moestream bench decision-cost` (also `python -m moestream.bench.decision_cost`): what one layer decision
of a trained `default` costs on this machine, measured as `bench policies` measures it, and the memory its
model and one decision take.

The replay is `bench policies`' own (`moestream.bench.tools.overhead`): a `PolicyDriver` calls the policy
(observe, predict, plan, each a span of its tracer) and a `LayerTimer` serves each layer's experts
from a device tier of --cache-ratio of the experts (demand loads first, the layer's own experts
protected), admits the plan's prefetches, and reads each layer decision's time from the tracer, the
tier's eviction hooks (`TimedEviction`: victims, inserts, removes, accesses) included; begin_iteration
counts in the token's first layer. The time is wall time (perf_counter); the median keeps what other
processes add out. The tokens of --trace replay as one decode stream. `lru` replays the same tokens
the same way in the same run, so its median and the difference (the target of issue 46) come from
one run. Prints the median, mean and 90th percentile in microseconds, the model's bytes, one
sequence's state, and the most one policy call of a middle layer decision allocates (tracemalloc).
"""

from __future__ import annotations

import argparse
import itertools
import tracemalloc
from dataclasses import dataclass

import numpy as np

from moestream.bench.sim.replay import decode_stream
from moestream.bench.tools.overhead import LayerTimer
from moestream.cache import ExpertCache
from moestream.config import EngineConfig
from moestream.contracts import Policy
from moestream.policies import POLICIES
from moestream.policies.default.policy import Default
from moestream.policies.default.state import SequenceHistory
from moestream.policies.driver import PolicyDriver, TimedEviction
from moestream.settings import add_arguments
from moestream.trace.format import load_trace
from moestream.tracer import Tracer


@dataclass
class Figures:
    micros: np.ndarray  # [decisions] µs per layer decision
    model_bytes: int
    sequence_bytes: int
    decision_alloc_bytes: int  # the most one policy call of a middle layer decision allocates


class PeakTracer(Tracer):
    """The driver's tracer; while armed, each call into the policy it times also has its allocations taken
    (tracemalloc's peak over the call, above what was allocated when it began), the largest kept.
    Unarmed it is a plain Tracer: arming puts the measuring span and call on the instance."""

    armed = False
    peak = 0

    def arm(self) -> None:
        tracemalloc.start()
        self.armed, self.span, self.call = True, self._measured_span, self._measured_call

    def disarm(self) -> None:
        del self.span, self.call
        self.armed = False
        tracemalloc.stop()

    def _measured_span(self, lane: str, label=""):
        return _Allocations(self, Tracer.span(self, lane, label))

    def _measured_call(self, lane: str, label, function, argument):
        with _Allocations(self, None):
            return Tracer.call(self, lane, label, function, argument)


class _Allocations:
    def __init__(self, tracer: PeakTracer, inner):
        self.tracer, self.inner = tracer, inner

    def __enter__(self) -> None:
        tracemalloc.reset_peak()
        self.began = tracemalloc.get_traced_memory()[0]
        if self.inner is not None:
            self.inner.__enter__()

    def __exit__(self, *raised) -> None:
        if self.inner is not None:
            self.inner.__exit__(*raised)
        self.tracer.peak = max(self.tracer.peak, tracemalloc.get_traced_memory()[1] - self.began)


class TracedTimer(LayerTimer):
    """`LayerTimer` that arms its tracer (and tracemalloc) for one layer decision, the `traced`-th."""

    def __init__(self, driver: PolicyDriver, cache: ExpertCache, num_layers: int, traced: int):
        super().__init__(driver, cache, num_layers)
        self.traced = traced

    def predicted(self, layer_now: int, predictions: list) -> None:
        super().predicted(layer_now, predictions)
        if layer_now < 0:  # a token's start: part of its first layer decision
            return
        tracer = self.driver.tracer
        if tracer.armed:
            tracer.disarm()
        elif len(self.seconds) == self.traced:  # the next layer decision is traced
            tracer.arm()


def layer_micros(policy: Policy, trace, cache_ratio: float, horizon: int, max_tokens: int,
                 traced: int = -1) -> tuple[np.ndarray, int]:
    """µs of each layer decision over the first max_tokens decode tokens of trace (bench.tools.overhead's replay),
    and the allocation figure of the `traced`-th decision (0 if none)."""
    topology = trace.topology
    eviction = policy.make_eviction("device")
    tracer = PeakTracer()
    driver = PolicyDriver(policy, [eviction], horizon_layers=horizon, tracer=tracer)
    capacity = max(topology.top_k, int(topology.total_experts * cache_ratio))  # as overhead_us_per_layer
    timer = TracedTimer(driver, ExpertCache(capacity, TimedEviction(eviction, tracer)), topology.num_layers, traced)
    driver.run(itertools.islice(decode_stream(trace), max_tokens), timer)
    if tracer.armed:
        tracer.disarm()
    return 1e6 * np.array(timer.seconds), tracer.peak


def measure(policy: Default, trace, cache_ratio: float, horizon: int, max_tokens: int) -> Figures:
    topology, predictor = policy.topology, policy.predictor
    middle = (min(max_tokens, trace.num_tokens) // 2) * topology.num_layers + topology.num_layers // 2
    micros, allocated = layer_micros(policy, trace, cache_ratio, horizon, max_tokens, traced=middle)
    history = SequenceHistory(policy.config.window_tokens, topology.num_layers, topology.num_experts)
    sequence_bytes = sum(a.nbytes for a in vars(history).values() if isinstance(a, np.ndarray))
    model_bytes = predictor.weights.num_bytes + predictor.memory.nbytes + predictor.reuse.nbytes
    return Figures(micros, model_bytes, sequence_bytes, allocated)


def add_parser(kinds) -> None:
    parser = kinds.add_parser("decision-cost", help="µs and memory of one layer decision of a trained default",
                              description=__doc__)
    add_flags(parser)
    parser.set_defaults(handler=run)


def add_flags(parser) -> None:
    parser.add_argument("--predictor-dir", required=True, help="a trained default directory")
    parser.add_argument("--trace", required=True, help="routing trace (.npz) to replay")
    parser.add_argument("--tokens", help="tokens jsonl of a DeepSeek routing npz")
    parser.add_argument("--max-tokens", type=int, default=2000, help="tokens to replay (default 2000)")
    parser.add_argument("--cache-ratio", type=float, default=0.1, help="device slots / routed experts (default "
                        "0.1, as `bench policies` times)")
    add_arguments(parser, EngineConfig, only=("horizon_layers",))


def run(args) -> int:
    trace = load_trace(args.trace, args.tokens)
    policy = Default(trace.topology, predictor_dir=args.predictor_dir)
    figures = measure(policy, trace, args.cache_ratio, args.horizon_layers, args.max_tokens)
    lru, _ = layer_micros(POLICIES.create("lru", trace.topology), trace, args.cache_ratio, args.horizon_layers,
                          args.max_tokens)
    micros = figures.micros
    print(f"default: {len(micros)} layer decisions; median {np.median(micros):.1f} µs, "
          f"mean {micros.mean():.1f} µs, p90 {np.percentile(micros, 90):.1f} µs per layer decision")
    print(f"lru, same replay: median {np.median(lru):.1f} µs; default minus lru: "
          f"{np.median(micros) - np.median(lru):.1f} µs per layer decision")
    print(f"model: {figures.model_bytes / 2**20:.2f} MiB of weights, token memory and reuse model; state per sequence: "
          f"{figures.sequence_bytes / 2**10:.0f} KiB; one policy call of a layer decision allocates at most "
          f"{figures.decision_alloc_bytes / 2**10:.1f} KiB (tracemalloc peak)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moestream.bench.decision_cost", description=__doc__)
    add_flags(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
