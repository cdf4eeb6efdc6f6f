import numpy as np
import pytest

from moestream.policies.default import recall
from moestream.policies.default.channels import CHANNELS
from moestream.policies.default.memory import TokenMemory

L, E, K = 5, 8, 2


def routed(rng, n):
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])  # [n, L, K]


def setting(seed=0):
    """A trace of two sequences (as History), its tokens and seq_ids, and a memory of other prompts."""
    rng = np.random.default_rng(seed)
    experts, seq_ids = routed(rng, 12), np.array([0] * 7 + [1] * 5)
    tokens = np.array([1, 2, 1, 3, 1, 0, 2, 2, 1, 2, 0, 3])
    earlier, valid = recall.earlier_rows(recall.first_rows(seq_ids))
    history = recall.History(recall.masks(experts, E), experts, tokens, earlier, valid)
    memory = TokenMemory.build(routed(rng, 30), rng.integers(0, 4, 30), rng.integers(0, 3, 30), 4, 10, rng, E)
    return history, memory, tokens, seq_ids


@pytest.mark.parametrize("name", CHANNELS.names())
def test_every_channel_picks_real_rows_and_recalls_alike_online_and_offline(name):
    history, memory, tokens, seq_ids = setting()
    sources = CHANNELS.create(name).sources(history, memory, tokens, seq_ids)
    assert sources.index.shape == sources.valid.shape and len(sources.index) == len(tokens)
    assert (sources.index[sources.valid] < len(sources.experts)).all()
    cuts = np.full((len(tokens), L), 1)
    batch = sources.batch(history.bit_sets, cuts, E)  # [n, L, E]
    for layer in (2, 4):
        offline = sources.at(history.bit_sets, 1, layer, E)
        np.testing.assert_allclose(batch[:, layer], offline, atol=1e-5)
        for i in range(len(tokens)):
            rows = sources.row(i)
            online = rows.recall(rows.weights(recall.known_sets(history.experts[i], 1, E)), np.array([layer]), E)[0]
            np.testing.assert_allclose(online, offline[i], atol=1e-5)
            assert np.isclose(online.sum(), K * sources.valid[i].any())  # a weighted mean of K-hots, or nothing


def test_recall_reads_the_sequences_earlier_tokens_and_repeat_only_the_same_token():
    history, memory, tokens, seq_ids = setting()
    in_sequence = CHANNELS.create("recall").sources(history, memory, tokens)
    repeats = CHANNELS.create("repeat").sources(history, memory, tokens)
    assert (in_sequence.valid == history.valid).all()
    assert not (repeats.valid & ~in_sequence.valid).any()
    picked = {(i, int(j)) for i in range(len(tokens)) for j in repeats.index[i][repeats.valid[i]]}
    assert picked == {(2, 0), (4, 0), (4, 2), (6, 1), (9, 7)}  # never across sequences: row 7 recalls nothing
    assert not repeats.valid[tokens == recall.UNKNOWN].any()  # the unknown token repeats nothing


def test_memory_reads_the_tokens_stored_rows_and_leaves_out_its_own_sequence_in_training():
    history, memory, tokens, _ = setting()
    online = CHANNELS.create("memory").sources(history, memory, tokens)
    counts = np.diff(memory.offsets)[tokens]
    assert online.valid.sum(axis=1).tolist() == counts.tolist()
    stored_seq = np.zeros(len(tokens), dtype=np.int64) + 1
    training = CHANNELS.create("memory").sources(history, memory, tokens, stored_seq)
    for i in range(len(tokens)):
        assert (memory.seq_ids[training.index[i][training.valid[i]]] != 1).all()
        assert set(training.index[i][training.valid[i]]) <= set(online.index[i][online.valid[i]])
