"""State of the `default` predictor: the online iteration (prefix, context, per-sequence history,
probability tables for eviction) and the offline scoring of a whole trace with the same numbers.

IterationState follows the contract's call order (begin, observe per layer, end_sequence) for
batches of T token rows; a batch's probability for an expert is the chance that at least one of its
rows routes to it. TraceScores computes, for every row of a trace at once, what predict() would have
returned under moestream.eval.prediction's horizon rule. Knows arrays and events, not caches.
"""

from __future__ import annotations

import numpy as np

from moestream.events import IterationContext, RoutingEvent
from moestream.policies.default.model import (
    RoutingWeights,
    position_bucket,
    sequence_affinity,
    sigmoid,
    token_indices,
    token_keys,
)
from moestream.policies.default.channels import CHANNELS
from moestream.policies.default.recall import (
    History,
    RowSources,
    Sources,
    earlier_rows,
    first_rows,
    known_sets,
    masks,
)
from moestream.policies.default.reuse import ReuseModel, SequenceState
from moestream.policies.routing_stats import previous_rows
from moestream.predictors.paths import expert_mask
from moestream.topology import Topology
from moestream.trace.schema import Trace


def union(probs: np.ndarray) -> np.ndarray:
    """[T, ...] -> [...]: probability that at least one row needs it (rows independent)."""
    return probs[0] if len(probs) == 1 else 1.0 - np.prod(1.0 - probs, axis=0)


class IterationState:
    def __init__(self, topology: Topology, weights: RoutingWeights, reuse: ReuseModel):
        self.topology, self.weights, self.reuse = topology, weights, reuse
        self.sequences: dict[int, SequenceState] = {}
        self.rows: list[SequenceState] = []
        self.active = False
        self.layer_now = topology.num_layers - 1
        self._base = self._prefix = self._recent = None
        self._latest: np.ndarray | None = None  # [T, H2] the hidden path's activations
        self._tokens: list[int] = []  # each row's vocabulary index
        self._current = np.zeros((0, topology.num_layers, topology.top_k), dtype=np.int64)  # [T, L, K] routed so far
        self._channels = {name: CHANNELS.create(name) for name in weights.channels}
        self._sources: dict[str, list[RowSources]] = {}  # per recall channel, each row's recalled rows
        self._channel_weights: dict[str, list[np.ndarray]] = {}  # per recall channel, each row's weights
        self._table: np.ndarray | None = None  # [L, E] this iteration's probabilities, lazily
        self._reuse: np.ndarray | None = None  # [L, E] next-pass reuse probabilities, lazily

    def _new_state(self) -> SequenceState:
        t = self.topology
        return SequenceState(t.num_layers, t.num_experts, t.top_k)

    def begin(self, ctx: IterationContext, tokens: np.ndarray) -> None:
        self.rows = [self.sequences.setdefault(int(s), self._new_state()) for s in ctx.seq_ids.tolist()]
        self._tokens = tokens.tolist()
        self._current = np.zeros((len(self.rows),) + self._current.shape[1:], dtype=np.int64)
        prev = np.stack([s.prev_experts for s in self.rows])  # [T, L, K]
        has_prev = np.array([s.has_prev for s in self.rows], dtype=np.float32)
        self._base = self.weights.context(tokens, position_bucket(ctx.positions), prev, has_prev)  # [T, H]
        self._prefix, self._recent, self._latest = np.zeros_like(self._base), np.zeros_like(self._base), None
        self.layer_now, self.active = -1, bool(self.rows)
        self._table = self._reuse = None
        self._sources = self._row_sources()
        self._weigh_channels()

    def observe(self, event: RoutingEvent) -> None:
        if not self.active:
            return
        layer, experts = event.layer, event.expert_ids
        for row, state in enumerate(self.rows):  # rows of one sequence (a prefill) update it in token order
            state.update(layer, experts[row])
        self._current[:, layer] = experts
        self._prefix += self.weights.prefix_step(layer, experts, event.gate_probs)
        self._recent = self.weights.recent_step(layer, self._current)
        self._latest = self.weights.latest(event.hidden, layer)
        self.layer_now, self._reuse = layer, None
        self._weigh_channels()
        if layer == self.topology.num_layers - 1:
            for state, current, token in zip(self.rows, self._current, self._tokens):
                state.finish_token(current, token)

    def end_sequence(self, seq_id: int) -> None:
        ended = self.sequences.pop(seq_id, None)
        if ended is not None and all(state is ended for state in self.rows):
            self.rows, self.active, self._reuse = [], False, None

    def refine(self, layer_now: int, targets: np.ndarray) -> np.ndarray:
        """[n, E]: probabilities of the target layers of this iteration, known up to layer_now."""
        probs = union(self._probs(targets, targets - layer_now))
        if self._table is not None:
            self._table[targets] = probs
        return probs

    def next_token(self, layer: int) -> np.ndarray:
        """[E]: probabilities for the next token of the batch's sequences at layer."""
        return union(np.stack([self.reuse.state_probs(state, [layer])[0] for state in self.rows]))

    def retention(self) -> np.ndarray:
        """[L, E]: minus the expected number of layers until each expert is needed again."""
        num_layers = self.topology.num_layers
        q = np.maximum(self._reuse_table(), 1e-4)
        layers = np.arange(num_layers)
        ahead = (layers - self.layer_now)[:, None].astype(np.float64)  # [L, 1]
        passed = ahead <= 0
        if self.active:
            p_now = self._iteration_table()
            wait = np.where(passed, ahead + num_layers * (1.0 / q), ahead + (1.0 - p_now) * num_layers / q)
        else:
            wait = np.where(passed, ahead + num_layers, ahead) + num_layers * (1.0 / q - 1.0)
        return -wait

    def _probs(self, targets: np.ndarray, horizons: np.ndarray) -> np.ndarray:
        """[T, n, E] per-row probabilities for the targets."""
        prev_hot = np.stack([s.last[targets] for s in self.rows])  # [T, n, E]: the previous token's, as targets are ahead
        affinity = np.stack([s.affinity(targets) for s in self.rows])
        base = self._base + self._prefix + self._recent  # [T, H]
        channels = self._channels_at(targets)
        logits = self.weights.logits(base, targets, horizons, prev_hot, affinity, self._latest, channels)
        return sigmoid(logits)

    def _row_sources(self) -> dict[str, list[RowSources]]:
        """Per channel, the rows each token row recalls; fixed for the iteration."""
        histories = [state.window.history() for state in self.rows]
        memory = self.weights.memory
        return {name: [channel.sources(history, memory, np.array([token])).row(0)
                       for history, token in zip(histories, self._tokens)]
                for name, channel in self._channels.items()}

    def _weigh_channels(self) -> None:
        """Each row's weights over its recalled rows, per channel, for the routing known now."""
        known = [known_sets(current, self.layer_now, self.topology.num_experts) for current in self._current]
        self._channel_weights = {name: [source.weights(k) for source, k in zip(sources, known)]
                                 for name, sources in self._sources.items()}

    def _channels_at(self, targets: np.ndarray) -> dict[str, np.ndarray]:
        """name -> [T, n, E]: the rows' recall channels at the target layers."""
        E = self.topology.num_experts
        return {name: np.stack([source.recall(w, targets, E) for source, w in zip(sources, self._channel_weights[name])])
                for name, sources in self._sources.items()}

    def _iteration_table(self) -> np.ndarray:
        if self._table is None:
            targets = np.arange(self.layer_now + 1, self.topology.num_layers)
            self._table = np.zeros((self.topology.num_layers, self.topology.num_experts))
            if len(targets):
                self._table[targets] = union(self._probs(targets, targets - self.layer_now))
        return self._table

    def _reuse_table(self) -> np.ndarray:
        if self._reuse is None:
            layers = np.arange(self.topology.num_layers)
            states = self.rows if self.active else [self._new_state()]
            self._reuse = union(np.stack([self.reuse.state_probs(s, layers) for s in states]))
        return self._reuse


class TraceScores:
    """Every row's scores for one layer at one horizon, computed for a whole trace at once."""

    def __init__(self, trace: Trace, weights: RoutingWeights, reuse: ReuseModel, vocab: dict, key_kind: str):
        self.trace, self.weights, self.reuse = trace, weights, reuse
        keys, kind = token_keys(trace)
        usable = keys is not None and kind == key_kind
        tokens = token_indices(keys, vocab) if usable else np.zeros(trace.num_tokens, dtype=np.int64)
        self.prev = previous_rows(trace.seq_ids)
        has_prev = (self.prev >= 0).astype(np.float32)
        prev_experts = trace.experts[np.maximum(self.prev, 0)].astype(np.int64)
        self.context = weights.context(tokens, position_bucket(trace.positions), prev_experts, has_prev)  # [N, H]
        self.affinity = sequence_affinity(trace)  # [N, L, E]
        earlier, valid = earlier_rows(first_rows(trace.seq_ids))  # [N, W]
        self.bit_sets = masks(trace.experts, trace.topology.num_experts)  # [N, L, words]
        history = History(self.bit_sets, trace.experts, tokens, earlier, valid)
        self.sources: dict[str, Sources] = {name: CHANNELS.create(name).sources(history, weights.memory, tokens)
                                            for name in weights.channels}
        self._cut, self._prefix = -1, np.zeros_like(self.context)
        self._recent: tuple[int, np.ndarray] | None = None  # the last cut's recent_step

    def holds(self, trace: Trace) -> bool:
        return trace is self.trace

    def scores(self, layer: int, horizon_layers: int) -> np.ndarray:
        cut = layer - horizon_layers
        if cut >= -1:
            latest = self.weights.latest(None if cut < 0 or self.trace.hidden is None else self.trace.hidden[:, cut], cut)
            return self._model(layer, cut, self._prefix_until(cut) + self._recent_at(cut), latest)
        out = self._model(layer, -1, np.zeros_like(self.context))  # first tokens: their own start
        later = self.prev >= 0
        out[later] = self.reuse.trace_probs(self.trace, layer)[self.prev[later]]
        return out

    def _model(self, layer: int, cut: int, prefix: np.ndarray, latest: np.ndarray | None = None) -> np.ndarray:
        E, experts = self.trace.topology.num_experts, self.trace.experts
        has_prev = (self.prev >= 0)[:, None]
        prev_hot = (expert_mask(experts[np.maximum(self.prev, 0), layer], E) & has_prev).astype(np.float32)  # [N, E]
        channels = {name: source.at(self.bit_sets, cut, layer, E)[:, None]  # [N, 1, E]
                    for name, source in self.sources.items()}
        logits = self.weights.logits(self.context + prefix, np.array([layer]), np.array([layer - cut]),
                                     prev_hot[:, None], self.affinity[:, layer][:, None].astype(np.float32), latest,
                                     channels)
        return sigmoid(logits[:, 0])

    def _recent_at(self, cut: int) -> np.ndarray:
        if self._recent is None or self._recent[0] != cut:
            self._recent = cut, self.weights.recent_step(cut, self.trace.experts)
        return self._recent[1]

    def _prefix_until(self, cut: int) -> np.ndarray:
        """[N, H]: the prefix of layers <= cut, extended from the last one computed."""
        if cut < self._cut:
            self._cut, self._prefix = -1, np.zeros_like(self.context)
        trace, w = self.trace, self.weights
        while self._cut < cut:
            self._cut += 1
            hot = expert_mask(trace.experts[:, self._cut], trace.topology.num_experts).astype(np.float32)
            self._prefix = self._prefix + hot @ w.prefix[self._cut]
            if w.uses_gate and trace.gate_probs is not None:
                self._prefix = self._prefix + trace.gate_probs[:, self._cut].astype(np.float32) @ w.gate[self._cut]
        return self._prefix


