"""The statistics behind the predictive baselines."""

import numpy as np

from moestream.policies.routing_stats import (
    Cooccurrence,
    TokenFrequencies,
    calibration_sample,
    fit_evidence_scale,
    layer_popularity,
    logit,
    previous_rows,
    sigmoid,
)
from moestream.predictors.paths import expert_mask
from moestream.topology import Topology
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=6, top_k=2, expert_bytes=1)


def test_popularity_rows_sum_to_top_k():
    trace = synthetic_trace(TOPOLOGY, num_sequences=3, tokens_per_sequence=7, seed=1)
    popularity = layer_popularity(trace)
    np.testing.assert_allclose(popularity.sum(axis=1), 2.0)
    assert popularity[1, trace.experts[0, 1, 0]] > 0


def test_previous_rows_stop_at_sequence_starts():
    assert previous_rows(np.array([4, 4, 4, 9, 9, 1])).tolist() == [-1, 0, 1, -1, 3, -1]


def test_cooccurrence_tables_are_conditional_probabilities():
    trace = synthetic_trace(TOPOLOGY, num_sequences=5, tokens_per_sequence=9, seed=2)
    model = Cooccurrence.fit(trace, max_lag=4)
    for layer in range(3):
        for lag in (1, 2, 4, 6):  # 6 > max_lag is chained
            table = model.table(layer, lag)
            assert table.shape == (6, 6) and (table >= 0).all() and (table <= 1).all()
            np.testing.assert_allclose(table.sum(axis=1), 2.0, rtol=1e-5)


def test_cooccurrence_counts_pairs_across_tokens():
    trace = synthetic_trace(TOPOLOGY, num_sequences=2, tokens_per_sequence=30, seed=3)
    model = Cooccurrence.fit(trace, max_lag=2)
    # lag 1 from the last layer is the next token's first layer, within a sequence only
    prev = previous_rows(trace.seq_ids)
    rows = np.flatnonzero(prev >= 0)
    src, dst = trace.experts[prev[rows], 2], trace.experts[rows, 0]
    a = int(src[0, 0])
    with_a = (src == a).any(axis=1)
    b = int(dst[with_a][0, 0])
    joint = ((dst[with_a] == b).any(axis=1)).sum()
    expected = (joint + layer_popularity(trace)[0, b]) / (with_a.sum() + 1)
    assert model.table(2, 1)[a, b] == np.float32(expected)


def test_token_frequencies_leave_one_out():
    trace = synthetic_trace(TOPOLOGY, num_sequences=2, tokens_per_sequence=5, vocab_size=3, seed=4)
    freq = TokenFrequencies.fit(trace, alpha=1.0)
    rows = freq.rows_of(trace.token_ids.tolist(), trace.num_tokens)
    full, loo = freq.score(rows, 0), freq.score(rows, 0, exclude=trace.experts[:, 0].astype(int))
    own = expert_mask(trace.experts[:, 0], 6)
    assert (loo[own] < full[own]).all() and (loo[~own] >= full[~own]).all()
    assert (freq.rows_of(None, 4) == -1).all()


def test_evidence_scale_recovers_a_known_temperature():
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(3):
        evidence = rng.normal(0, 2, size=(4000, 6))
        prior = logit(np.full(6, 0.3))
        routed = rng.random((4000, 6)) < sigmoid(prior + 0.5 * evidence)
        samples.append((evidence, prior, routed))
    assert abs(fit_evidence_scale(samples) - 0.5) < 0.05


def test_calibration_sample_takes_whole_sequences():
    trace = synthetic_trace(TOPOLOGY, num_sequences=10, tokens_per_sequence=7, seed=5)
    sample = calibration_sample(trace, 15, seed=1)
    assert sample.num_tokens == 21  # the fewest whole sequences reaching 15 tokens
    assert calibration_sample(trace, 15, seed=1).sequence_ids() == sample.sequence_ids()
