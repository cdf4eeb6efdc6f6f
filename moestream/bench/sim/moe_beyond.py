"""The MoE-Beyond study's hit-rate protocol (arXiv 2508.17137), offered as the `moe-beyond` protocol.

One global pool of experts (LRU, or the policy's own eviction), emptied and refilled with random
experts at each prompt; before each (token, layer) the predictor's top_k experts for the layer are
pushed through it, then the gate's experts are looked up; hit rate = hits / lookups after each
prompt's warm-up tokens (the rules in full: docs/simulator.md). No bandwidth, no time. `_Run` is the
`LayerMechanism` of its `PolicyDriver`. Knows no policy by name.
"""

from __future__ import annotations

import numpy as np

from moestream.bench.sim.config import SimConfig
from moestream.bench.sim.metrics import LayerCounts, MoeBeyondCounters
from moestream.bench.sim.protocols import PROTOCOLS, Protocol
from moestream.bench.sim.replay import decode_stream
from moestream.cache import ExpertCache
from moestream.contracts import Policy, Prediction
from moestream.events import RoutingEvent
from moestream.policies.driver import PolicyDriver
from moestream.policies.eviction import LRUPolicy
from moestream.topology import ExpertKey
from moestream.trace.replay import Iteration
from moestream.trace.schema import Trace


def pool_slots(total_experts: int, ratio: float) -> int:
    return max(1, int(total_experts * ratio))


class _Run:
    """One replay of the protocol: the pool and the counters; the LayerMechanism of its driver."""

    def __init__(self, policy: Policy, config: SimConfig):
        topo = policy.topology
        self.policy, self.config, self.topology = policy, config, topo
        own = config.protocol_eviction == "policy"
        eviction = policy.make_eviction("device") if own else LRUPolicy()
        self.pool = ExpertCache(pool_slots(topo.total_experts, config.cache_ratio), eviction)
        self.keys = [[ExpertKey(layer, e) for e in range(topo.num_experts)] for layer in range(topo.num_layers)]
        self.all_keys = [key for layer_keys in self.keys for key in layer_keys]
        self.rng = np.random.default_rng(config.seed)
        self.driver = PolicyDriver(policy, [eviction] if own else [], horizon_layers=max(1, config.horizon_layers))
        self.counters = MoeBeyondCounters(LayerCounts(topo.num_layers))
        self.prompt: int | None = None
        self.index = 0  # tokens of the current prompt seen so far
        self.seq = -1  # the sequence of the current token
        self.scored = False  # whether the current token is scored

    def iteration(self, it: Iteration) -> None:
        self.seq = int(it.ctx.seq_ids[0])
        self.driver.run_iteration(it, self)
        self.index += 1
        self.counters.scored_tokens += self.scored

    def routed(self, event: RoutingEvent, num_tokens: int) -> None:
        self._lookup(event.layer, event.expert_ids.ravel().tolist(), self.scored)

    def predicted(self, layer_now: int, predictions: list[Prediction]) -> None:
        """Before the first layer, a new prompt refills the pool; the predictions for the next layer
        go through it (none after the last layer)."""
        if layer_now < 0:
            if self.seq != self.prompt:
                self._new_prompt(self.seq)
            self.scored = self.index >= self.config.warmup_tokens
        if layer_now < self.topology.num_layers - 1:
            self._push(predictions, layer_now + 1, self.scored)

    def _new_prompt(self, seq: int) -> None:
        """Empty the pool and refill it with random experts."""
        self.prompt, self.index = seq, 0
        self.counters.num_prompts += 1
        pool = self.pool
        for key in list(pool.resident()):
            pool.remove(key)
        for i in self.rng.choice(len(self.all_keys), size=pool.capacity, replace=False).tolist():
            pool.admit(self.all_keys[i])

    def _push(self, predictions: list[Prediction], layer: int, scored: bool) -> None:
        best: dict[int, float] = {}
        for p in predictions:
            if p.layer == layer and p.tokens_ahead == 0 and p.score > best.get(p.expert, 0.0):
                best[p.expert] = p.score
        chosen = sorted(best, key=lambda e: (-best[e], e))[: self.topology.top_k]
        keys = self.keys[layer]
        for expert in chosen:
            self._touch(keys[expert])
        if scored:
            self.counters.pushed += len(chosen)

    def _lookup(self, layer: int, experts: list[int], scored: bool) -> None:
        keys, hits = self.keys[layer], 0
        for expert in experts:
            hits += self._touch(keys[expert])
        if scored:
            self.counters.layers.hits[layer] += hits
            self.counters.layers.accesses[layer] += len(experts)

    def _touch(self, key: ExpertKey) -> bool:
        """Refresh a resident expert (True) or insert it, evicting (False)."""
        if self.pool.access(key) is not None:
            return True
        self.pool.admit(key)
        return False


@PROTOCOLS.register("moe-beyond")
class MoeBeyondProtocol(Protocol):
    """Hit rate of a global expert pool, scored after a 10-token warm-up per prompt."""

    def run(self, policy: Policy, trace: Trace, config: SimConfig) -> dict:
        run = _Run(policy, config)
        for it in decode_stream(trace):
            run.iteration(it)
        counters = run.counters
        counters.scored_prompts = sum(
            1 for _, start, end in trace.sequence_bounds() if end - start > config.warmup_tokens
        )
        return counters.summary()
