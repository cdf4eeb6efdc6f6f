import numpy as np

from moestream.policies.default import recall
from moestream.policies.default.memory import TokenMemory
from moestream.policies.default.recall import Sources

L, E, K = 5, 8, 2


def routed(rng, n):
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])  # [n, L, K]


def built(tokens, seq_ids, max_rows=100, seed=0):
    experts = routed(np.random.default_rng(seed), len(tokens)).astype(np.uint8)
    memory = TokenMemory.build(experts, np.asarray(tokens), np.asarray(seq_ids), 4, max_rows,
                               np.random.default_rng(seed), E)
    return memory, experts


def test_keeps_at_most_max_rows_of_each_known_token_and_none_of_the_unknown():
    tokens = [0, 1, 1, 1, 2, 1, 0, 2]
    memory, experts = built(tokens, np.arange(8), max_rows=2)
    assert memory.offsets.tolist() == [0, 0, 2, 4, 4]
    stored = {tuple(row.ravel()) for row in memory.experts}
    assert stored <= {tuple(experts[i].ravel()) for i in (1, 2, 3, 5, 4, 7)}
    assert {tuple(experts[i].ravel()) for i in (4, 7)} <= stored  # token 2 has just two rows: both kept


def test_rows_are_padded_and_leave_out_the_own_sequence():
    memory, _ = built([1, 1, 1, 2], seq_ids=[5, 5, 6, 7])
    index, valid = memory.rows(np.array([1, 2, 0, 3]), seq_ids=np.array([5, 7, 9, 9]))
    assert index.shape == (4, 3)
    assert valid.sum(axis=1).tolist() == [1, 0, 0, 0]  # token 1 in sequence 5 keeps only sequence 6's row
    assert memory.seq_ids[index[0][valid[0]]].tolist() == [6]
    assert built([1, 1, 1, 2], [5, 5, 6, 7])[0].rows(np.array([2]))[1].sum() == 1  # online: no sequence to leave out


def test_an_empty_memory_recalls_nothing():
    memory, _ = built([0, 0, 0], [1, 2, 3])
    index, valid = memory.rows(np.array([0, 2]))
    assert not valid.any()
    rows = Sources(memory.bit_sets, memory.experts, index, valid).row(0)
    w = rows.weights(recall.known_sets(routed(np.random.default_rng(1), 1)[0], 2, E))
    assert rows.recall(w, np.array([3, 4]), E).tolist() == np.zeros((2, E)).tolist()


def test_online_memory_equals_whole_trace_memory_at_every_cut():
    rng = np.random.default_rng(3)
    memory, _ = built(rng.integers(0, 4, 60), rng.integers(0, 5, 60), max_rows=10, seed=3)
    restored = TokenMemory.from_arrays(memory.arrays(), E)
    tokens = np.array([1, 2, 3, 0])
    current = routed(rng, len(tokens))
    bit_sets = recall.masks(current, E)
    sources = Sources(restored.bit_sets, restored.experts, *restored.rows(tokens))
    for cut in range(-1, L - 1):
        for layer in range(cut + 1, L):
            offline = sources.at(bit_sets, cut, layer, E)
            for i in range(len(tokens)):
                rows = sources.row(i)
                online = rows.recall(rows.weights(recall.known_sets(current[i], cut, E)), np.array([layer]), E)[0]
                np.testing.assert_allclose(online, offline[i], atol=1e-6)


def test_stored_rows_that_routed_alike_dominate():
    current = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [0, 2]])
    alike, unlike = current.copy(), np.array([[6, 7], [6, 7], [6, 7], [0, 1], [3, 4]])
    alike[4] = [6, 7]
    memory = TokenMemory(np.stack([alike, unlike]), np.array([0, 0, 2]), E)
    rows = Sources(memory.bit_sets, memory.experts, *memory.rows(np.array([1]))).row(0)
    w = rows.weights(recall.known_sets(current, 3, E))
    assert w[0] > 0.95 and np.isclose(w.sum(), 1.0)
    at_target = rows.recall(w, np.array([4]), E)[0]
    assert at_target[6] > 0.95 and at_target[3] < 0.05
    uniform = rows.weights(recall.known_sets(current, -1, E))  # nothing routed yet: the plain mean
    np.testing.assert_allclose(uniform, [0.5, 0.5])
