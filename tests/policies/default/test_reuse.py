"""default's reuse model (reuse.py): the stream's inputs and labels for training, the fit, and the policy's
eviction waiting by it."""

import numpy as np
from scipy.special import expit

from moestream.bench.sim.replay import decode_stream
from moestream.policies.default import reuse
from tests.policies.default.common import TOPOLOGY


def brute_age(hot, row):
    """[L, E] iterations since each expert's last use at or before row (NEVER plus the row's count if none)."""
    age = np.full(hot.shape[1:], reuse.NEVER + row + 1)
    for t in range(row + 1):
        age = np.where(hot[t], float(row - t), age)
    return age


def test_stream_inputs_and_distances_are_the_stream_s_at_each_row():
    rng = np.random.default_rng(0)
    hot = rng.random((30, 2, 5)) < 0.2  # [N, L, E]
    rows = np.array([0, 4, 17, 29])
    age, ema = reuse.stream_inputs(hot, rows)
    distance = reuse.next_use_distance(hot, rows)
    for i, row in enumerate(rows.tolist()):
        np.testing.assert_array_equal(age[i], brute_age(hot, row))
        for d, decay in enumerate(reuse.DECAYS):
            want = sum((1 - decay) * decay ** (row - t) * hot[t] for t in range(row + 1))
            np.testing.assert_allclose(ema[d, i], want, rtol=1e-5)
        later = [t - row for t in range(row + 1, len(hot))]
        for layer in range(2):
            for e in range(5):
                uses = [d for d in later if hot[row + d, layer, e]]
                assert distance[i, layer, e] == uses[0] if uses else distance[i, layer, e] > reuse.HORIZONS[-1]


def test_the_fitted_chances_are_calibrated_and_follow_the_age():
    """On a stream where each expert comes back after a fixed number of iterations, the model's chances
    average what happens, and one just used is far less likely back next iteration than in eight."""
    N, L = 400, 2
    period = np.array([2, 3, 4, 5, 7, 9])
    hot = (np.arange(N)[:, None, None] % period == 0) & np.ones((1, L, 1), bool)  # [N, L, E]
    rows = np.arange(20, N - 10)
    age, ema = reuse.stream_inputs(hot, rows)
    distance = reuse.next_use_distance(hot, rows)
    logit = np.zeros(age.shape)  # a routing model that knows nothing
    weights = reuse.fit(logit, age, ema, distance)
    assert weights.shape == (L, len(reuse.HORIZONS), reuse.NUM_INPUTS)
    x = reuse.inputs(logit[:, 0], age[:, 0], ema[:, :, 0])  # [B, E, F]
    chances = expit(x @ weights[0].T.astype(np.float64))  # [B, E, H]
    for h, horizon in enumerate(reuse.HORIZONS):
        assert abs(chances[..., h].mean() - (distance[:, 0] <= horizon).mean()) < 0.02
    just_used = age[:, 0] == 0
    assert chances[..., 0][just_used].mean() < 0.5 < chances[..., 3][just_used].mean()


def test_the_policy_s_waits_are_the_reuse_model_s(policy, traces):
    """A layer passed waits L x the reuse state's expected iterations; one still ahead, the share its own
    probability leaves of the wait past this token."""
    predictor = policy.predictor
    predictor.reset()
    stream = decode_stream(traces[1])
    for token in range(3):  # the third token up to its second layer
        it = next(stream)
        predictor.begin_iteration(it.ctx)
        for event in it.events[:2] if token == 2 else it.events:
            predictor.observe(event)
    state, L, c = predictor.state, TOPOLOGY.num_layers, 1
    wait = predictor.expected_wait()
    passed = np.arange(L) <= c
    layers = np.arange(L)[:, None] - c
    np.testing.assert_allclose(wait[passed], (layers + L * state.reuse[reuse.PASSED])[passed])
    ahead = (1 - state.ahead.astype(np.float64)) * state.reuse[reuse.AHEAD]
    np.testing.assert_allclose(wait[~passed], (layers + L * ahead)[~passed])
    assert (state.reuse[reuse.AGE] < reuse.NEVER).any()  # the stream's inputs are kept across tokens
