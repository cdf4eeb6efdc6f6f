"""default's online state: its predictions equal the whole-trace path's, for every variant."""

import dataclasses

import numpy as np
import pytest

from moestream.eval.prediction import evaluate_predictor
from moestream.policies.default.model import DefaultConfig
from moestream.predictors.configs import TrainConfig
from tests.policies.default.common import fitted_policy
from tests.policies.online import OnlineOnly


@pytest.mark.parametrize("horizon", [1, 2, 3, 5])
def test_online_predictions_equal_whole_trace_scoring(policy, traces, horizon):
    test = traces[1]
    scored = evaluate_predictor(policy.predictor, test, horizon)
    policy.predictor.reset()
    online = evaluate_predictor(OnlineOnly(policy.predictor), test, horizon)
    np.testing.assert_array_equal(scored.hits, online.hits)
    np.testing.assert_array_equal(scored.predicted, online.predicted)


@pytest.mark.parametrize("overrides", [{"cut_recall": True}, {"hidden_units": 8}, {"hidden_units": 8, "cut_recall": True}])
def test_every_variant_predicts_online_what_it_scores(traces, overrides):
    config = dataclasses.replace(DefaultConfig(), **overrides)
    policy = fitted_policy(traces[0], config=config, train=TrainConfig(num_epochs=3, batch_size=64))
    assert set(policy.predictor.tensors()) >= ({"out", "out_bias"} if config.hidden_units else set())
    for horizon in (1, 3):
        scored = evaluate_predictor(policy.predictor, traces[1], horizon)
        policy.predictor.reset()
        online = evaluate_predictor(OnlineOnly(policy.predictor), traces[1], horizon)
        np.testing.assert_array_equal(scored.hits, online.hits)
        np.testing.assert_array_equal(scored.predicted, online.predicted)
