"""The token memory: each token's mean routing over a trace, pulled toward every token's mean, and
the leave-one-out view that training shows each row."""

import numpy as np

from moestream.policies.default.features import TokenMemory

L, E, V = 3, 5, 4


def _rows(seed=0, n=40):
    rng = np.random.default_rng(seed)
    hot = rng.random((n, L, E)) < 0.4  # [N, L, E]
    tokens = rng.integers(0, V, n)  # 0: the unknown token
    return hot, tokens


def test_the_table_is_each_token_s_smoothed_mean_and_every_token_s_mean_when_unknown():
    hot, tokens = _rows()
    table = TokenMemory(hot, tokens, V).table().astype(np.float32)
    mean = hot.mean(axis=0)
    for v in range(1, V):
        mine = hot[tokens == v]
        assert np.allclose(table[v], (mine.sum(axis=0) + mean) / (len(mine) + 1), atol=1e-3)
    assert np.allclose(table[0], mean, atol=1e-3)


def test_a_row_s_memory_without_it_is_the_table_of_the_trace_without_that_row():
    hot, tokens = _rows(seed=1)
    memory = TokenMemory(hot, tokens, V)
    left_out = memory.without(hot, tokens)  # [N, L, E]
    for row in [i for i in range(len(tokens)) if tokens[i] > 0][:6]:
        others = np.arange(len(tokens)) != row
        alone = (hot[others & (tokens == tokens[row])].sum(axis=0) + memory.mean) / (tokens == tokens[row]).sum()
        assert np.allclose(left_out[row], alone, atol=1e-5)
    assert np.allclose(left_out[tokens == 0], memory.mean)
