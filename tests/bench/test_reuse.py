"""Reuse distances: how many tokens ahead each expert use is used again, and in which sequence."""

import numpy as np
import pytest

from moestream.bench.tools.reuse import TOKEN_SPANS, next_uses, reuse_profile
from moestream.topology import Topology
from moestream.trace.schema import Trace
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2), num_experts=4, top_k=1, expert_bytes=1000)


def _trace(experts, seq_ids):
    n = len(seq_ids)
    return Trace(TOPOLOGY, np.array(experts, dtype=np.int16).reshape(n, 2, 1), np.array(seq_ids, dtype=np.int32),
                 np.zeros(n, dtype=np.int32), np.ones(n, dtype=bool))


def test_distances_count_tokens_to_the_next_use_of_the_same_layer_and_expert():
    # layer 0 uses 0, 1, 0, 0; layer 1 uses 2, 2, 3, 2; the sequences are [0, 1] and [2, 3]
    trace = _trace([[0, 2], [1, 2], [0, 3], [0, 2]], [0, 0, 1, 1])
    distances, same = next_uses(trace)
    found = sorted(zip(distances.tolist(), same.tolist()))
    # layer 0: 0@0 -> 0@2 (2, other seq), 1@1 never, 0@2 -> 0@3 (1, same), 0@3 never
    # layer 1: 2@0 -> 2@1 (1, same), 2@1 -> 2@3 (2, other), 3@2 never, 2@3 never
    expected = [(2, False), (0, False), (1, True), (0, False), (1, True), (2, False), (0, False), (0, False)]
    assert found == sorted(expected)


def test_profile_shares_follow_the_distances():
    trace = _trace([[0, 2], [1, 2], [0, 3], [0, 2]], [0, 0, 1, 1])
    profile = reuse_profile(trace)
    assert profile.num_accesses == 8 and profile.reused_share == pytest.approx(4 / 8)
    assert profile.median_tokens == pytest.approx(1.5) and profile.same_sequence_share == pytest.approx(0.5)
    assert profile.within_tokens[1] == pytest.approx(0.5) and profile.within_tokens[2] == pytest.approx(1.0)


def test_within_shares_grow_with_the_span_and_reach_all_reuses():
    trace = synthetic_trace(Topology((1, 2, 3), num_experts=8, top_k=2, expert_bytes=1), num_sequences=5, seed=2)
    shares = [reuse_profile(trace).within_tokens[span] for span in TOKEN_SPANS]
    assert shares == sorted(shares) and 0.0 < shares[0] and shares[-1] <= 1.0
    distances, _ = next_uses(trace)
    assert len(distances) == trace.num_tokens * 3 * 2  # top-k ids of one token are distinct


def test_an_empty_trace_has_an_empty_profile():
    trace = _trace([], [])
    assert reuse_profile(trace).num_accesses == 0
