"""The token memory: each token's mean routing over a trace and that of the token after it, pulled
toward every token's mean, and the leave-one-out view that training shows each row."""

import numpy as np

from moestream.policies.default.features import TokenMemory, memory_index, memory_rows
from moestream.policies.routing_stats import previous_rows

L, E, V = 3, 5, 4


def _rows(seed=0, n=40):
    rng = np.random.default_rng(seed)
    hot = rng.random((n, L, E)) < 0.4  # [N, L, E]
    tokens = rng.integers(0, V, n)  # 0: the unknown token
    prev = previous_rows(np.repeat(np.arange(4), n // 4))  # four sequences
    return hot, tokens, prev


def test_the_table_holds_each_token_s_and_its_successors_smoothed_means():
    hot, tokens, prev = _rows()
    table = memory_rows(TokenMemory(hot, tokens, prev, V).table(), slice(None))  # [2V, L, E]
    mean = hot.mean(axis=0)
    for v in range(1, V):
        mine = hot[tokens == v]
        assert np.allclose(table[v], (mine.sum(axis=0) + mean) / (len(mine) + 1), atol=2e-3)
    assert np.allclose(table[0], mean, atol=2e-3)
    for v in range(V):
        after = hot[[r for r in range(len(tokens)) if prev[r] >= 0 and tokens[prev[r]] == v]]
        assert np.allclose(table[V + v], (after.sum(axis=0) + mean) / (len(after) + 1), atol=2e-3)


def test_a_known_token_reads_its_own_row_else_the_one_after_its_previous_token():
    index = memory_index(np.array([2, 0, 0, 3]), np.array([1, 3, -1, -1]), V)
    assert index.tolist() == [2, V + 3, 0, 3]


def test_a_row_s_memory_without_it_is_the_table_of_the_trace_without_that_row():
    hot, tokens, prev = _rows(seed=1)
    memory = TokenMemory(hot, tokens, prev, V)
    before = np.where(prev >= 0, tokens[np.maximum(prev, 0)], -1)
    shown = np.where(np.arange(len(tokens)) % 3 == 0, 0, tokens)  # some rows shown as unknown
    index = memory_index(shown, before, V)
    left_out = memory.without(hot, index)  # [N, L, E]
    for row in range(len(tokens)):
        others = np.arange(len(tokens)) != row
        if 0 < index[row] < V:
            same = others & (tokens == index[row])
        elif index[row] >= V:
            same = others & (before == index[row] - V)
        else:
            assert np.allclose(left_out[row], memory.mean)
            continue
        assert np.allclose(left_out[row], (hot[same].sum(axis=0) + memory.mean) / (same.sum() + 1), atol=1e-5)
