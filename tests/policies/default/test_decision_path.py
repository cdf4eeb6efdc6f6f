"""The compiled decision path of `default` decides exactly as the straightforward Python it replaced,
which this module keeps as the reference: the duel's ghosts (kernels.duel_observe), the victims set
aside (kernels.largest), a decode's observe in one call (kernels.observe_one) and predict's records.
Also: `bench decision-cost` (moestream.bench.decision_cost) replays through a PolicyDriver, as `bench policies`
does."""

import copy
import types
from collections import OrderedDict, deque

import numpy as np
import pytest

from moestream.bench import decision_cost
from moestream.bench.sim.replay import decode_stream
from moestream.bench.tools.overhead import LayerTimer
from moestream.cache import CacheFullError, ExpertCache
from moestream.contracts import CacheView, Observer, Prediction
from moestream.events import RoutingEvent
from moestream.policies.default import kernels
from moestream.policies.default.duel import Duel, DuelEviction
from moestream.policies.default.policy import DefaultEviction
from moestream.policies.driver import PolicyDriver
from moestream.policies.eviction import LRUPolicy, NarrowingEviction
from moestream.topology import ExpertKey, Topology


class ReferenceDuel(Observer):
    """duel.Duel before it was compiled: an OrderedDict for LRU's ghost, a mask and an argmax per
    victim for the model's, a deque of the window's outcomes."""

    def __init__(self, topology, next_use, ahead, window_tokens):
        self.topology, self.next_use, self.ahead = topology, next_use, ahead
        self.capacity = 0
        self._lru = OrderedDict()
        self._model = np.zeros((topology.num_layers, topology.num_experts), bool)
        self._model_size = 0
        self._outcomes = deque(maxlen=window_tokens * topology.num_layers * topology.top_k)
        self._model_hits = self._lru_hits = 0
        self.recency = False

    def see_capacity(self, capacity):
        self.capacity = capacity

    def observe(self, event):
        if self.capacity < 1:
            return
        layer, experts = event.layer, event.experts().tolist()
        table = self.next_use()
        table = np.zeros(self._model.shape) if table is None else table
        waits = np.where(self._model, table, -np.inf)
        waits[layer, experts] = -np.inf
        for expert in experts:
            hit = self._take_model(layer, expert, waits, -np.inf)
            self._count((hit, self._look_lru(ExpertKey(layer, expert))))
        for expert in self._expected(layer):
            self._take_model(layer + 1, expert, waits, table[layer + 1, expert])
        self.recency = len(self._outcomes) == self._outcomes.maxlen and self._lru_hits > self._model_hits

    def _count(self, outcome):
        if len(self._outcomes) == self._outcomes.maxlen:
            model, lru = self._outcomes[0]
            self._model_hits, self._lru_hits = self._model_hits - model, self._lru_hits - lru
        self._outcomes.append(outcome)
        self._model_hits, self._lru_hits = self._model_hits + outcome[0], self._lru_hits + outcome[1]

    def _look_lru(self, key):
        hit = key in self._lru
        self._lru[key] = None
        self._lru.move_to_end(key)
        if len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return hit

    def _take_model(self, layer, expert, waits, wait):
        if self._model[layer, expert]:
            return True
        if self._model_size >= self.capacity:
            index = int(waits.argmax())
            if waits.flat[index] == -np.inf:
                return False
            self._model.flat[index], waits.flat[index] = False, -np.inf
            self._model_size -= 1
        self._model[layer, expert], waits[layer, expert] = True, wait
        self._model_size += 1
        return False

    def _expected(self, layer):
        probs = self.ahead(layer) if layer + 1 < self.topology.num_layers else None
        return [] if probs is None else np.argsort(-probs, kind="stable")[: self.topology.top_k].tolist()


class ReferenceDuelEviction(NarrowingEviction):
    """duel.DuelEviction before: an LRUPolicy beside the model's eviction."""

    def __init__(self, model, duel):
        super().__init__(model)
        self.lru, self.duel = LRUPolicy(), duel

    def on_insert(self, key):
        super().on_insert(key)
        self.lru.on_insert(key)

    def on_access(self, key):
        super().on_access(key)
        self.lru.on_access(key)

    def on_remove(self, key):
        super().on_remove(key)
        self.lru.on_remove(key)

    def victim(self, candidates):
        return (self.lru if self.duel.recency else self.inner).victim(candidates)


class ReferenceEviction(DefaultEviction):
    """DefaultEviction whose residents that may not go are set aside one argmax at a time."""

    def _set_aside(self, candidates):
        masked, keys, passed = self._flat, self._keys, []
        try:
            for _ in range(self.max_argmax):
                index = int(masked.argmax())
                wait = masked[index]
                if wait == -np.inf:
                    break
                if keys[index] in candidates:
                    return keys[index]
                passed.append((index, wait))
                masked[index] = -np.inf
            return self._ranked(candidates)
        finally:
            for index, wait in passed:
                masked[index] = wait


def reference_predict(self, layer_now, horizon_layers):
    """DefaultPredictor.predict before: np.argpartition and Prediction.of_layer."""
    state = self.state
    L, k = self.topology.num_layers, self.topology.top_k
    targets = range(layer_now + 1, min(layer_now + horizon_layers, 2 * L - 1) + 1)
    if state is None or not state.active or not targets:
        return []
    scores = state.scores_ahead(layer_now, len(targets))
    top = np.argpartition(scores, -k, axis=1)[:, -k:].tolist()
    predictions = []
    for target, experts, probs in zip(targets, top, scores.tolist()):
        layer, ahead = (target - L, 1) if target >= L else (target, 0)
        predictions += Prediction.of_layer(layer, experts, probs, ahead)
    return predictions


def reference_policy(policy):
    """A copy of the fitted policy on the reference path: the duel, its eviction, the victims set aside
    one argmax at a time, observe's kernels one by one, and predict as before."""
    ref = copy.deepcopy(policy)
    ref._duel = ReferenceDuel(ref.topology, ref._next_use, ref._ahead, ref.config.duel_window_tokens)
    ref.planner = ref.make_planner()
    predictor, begin = ref.predictor, ref.predictor.begin_iteration

    def begin_one_by_one(ctx):
        begin(ctx)
        predictor.state._one_call = False  # kernels.add_routed, add_cut_recall and absorb, one by one

    predictor.begin_iteration = begin_one_by_one
    predictor.predict = types.MethodType(reference_predict, predictor)
    inner = ref._device_eviction = ReferenceEviction(predictor)
    return ref, ReferenceDuelEviction(inner, ref.duel)


class Recorder(LayerTimer):
    """`bench policies`' replay (bench.tools.overhead.LayerTimer) that writes down every decision: each layer's
    predictions, requests and duel leader, and each admission with what it evicted."""

    def __init__(self, driver, cache, num_layers):
        super().__init__(driver, cache, num_layers)
        self.log = []

    def routed(self, event, num_tokens):
        self._needed = [ExpertKey(event.layer, int(e)) for e in sorted(set(event.expert_ids.ravel().tolist()))]
        for key in self._needed:
            if self.cache.access(key) is None:
                self.log.append(("demand", key, self.cache.admit(key, protect=self._needed)[1]))

    def predicted(self, layer_now, predictions):
        self.log.append(("predictions", layer_now, predictions))
        if not predictions:
            return
        view = CacheView(self.cache.resident(), frozenset(), self.cache.capacity, layer_now, self.num_layers)
        requests = self.driver.plan(predictions, view)
        self.log.append(("plan", requests, self.driver.policy.duel.recency))
        for request in requests:
            try:
                self.log.append(("prefetch", request.key, self.cache.admit(request.key, protect=self._needed)[1]))
            except CacheFullError:
                break


def replay(policy, eviction, trace, ratio):
    driver = PolicyDriver(policy, [eviction], horizon_layers=2)
    topology = trace.topology
    capacity = max(topology.top_k, int(topology.total_experts * ratio))
    recorder = Recorder(driver, ExpertCache(capacity, eviction), topology.num_layers)
    driver.run(decode_stream(trace), recorder)
    return recorder.log


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5])
def test_the_compiled_path_decides_as_the_reference_on_a_replay(policy, traces, ratio):
    fast = copy.deepcopy(policy)
    assert isinstance(fast.duel, Duel)
    ref, ref_eviction = reference_policy(policy)
    want = replay(ref, ref_eviction, traces[1], ratio)
    got = replay(fast, fast.make_eviction("device"), traces[1], ratio)
    assert isinstance(fast.make_eviction("device"), DuelEviction)
    assert len(got) == len(want) and sum(entry[0] == "prefetch" for entry in got) > 0
    assert got == want  # predictions (probabilities to the last bit), requests, duel leader, victims


TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4), num_experts=6, top_k=2, expert_bytes=64)


def test_the_compiled_duel_matches_the_reference_on_random_routing():
    """Ties and NaN in the next uses and the probabilities, repeated experts in a batch, capacities that
    change (and none): every lookup's outcome, the ghosts and the leader stay the reference's."""
    rng = np.random.default_rng(0)
    L, E = TOPOLOGY.num_layers, TOPOLOGY.num_experts
    leaders = set()
    for trial in range(40):
        inputs = {"table": None, "probs": None}
        next_use, ahead = lambda given=inputs: given["table"], lambda layer, given=inputs: given["probs"]
        window = int(rng.integers(1, 4))
        fast, ref = Duel(TOPOLOGY, next_use, ahead, window), ReferenceDuel(TOPOLOGY, next_use, ahead, window)
        for step in range(80):
            if step % 20 == 0:
                capacity = int(rng.integers(0, L * E + 2))
                fast.see_capacity(capacity)
                ref.see_capacity(capacity)
            table = np.round(rng.uniform(0, 4, (L, E)))  # many ties
            table[rng.random((L, E)) < 0.05] = np.nan
            inputs["table"] = None if rng.random() < 0.1 else table
            probs = np.round(rng.uniform(0, 1, E), 1).astype(np.float32)
            probs[rng.random(E) < 0.05] = np.nan
            inputs["probs"] = None if rng.random() < 0.1 else probs
            rows = int(rng.integers(1, 4))
            event = RoutingEvent(int(rng.integers(0, L)), rng.integers(0, E, (rows, 2)).astype(np.uint8),
                                 np.zeros(rows, np.int64), np.zeros(rows, np.int64))
            fast.observe(event)
            ref.observe(event)
            assert fast.recency == ref.recency
            ghosts = fast._ghosts
            assert np.array_equal(ghosts[kernels.HELD, :L * E] == 1, ref._model.ravel())
            assert (ghosts[kernels.COUNTS, kernels.MODEL_HITS], ghosts[kernels.COUNTS, kernels.LRU_HITS]) == \
                (ref._model_hits, ref._lru_hits)
            order, node = [], ghosts[kernels.LRU_AFTER, L * E]
            while node != L * E:
                order.append(int(node))
                node = ghosts[kernels.LRU_AFTER, node]
            assert order == [key.layer * E + key.expert for key in ref._lru]
            leaders.add(fast.recency)
    assert leaders == {False, True}  # both leaders were compared


def test_largest_is_the_order_of_repeated_argmaxes():
    rng = np.random.default_rng(1)
    for _ in range(50):
        values = np.round(rng.uniform(0, 5, 40))  # ties
        values[rng.random(40) < 0.5] = -np.inf  # not resident
        out = np.zeros(8, np.int64)
        count = kernels.largest(values, out)
        masked, want = values.copy(), []
        while len(want) < 8 and masked.max() > -np.inf:
            want.append(int(masked.argmax()))
            masked[want[-1]] = -np.inf
        assert out[:count].tolist() == want


def test_the_timing_tool_replays_through_the_driver_as_the_bench_does(policy, traces, tmp_path, capsys):
    from moestream.bench.tools.overhead import overhead_us_per_layer
    from moestream.trace.format import save_trace

    trace, L = traces[1], policy.topology.num_layers
    tokens = sum(1 for _ in decode_stream(trace))
    micros, allocated = decision_cost.layer_micros(copy.deepcopy(policy), trace, 0.1, 2, tokens, traced=L + 2)
    assert len(micros) == tokens * L and allocated > 0  # every layer decision, one traced
    assert overhead_us_per_layer(policy, trace, 2) > 0  # the bench's figure over the same replay
    policy.save(tmp_path / "default")
    save_trace(trace, tmp_path / "trace.npz")
    assert decision_cost.main(["--predictor-dir", str(tmp_path / "default"), "--trace", str(tmp_path / "trace.npz"),
                               "--max-tokens", "20"]) == 0
    printed = capsys.readouterr().out
    assert f"{20 * L} layer decisions" in printed and "default minus lru" in printed
