"""Offline bounds that know the future of the replayed trace: Belady's MIN, lookahead-N and the oracle.

`LookaheadEviction` sees N tokens ahead and leaves the rest to a fallback (LRU; the default's eviction in
`default-lookahead-4`); the oracle predicts exactly, scored 1. All get the trace through `prepare(trace)`
and follow the replay from its events: time is (iteration, layer), the iteration order inferred from the
first iterations (decode, prefill or batched decode), then checked at every one. Simulator only (`offline`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from moestream.contracts import POLICIES, EvictionPolicy, Observer, Policy, Prediction, Predictor
from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.default import Default
from moestream.policies.eviction import LRUPolicy, NarrowingEviction, PriorityIndex
from moestream.topology import ExpertKey, Topology
from moestream.trace.replay import batched_rows
from moestream.trace.schema import Trace

NEVER = 2**31 - 1  # the next use of an expert that is never used again


class OfflinePolicyError(MoestreamError):
    """An offline policy replayed without its trace, or in an order it cannot follow."""


def schedule_steps(trace: "Trace", mode: str, batch_size: int = 1) -> np.ndarray:
    """The iteration of every trace row in a replay mode: decode, prefill or batched."""
    if mode == "batched":
        steps = np.empty(trace.num_tokens, dtype=np.int64)
        for step, (rows, _) in enumerate(batched_rows(trace, batch_size)):
            steps[rows] = step
        return steps
    if mode == "prefill":
        bounds = trace.sequence_bounds()
        return np.repeat(np.arange(len(bounds)), [end - start for _, start, end in bounds])
    return np.arange(trace.num_tokens)


def guess_mode(ctx: IterationContext) -> tuple[str, int]:
    """The replay mode an iteration suggests, and its batch size."""
    num_sequences = len(set(ctx.seq_ids.tolist()))
    if num_sequences > 1:
        return "batched", ctx.num_tokens
    return ("prefill" if ctx.num_tokens > 1 else "decode"), 1


class FutureIndex:
    """When each expert is needed, in replay order (position = iteration * L + layer)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.trace: "Trace | None" = None
        self.step = 0
        self._steps: np.ndarray | None = None
        self._mode = ""

    def reset(self, trace: "Trace") -> None:
        if trace.topology.num_layers != self.topology.num_layers or trace.topology.num_experts != self.topology.num_experts:
            raise OfflinePolicyError("the replayed trace's topology differs from the policy's")
        self.trace, self._steps, self._mode, self.step = trace, None, "", 0
        self.position = -1  # the replay's current (iteration * L + layer)
        bounds = trace.sequence_bounds()
        self._seq_start = {seq: (start, int(trace.positions[start])) for seq, start, _ in bounds}

    def begin(self, ctx: IterationContext) -> None:
        if self.trace is None:
            raise OfflinePolicyError("an offline policy needs prepare(trace) with the trace being replayed")
        if self._steps is None or not self._matches(ctx):
            self._build(ctx)
        self.step = ctx.step
        self.position = ctx.step * self.topology.num_layers - 1

    def observe(self, event: RoutingEvent) -> None:
        pos = self.position = self.step * self.topology.num_layers + event.layer
        base = event.layer * self.topology.num_experts
        flat, ptr, end = self._flat, self._ptr, self._end
        for expert in set(event.expert_ids.ravel().tolist()):
            kid = base + expert
            i = ptr[kid]
            while i < end[kid] and flat[i] <= pos:
                i += 1
            ptr[kid] = i

    def next_use(self, key: ExpertKey) -> int:
        if self._steps is None:
            raise OfflinePolicyError("an offline policy was asked about the future before the replay began")
        kid = key[0] * self.topology.num_experts + key[1]
        i = self._ptr[kid]
        return self._flat[i] if i < self._end[kid] else NEVER

    def experts_at(self, step: int, layer: int) -> list[int]:
        """The distinct experts needed at (step, layer), or [] past the end of the replay."""
        if step >= len(self._offsets) - 1:
            return []
        rows = self._order[self._offsets[step] : self._offsets[step + 1]]
        ids = self.trace.experts[rows, layer].ravel().tolist()
        return ids if len(rows) == 1 else list(dict.fromkeys(ids))

    def _row(self, seq: int, position: int) -> int:
        start, first = self._seq_start[int(seq)]
        return start + int(position) - first

    def _matches(self, ctx: IterationContext) -> bool:
        step = ctx.step
        if step >= len(self._offsets) - 1 or ctx.num_tokens != self._offsets[step + 1] - self._offsets[step]:
            return False
        return self._steps[self._row(ctx.seq_ids[0], ctx.positions[0])] == step

    def _build(self, ctx: IterationContext) -> None:
        """Infer the replay order from this iteration and index every expert's uses in it."""
        mode, batch_size = guess_mode(ctx)
        if self._steps is not None and mode == self._mode:
            mode = "prefill"  # a decode guess made on one-token prompts was wrong
        self._mode = mode
        self._index(schedule_steps(self.trace, mode, batch_size))
        if not self._matches(ctx):
            raise OfflinePolicyError(f"iteration {ctx.step} does not follow any replay order of the trace")
        self._seek(ctx.step * self.topology.num_layers)

    def _index(self, steps: np.ndarray) -> None:
        num_layers, num_experts = self.topology.num_layers, self.topology.num_experts
        self._steps = steps
        self._order = np.argsort(steps, kind="stable")
        self._offsets = np.searchsorted(steps[self._order], np.arange(int(steps.max(initial=-1)) + 2))
        span = int(steps.max(initial=0) + 1) * num_layers
        pos = steps[:, None] * num_layers + np.arange(num_layers)[None, :]  # [N, L]
        kid = np.arange(num_layers)[None, :, None] * num_experts + self.trace.experts.astype(np.int64)  # [N, L, K]
        uses = np.unique((kid * span + pos[:, :, None]).ravel())
        kids = uses // span
        self._flat = array("i", (uses % span).astype(np.int32).tobytes())
        bounds = np.searchsorted(kids, np.arange(num_layers * num_experts + 1))
        self._start, self._end = bounds[:-1].tolist(), bounds[1:].tolist()

    def _seek(self, pos: int) -> None:
        flat = np.frombuffer(self._flat, dtype=np.int32)
        self._ptr = [s + int(np.searchsorted(flat[s:e], pos)) for s, e in zip(self._start, self._end)]


class FutureTracker(Predictor):
    """Follows the replay for its policy's future index; predicts nothing."""

    def __init__(self, topology: Topology, future: FutureIndex):
        super().__init__(topology)
        self.future = future

    def begin_iteration(self, ctx: IterationContext) -> None:
        self.future.begin(ctx)

    def observe(self, event: RoutingEvent) -> None:
        self.future.observe(event)

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        return []


class OraclePredictor(FutureTracker):
    """Predicts exactly the experts of the next horizon_layers layers, with score 1."""

    def predict(self, layer_now: int, horizon_layers: int) -> list[Prediction]:
        future, num_layers = self.future, self.topology.num_layers
        predictions = []
        for target in range(layer_now + 1, layer_now + 1 + horizon_layers):
            ahead, layer = divmod(target, num_layers)
            for expert in future.experts_at(future.step + ahead, layer):
                predictions.append(Prediction(layer, expert, 1.0, ahead))
        return predictions


class BeladyEviction(EvictionPolicy):
    """Belady's MIN: evicts the candidate used farthest ahead (a PriorityIndex of -next use, set at every
    insert and access, the only moments a resident's next use changes)."""

    def __init__(self, future: FutureIndex):
        self.future = future
        self._index = PriorityIndex()

    def on_insert(self, key: ExpertKey) -> None:
        self._index.set(key, -self.future.next_use(key))

    def on_access(self, key: ExpertKey) -> None:
        self.on_insert(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._index.discard(key)

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        victim = self._index.first_in(candidates)
        return max(candidates, key=self.future.next_use) if victim is None else victim


class LookaheadEviction(NarrowingEviction):
    """Belady within `num_tokens` iterations of foresight: the fallback's choice among the candidates not
    needed within the window; if every candidate is needed, the one needed last."""

    def __init__(self, future: FutureIndex, num_tokens: int, fallback: EvictionPolicy | None = None):
        super().__init__(LRUPolicy() if fallback is None else fallback)
        self.future, self.window = future, num_tokens * future.topology.num_layers

    def victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        unforeseen = Unforeseen(candidates, self.future, self.future.position + self.window)
        if unforeseen:
            return self.inner.victim(unforeseen)
        return max(candidates, key=self.future.next_use)


class Unforeseen(Sequence):
    """The candidates not needed up to position `horizon`; membership costs O(1), as the cache's."""

    def __init__(self, candidates: Sequence[ExpertKey], future: FutureIndex, horizon: int):
        self._candidates, self._future, self._horizon = candidates, future, horizon
        self._list: list[ExpertKey] | None = None

    def __contains__(self, key) -> bool:
        return key in self._candidates and self._future.next_use(key) > self._horizon

    def __bool__(self) -> bool:
        if self._list is None:
            return any(self._future.next_use(key) > self._horizon for key in self._candidates)
        return bool(self._list)

    def __len__(self) -> int:
        return len(self._keys())

    def __getitem__(self, index):
        return self._keys()[index]

    def _keys(self) -> list[ExpertKey]:
        if self._list is None:
            self._list = [key for key in self._candidates if self._future.next_use(key) > self._horizon]
        return self._list


class _Offline(Policy):
    offline = True

    def __init__(self, topology: Topology):
        self.future = FutureIndex(topology)
        super().__init__(topology)

    def make_predictor(self) -> Predictor:
        return FutureTracker(self.topology, self.future)

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return BeladyEviction(self.future)

    def prepare(self, trace: "Trace") -> None:
        self.future.reset(trace)


@POLICIES.register("belady")
class Belady(_Offline):
    """No prefetch; Belady's MIN eviction (offline)."""


@POLICIES.register("oracle")
class Oracle(_Offline):
    """Perfect prediction of the next layers, Belady eviction, same bandwidth (offline)."""

    def make_predictor(self) -> Predictor:
        return OraclePredictor(self.topology, self.future)


@POLICIES.register("lookahead-1")
class Lookahead1(_Offline):
    """No prefetch; Belady eviction that sees one token ahead, LRU beyond (offline)."""

    num_tokens = 1

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return LookaheadEviction(self.future, self.num_tokens)


@POLICIES.register("lookahead-8")
class Lookahead8(Lookahead1):
    """No prefetch; Belady eviction that sees eight tokens ahead, LRU beyond (offline)."""

    num_tokens = 8


@POLICIES.register("default-lookahead-4")
class DefaultLookahead4(Default):
    """Offline bound: `default` whose eviction also knows the next 4 tokens' routing exactly (kept as Belady
    keeps them; among the rest, the default's eviction decides), to measure how much of the gap to the
    oracle a perfect short-range view closes. Shares the default's trained predictor (same kind)."""

    offline = True
    num_tokens = 4

    def __init__(self, topology: Topology, *args, **kwargs):
        super().__init__(topology, *args, **kwargs)
        self.future = FutureIndex(topology)
        self.tracker = FutureTracker(topology, self.future)

    def observers(self) -> list[Observer]:
        return [self.tracker, *super().observers()]

    def make_eviction(self, tier: str) -> EvictionPolicy:
        return LookaheadEviction(self.future, self.num_tokens, super().make_eviction(tier))

    def prepare(self, trace: "Trace") -> None:
        super().prepare(trace)
        self.future.reset(trace)
