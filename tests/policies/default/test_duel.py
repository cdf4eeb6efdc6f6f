"""The duel of `default`'s model against recency: whichever ghost hits more over the window leads,
the eviction and the planner follow the leader, and the default policy wires it in."""

import numpy as np

from moestream.contracts import CacheView, EvictionPolicy, Prediction, PrefetchPlanner, TransferRequest
from moestream.events import RoutingEvent
from moestream.policies.default.duel import Duel, DuelEviction, DuelPlanner
from moestream.policies.default.model import DefaultConfig
from moestream.topology import ExpertKey, Topology
from tests.policies.default.common import fitted_policy, split_traces

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=8, top_k=2, expert_bytes=64)
L, E = TOPOLOGY.num_layers, TOPOLOGY.num_experts
ONE = np.zeros(1, np.int64)


def route(duel: Duel, tokens: list[list[tuple[int, int]]]) -> None:
    """Each token routes its pair of experts at every layer."""
    for pairs in tokens:
        for layer, pair in enumerate(pairs):
            duel.observe(RoutingEvent(layer, np.array([pair]), ONE, ONE))


def cycle(num_tokens: int, period: int, repeats: int = 1) -> list[list[tuple[int, int]]]:
    """Token t routes experts (2j, 2j+1), j = (t // repeats) mod period, at every layer."""
    pairs = [(t // repeats) % period for t in range(num_tokens)]
    return [[(2 * j, 2 * j + 1)] * L for j in pairs]


class Oracle:
    """The model's view of a cycle it knows: next use of each expert, and the next layer's experts."""

    def __init__(self, tokens):
        self.tokens, self.t, self.layer = tokens, 0, -1

    def step(self, duel, pairs):
        for layer, pair in enumerate(pairs):
            self.layer = layer
            duel.observe(RoutingEvent(layer, np.array([pair]), ONE, ONE))
        self.t += 1

    def next_use(self):
        table = np.full((L, E), 1e9)
        for ahead in range(len(self.tokens)):
            for layer, pair in enumerate(self.tokens[(self.t + ahead) % len(self.tokens)]):
                for expert in pair:
                    table[layer, expert] = min(table[layer, expert], ahead * L + layer)
        return table

    def ahead(self, layer):
        probs = np.zeros(E)
        if layer + 1 < L:
            probs[list(self.tokens[self.t % len(self.tokens)][layer + 1])] = 1.0
        return probs


def test_recency_leads_where_the_model_ranks_wrong_and_tokens_repeat():
    wrong = np.tile(np.arange(E, dtype=float)[::-1], (L, 1))  # next use: expert 0 latest, and so on
    duel = Duel(TOPOLOGY, lambda: wrong, lambda layer: np.eye(E)[7], window_tokens=4)  # expects 7, never used
    duel.see_capacity(3 * L)
    tokens = cycle(24, period=3, repeats=3)  # each pair three tokens running: LRU hits twice in three
    route(duel, tokens[:3])
    assert not duel.recency  # the window is not full yet: the model leads
    route(duel, tokens[3:])
    assert duel.recency


def test_the_model_leads_where_it_foresees_a_cycle_that_lru_thrashes():
    tokens = cycle(4, period=4)
    oracle = Oracle(tokens)
    duel = Duel(TOPOLOGY, oracle.next_use, oracle.ahead, window_tokens=4)
    duel.see_capacity(3 * L)  # three of the four pairs of each layer: LRU misses every time
    for t in range(24):
        oracle.step(duel, tokens[t % 4])
    assert not duel.recency


def test_no_duel_before_a_plan_shows_the_capacity():
    duel = Duel(TOPOLOGY, lambda: None, lambda layer: None, window_tokens=1)
    route(duel, cycle(8, period=2))
    assert duel.capacity == 0 and not duel.recency


class Everything(PrefetchPlanner):
    def plan(self, predictions, view):
        return [TransferRequest(p.key, p.score) for p in predictions]


class SmallestKey(EvictionPolicy):
    """Stands for the model: evicts the smallest candidate, whatever was used when."""

    def victim(self, candidates):
        return min(candidates)


def test_the_eviction_and_the_planner_follow_the_leader():
    duel = Duel(TOPOLOGY, lambda: None, lambda layer: None, window_tokens=1)
    keys = [ExpertKey(0, e) for e in range(3)]
    eviction = DuelEviction(SmallestKey(), duel)
    for key in keys:
        eviction.on_insert(key)
    eviction.on_access(keys[0])  # least recently used first: 1, 2, 0
    planner = DuelPlanner(Everything(), duel)
    view = CacheView(frozenset(keys), frozenset(), capacity=5, layer_now=0, num_layers=L)
    predictions = [Prediction(1, 4, 0.9)]
    assert [r.key for r in planner.plan(predictions, view)] == [ExpertKey(1, 4)]
    assert eviction.victim(keys) == keys[0]  # the model's choice while it leads
    assert duel.capacity == 5
    duel.recency = True
    assert planner.plan(predictions, view) == []
    assert eviction.victim(keys) == keys[1]  # LRU's
    eviction.on_remove(keys[1])
    assert eviction.victim([keys[0], keys[2]]) == keys[2]


def test_the_default_policy_duels_unless_told_not_to():
    train, _ = split_traces()
    policy = fitted_policy(train)
    assert policy.duel in policy.observers()
    assert isinstance(policy.make_eviction("device"), DuelEviction)
    assert not isinstance(policy.make_eviction("host"), DuelEviction)
    plain = fitted_policy(train, config=DefaultConfig(duel_window_tokens=0))
    assert plain.observers() == [plain.predictor]
    assert not isinstance(plain.make_eviction("device"), DuelEviction)


def test_a_tie_over_a_full_window_leaves_the_lead_to_the_model():
    duel = Duel(TOPOLOGY, lambda: None, lambda layer: None, window_tokens=2)
    duel.see_capacity(L * E)  # both ghosts hold every expert they have seen: each hits all but the first lookups
    route(duel, cycle(num_tokens=6, period=1))  # the same pair every token: the window ends all hits on both sides
    assert not duel.recency  # LRU leads only while its ghost hits more
