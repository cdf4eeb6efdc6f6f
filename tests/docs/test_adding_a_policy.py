"""The worked example of docs/adding-a-policy.md is real: read from the page, registered, and run
through the same contract suite as every registered policy, plus its own behaviour."""


import numpy as np
import pytest

from moestream.events import IterationContext, RoutingEvent
from moestream.policies import POLICIES
from moestream.topology import ExpertKey
from tests.docs.pages import DOCS, python_example
from tests.policies.test_contracts import POLICY_CHECKS, TOPOLOGY, contract_trace

PAGE = DOCS / "adding-a-policy.md"


def example_source() -> str:
    return python_example(PAGE)


@pytest.fixture
def example(monkeypatch):
    """The example's namespace, its policy registered only for the test."""
    monkeypatch.setattr(POLICIES, "_classes", dict(POLICIES._classes))
    namespace = {"__name__": "adding_a_policy_example"}
    exec(compile(example_source(), str(PAGE), "exec"), namespace)
    return namespace


def test_example_is_30_to_60_lines():
    assert 30 <= len(example_source().strip().splitlines()) <= 60


@pytest.mark.parametrize("check", POLICY_CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_example_passes_the_contract_suite(example, check):
    assert "last-tokens" in POLICIES
    check("last-tokens", contract_trace())


def _event(layer, experts):
    return RoutingEvent(layer, np.array([experts]), np.array([0]), np.array([0]))


def test_example_predicts_and_keeps_the_experts_of_the_last_tokens(example):
    policy = POLICIES.create("last-tokens", TOPOLOGY)
    predictor, eviction = policy.predictor, policy.make_eviction("device")
    for step, experts in enumerate(([1, 2], [2, 3])):
        predictor.begin_iteration(IterationContext(step, np.array([0]), np.array([step]), False))
        predictor.observe(_event(0, experts))
    predicted = {(p.expert, p.score) for p in predictor.predict(-1, 1)}
    assert predicted == {(1, 0.5), (2, 1.0), (3, 0.5)}
    for expert in (5, 2, 6):
        eviction.on_insert(ExpertKey(0, expert))
    assert eviction.victim([ExpertKey(0, 2), ExpertKey(0, 6), ExpertKey(0, 5)]) == ExpertKey(0, 5)
