"""The driver calls a policy in the contract's order, the mechanism between, and times the policy."""

from moestream.bench.sim.replay import decode_stream
from moestream.contracts import CacheView, Observer, Policy, Prediction, Predictor, PrefetchPlanner, TransferRequest
from moestream.policies.driver import PolicyDriver
from moestream.topology import ExpertKey, Topology
from moestream.tracer import Tracer
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=4, top_k=1, expert_bytes=64)


class Spy(Predictor, PrefetchPlanner):
    def __init__(self, log):
        super().__init__(TOPOLOGY)
        self.log = log

    def begin_iteration(self, ctx):
        self.log.append(("begin", ctx.step))

    def observe(self, event):
        self.log.append(("observe", event.layer))

    def end_sequence(self, seq_id):
        self.log.append(("end", seq_id))

    def predict(self, layer_now, horizon_layers):
        self.log.append(("predict", layer_now, horizon_layers))
        return [Prediction((layer_now + 1) % TOPOLOGY.num_layers, 0, 1.0, int(layer_now + 1 >= TOPOLOGY.num_layers))]

    def plan(self, predictions, view):
        self.log.append(("plan", view.layer_now))
        return [TransferRequest(p.key, 1.0) for p in predictions]


class SpyPolicy(Policy):
    def __init__(self, log):
        self.log = log
        super().__init__(TOPOLOGY)

    def make_predictor(self):
        return Spy(self.log)

    def make_planner(self):
        return self.predictor


class Tail(Observer):
    def __init__(self, log):
        self.log = log

    def observe(self, event):
        self.log.append(("tail", event.layer))


class Mechanism:
    def __init__(self, log):
        self.log = log

    def routed(self, event, num_tokens):
        self.log.append(("routed", event.layer))

    def predicted(self, layer_now, predictions):
        self.log.append(("predicted", layer_now, len(predictions)))


def test_one_iteration_runs_in_the_contract_order():
    log = []
    tracer = Tracer()
    driver = PolicyDriver(SpyPolicy(log), observers=[Tail(log)], horizon_layers=1, tracer=tracer)
    trace = synthetic_trace(TOPOLOGY, num_sequences=1, tokens_per_sequence=1, seed=0)
    driver.run(decode_stream(trace), Mechanism(log))
    per_layer = [[("observe", l), ("tail", l), ("routed", l), ("predict", l, 1), ("predicted", l, 1)] for l in range(3)]
    assert log == [("begin", 0), ("predict", -1, 1), ("predicted", -1, 1), *sum(per_layer, []), ("end", 0)]
    calls = 1 + 1 + 3 * 2 + 1  # begin, predict(-1), observe and predict per layer, end: one span each
    policy = tracer.totals()["policy"]
    assert policy.spans == calls and policy.seconds > 0


def test_decide_plans_against_the_view_of_its_layer_and_nothing_at_horizon_zero():
    log = []
    views = []

    def view(layer_now):
        views.append(layer_now)
        return CacheView(frozenset(), frozenset(), 4, layer_now, TOPOLOGY.num_layers)

    tracer = Tracer(keep_spans=8)
    driver = PolicyDriver(SpyPolicy(log), horizon_layers=2, tracer=tracer)
    assert driver.decide(1, view) == [TransferRequest(ExpertKey(2, 0), 1.0)]
    assert views == [1] and log == [("predict", 1, 2), ("plan", 1)]
    assert PolicyDriver(SpyPolicy(log), horizon_layers=0, tracer=tracer).decide(1, view) == [] and views == [1]
    spans = tracer.window(float("-inf"), float("inf"))  # a decision is one span, named by its requests
    assert [(s.lane, s.label) for s in spans] == [("policy", "after layer 1: 1 requests"),
                                                  ("policy", "after layer 1: 0 requests")]
