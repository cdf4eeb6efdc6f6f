"""Online state of `default`: each sequence's recent routing and the current iteration's probabilities,
kept incrementally so that one layer decision is a few calls (numpy and kernels.py); docs/default-policy.md
("Online", "Cost of a decision") says how.

begin() predicts every layer from the tokens' start and fixes every cut's pre-activation part that the
token's own routing does not change; observe(c) adds the routed part, predicts c+1, c+2 and the next
token's layer c, and updates layer c's reuse state, from which next_use (the eviction's ranking) is
renewed. A batch's probability is the chance that at least one row needs the expert (for the next token:
of the rows that end their sequence's part). Knows arrays and events, not caches.
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np

from moestream.errors import MoestreamError
from moestream.events import IterationContext, RoutingEvent
from moestream.policies.default import reuse
from moestream.policies.default.features import memory_index, memory_rows
from moestream.policies.default.model import (
    NUM_BUCKETS,
    START,
    DefaultConfig,
    DefaultWeights,
    head,
    pre_activation,
    sigmoid,
)
from moestream.topology import Topology


@functools.cache
def compiled() -> ModuleType:
    """The kernels module, imported on first use: numba loads LLVM (about 100 MiB of RSS)."""
    from moestream.policies.default import kernels
    return kernels


class RowsMismatchError(MoestreamError):
    """A routing event whose rows are not the iteration's."""

    def __init__(self, num_event_rows: int, num_rows: int, layer: int):
        super().__init__(f"policy 'default' models one routed row per token of the iteration, but layer {layer} routed "
                         f"{num_event_rows} rows in an iteration of {num_rows} (an encoder-decoder model routes its "
                         f"decoder apart from its prompt): use another policy for this model")


def last_rows(seq_ids: np.ndarray) -> np.ndarray:
    """[S] the rows that end their sequence's (contiguous) rows in an iteration: every row in a decode."""
    return np.flatnonzero(np.r_[seq_ids[1:] != seq_ids[:-1], True]) if len(seq_ids) else np.zeros(0, np.int64)


def warm_up(topology: Topology, weights: DefaultWeights, memory: np.ndarray, reuse_weights: np.ndarray,
            config: DefaultConfig) -> None:
    """Runs a first layer through a throwaway state (one row, two rows): numba compiles when a policy loads."""
    for num_rows in (1, 2):
        state = IterationState(topology, weights, memory, reuse_weights, config)
        rows = np.zeros(num_rows, np.int64)
        state.begin(IterationContext(0, rows, rows, False), None)
        state.observe(RoutingEvent(0, np.tile(np.arange(topology.top_k), (num_rows, 1)), rows, rows))


class SequenceHistory:
    """One sequence's last W tokens' routing (a ring), its last two tokens and its running sums."""

    def __init__(self, window_tokens: int, num_layers: int, num_experts: int):
        shape = (num_layers, num_experts)
        self.ring = np.zeros((num_layers, window_tokens, num_experts), dtype=np.float32)  # [L, W, E]: by layer
        self.count = self.slot = self.num_tokens = 0
        self.last_token = -1  # the vocabulary index of its last token
        self.prev, self.prev2 = np.zeros(shape, np.float32), np.zeros(shape, np.float32)  # [L, E]
        self.window_sum, self.total = np.zeros(shape, np.float32), np.zeros(shape, np.float32)  # [L, E]

    def fill_inputs(self, ahead: np.ndarray, following: np.ndarray) -> tuple[float, float]:
        """Fills ahead [L, 5E] with the next token's feature blocks 2-5 at each target layer (block 6 is the
        caller's) and following [L, 5E] with the token after's but what the next one adds; returns the
        weights that next token's routing adds with to following's recall and share."""
        E, W = self.prev.shape[1], self.ring.shape[1]
        ahead[:, :E], ahead[:, E:2 * E] = self.prev, self.prev2
        ahead[:, 2 * E:3 * E] = self.window_sum / max(self.count, 1)
        ahead[:, 3 * E:4 * E] = self.total / max(self.num_tokens, 1)
        dropped = self.ring[:, self.slot] if self.count == W else 0.0
        recall_step, share_step = 1.0 / min(self.count + 1, W), 1.0 / (self.num_tokens + 1)
        following[:, E:2 * E] = self.prev
        following[:, 2 * E:3 * E] = (self.window_sum - dropped) * recall_step
        following[:, 3 * E:4 * E] = self.total * share_step
        return recall_step, share_step

    def finish_token(self, routed: np.ndarray, token: int) -> None:
        """Appends a token's [L, E] routing and its vocabulary index."""
        W = self.ring.shape[1]
        if self.count == W:
            self.window_sum -= self.ring[:, self.slot]
        self.ring[:, self.slot] = routed
        self.window_sum += routed
        self.total += routed
        self.prev2, self.prev = self.prev, routed.copy()
        self.slot, self.count = (self.slot + 1) % W, min(self.count + 1, W)
        self.num_tokens += 1
        self.last_token = token


class IterationState:
    """Probabilities of the current iteration's layers and of the next token, for predict and eviction."""

    def __init__(self, topology: Topology, weights: DefaultWeights, memory: np.ndarray, reuse_weights: np.ndarray,
                 config: DefaultConfig):
        self.topology, self.weights, self.memory, self.config = topology, weights, memory, config  # memory [2V, L, E]
        self.reuse_weights = reuse_weights  # [L, H, F] reuse.py's model
        L, E = topology.num_layers, topology.num_experts
        self.sequences: dict[int, SequenceHistory] = {}
        self.rows: list[SequenceHistory] = []
        self.active, self.layer_now = False, L - 1
        self.start = np.zeros((L, E), np.float32)  # [L, E] this token's layers, predicted from its start
        self.ahead = np.zeros((L, E), np.float32)  # [L, E] the latest prediction of each of this token's layers
        self.next = np.zeros((L, E), np.float32)  # [L, E] the next token's layers (filled as layers pass)
        self.fresh = np.zeros((NUM_BUCKETS, E), np.float32)  # [3, E] from cut c = layer_now >= 0: c+1, c+2, next c
        self.next_use = np.zeros((L, E))  # [L, E] the layer, counted from this token's first, of each next use
        self.reuse = reuse.initial_state(L, E)  # [rows, L, E] the stream's ages and averages, the waits (reuse.py)
        self.epoch = 0  # bumped when every row of next_use changes (begin); observe(c) changes rows c..c+2
        # (observe comes for every layer in order, as the contract says: a layer skipped would stay 'ahead')
        self._keyed, self._recorded, self._one_call = False, [], False
        self._every = self._last = np.zeros(0, np.int64)  # [T] every row; [S] those the next iteration follows
        self._before = np.zeros((0, 0), np.int64)  # [T, k] the experts routed at the last layer observed
        self._routed = np.zeros((0, L, E), np.float32)  # [T, L, E]
        self._row_index = np.zeros((0, 1), np.int64)
        U = weights.bias.shape[-1]
        self._fixed = np.zeros((L, 0, NUM_BUCKETS, U), np.float32)  # [L, T, 3, U] pre-activations before routing
        self._steps = np.zeros((0, 2, 1), np.float32)  # [T, 2, 1] the recall and share steps
        self._window_recall = np.zeros((0, L + 2, E), np.float32)  # [T, L+2, E] (cut_recall only)
        self._shared = np.zeros((0, config.window_tokens), np.float32)  # [T, W] shared at the last cut

    def begin(self, ctx: IterationContext, tokens: np.ndarray | None) -> None:
        """tokens: the rows' vocabulary indices, None if the iteration has no keys the model knows."""
        L, E, T = self.topology.num_layers, self.topology.num_experts, ctx.num_tokens
        self.rows = [self._history(int(s)) for s in ctx.seq_ids.tolist()]
        self._last = last_rows(ctx.seq_ids)
        self._keyed = tokens is not None
        self._recorded = tokens.tolist() if self._keyed else [-1] * T  # what each history keeps as its last
        tokens = tokens if self._keyed else np.zeros(T, np.int64)
        self.layer_now, self.active = -1, bool(self.rows)
        self._routed = np.zeros((T, L, E), np.float32)
        self._every, self._before = np.arange(T), np.zeros((T, 0), np.int64)
        self._row_index = self._every[:, None]
        self._shared = np.zeros((T, self.config.window_tokens), np.float32)
        ahead = np.zeros((T, L + 2, 5 * E), np.float32)  # [T, L+2, 5E] blocks 2-6 at each target; two zero layers past L
        following = np.zeros((T, L, 5 * E), np.float32)  # [T, L, 5E] the next token's, but what this one adds
        self._steps = np.zeros((T, 2, 1), np.float32)
        for row, history in enumerate(self.rows):
            self._steps[row, :, 0] = history.fill_inputs(ahead[row, :L], following[row])
        own, after = self._memory_index(ctx, tokens)
        ahead[:, :L, 4 * E:] = memory_rows(self.memory, own)  # [T, L, E]
        following[:, :, 4 * E:] = memory_rows(self.memory, after)  # the next token is not known yet
        self._window_recall = ahead[:, :, 2 * E:3 * E].copy() if self.config.cut_recall else self._window_recall
        self._fix(ahead, following, tokens)
        self._one_call = T == 1 and self.config.cut_recall and self.weights.out is None  # kernels.observe_one
        self._pre = np.empty((T, NUM_BUCKETS, self.weights.bias.shape[-1]), np.float32)  # [T, 3, U] its scratch
        every = (slice(None), START)
        pre = pre_activation(self.weights, ahead[:, :L], tokens[:, None], every, first_row=2 * E)  # [T, L, U]
        probs = sigmoid(head(self.weights, pre, every))  # [T, L, E]
        compiled().union_into(self.start, probs, self._every)  # [L, E]
        compiled().union_into(self.next, probs, self._last)
        self.ahead[:] = self.start
        compiled().expect(self.next_use, self.ahead, self.reuse, 0, L, -1)
        self.epoch += 1

    def _fix(self, ahead: np.ndarray, following: np.ndarray, tokens: np.ndarray) -> None:
        """Every cut's three buckets' pre-activations from the inputs the token's own routing does not change."""
        L, E, T = self.topology.num_layers, self.topology.num_experts, len(tokens)
        U = self.weights.bias.shape[-1]
        unknown = np.zeros((T, 1), np.int64)  # the next token is not known yet
        self._fixed = np.empty((L, T, NUM_BUCKETS, U), np.float32)
        for bucket, inputs, keys in ((0, ahead[:, 1:L + 1], tokens[:, None]), (1, ahead[:, 2:L + 2], tokens[:, None]),
                                     (START, following, unknown)):
            pre = pre_activation(self.weights, inputs, keys, (slice(None), bucket), first_row=2 * E)  # [T, L, U]
            self._fixed[:, :, bucket] = pre.swapaxes(0, 1)

    def observe(self, event: RoutingEvent) -> None:
        if not self.active:
            return
        c, L, kernels = event.layer, self.topology.num_layers, compiled()
        now = np.asarray(event.expert_ids, np.int64)  # [T, k]
        if len(now) != len(self.rows):
            raise RowsMismatchError(len(now), len(self.rows), c)
        if self._one_call:  # the usual decode: one compiled call
            history = self.rows[0]
            kernels.observe_one(self._routed, self._pre, self._fixed, self.weights.dense, now, self._before,
                                self._steps, c, history.ring, history.count, self._shared, self.config.recall_beta,
                                self._window_recall, self._every, self._last, self.fresh, self.ahead, self.next,
                                self.next_use, self.reuse, self.reuse_weights)
        else:
            self._routed[self._row_index, c, now] = 1.0
            pre = self._fixed[c].copy()  # [T, 3, U]
            kernels.add_routed(pre, self.weights.dense[c], now, self._before, self._steps)
            if self.config.cut_recall:
                self._cut_recall(c, now, pre)
            logits = head(self.weights, pre, c)  # [T, 3, E]: the weights of cut c
            kernels.absorb(logits, self._every, self._last, c, self.fresh, self.ahead, self.next, self.next_use, now,
                           self.reuse, self.reuse_weights)
        self._before, self.layer_now = now, c
        if c == L - 1:
            for history, routed_token, token in zip(self.rows, self._routed, self._recorded):
                history.finish_token(routed_token, token)

    def _memory_index(self, ctx: IterationContext, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[T] token memory rows the tokens read, and [T] those their next tokens read (without keys: 0)."""
        if not self._keyed:
            zeros = np.zeros(len(tokens), np.int64)
            return zeros, zeros
        last = np.array([history.last_token for history in self.rows], dtype=np.int64)  # [T]
        same = np.r_[False, ctx.seq_ids[1:] == ctx.seq_ids[:-1]]
        last = np.where(same, np.r_[-1, tokens[:-1]], last)
        V = len(self.memory) // 2
        return memory_index(tokens, last, V), V + tokens

    def _cut_recall(self, c: int, now: np.ndarray, pre: np.ndarray) -> None:
        """Adds to pre[:, :2] the recall block's gain when weighted by the experts shared at c and c-1."""
        n, dense, add = min(2, self.topology.num_layers - 1 - c), self.weights.dense[c], compiled().add_cut_recall
        for row, history in enumerate(self.rows):  # dense [3, 7E, U]
            add(pre[row, :n], history.ring, history.count, now[row], self._shared[row], c, self.config.recall_beta,
                self._window_recall[row], dense)

    def scores(self, layer_now: int, target: int) -> np.ndarray:
        """[E]: probabilities for `target` (>= L: the next token's target - L) seen from layer_now."""
        L = self.topology.num_layers
        if target >= L:
            return self.next[target - L]
        if layer_now < 0 or target - layer_now > 2:
            return self.start[target]
        return self.fresh[target - layer_now - 1]

    def scores_ahead(self, layer_now: int, num_targets: int) -> np.ndarray:
        """[n, E]: scores() of the n targets after layer_now."""
        if 0 <= layer_now and num_targets <= min(2, self.topology.num_layers - 1 - layer_now):
            return self.fresh[:num_targets]
        return np.stack([self.scores(layer_now, layer_now + 1 + i) for i in range(num_targets)])

    def end_sequence(self, seq_id: int) -> None:
        ended = self.sequences.pop(seq_id, None)
        if ended is not None and all(history is ended for history in self.rows):
            self.rows, self.active = [], False

    def expected_wait(self) -> np.ndarray:
        """[L, E]: the expected number of layers until each expert is needed again."""
        return self.next_use - self.layer_now

    def _history(self, seq_id: int) -> SequenceHistory:
        if seq_id not in self.sequences:
            t = self.topology
            self.sequences[seq_id] = SequenceHistory(self.config.window_tokens, t.num_layers, t.num_experts)
        return self.sequences[seq_id]
