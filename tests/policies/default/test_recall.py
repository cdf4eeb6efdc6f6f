import numpy as np
import pytest

from moestream.policies.default import recall
from moestream.policies.default.channels import CHANNELS

L, E, K = 5, 8, 2


def routed(rng, n):
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])  # [n, L, K]


def hot(experts):
    out = np.zeros(experts.shape[:-1] + (E,), dtype=np.float32)
    np.put_along_axis(out, experts, 1.0, axis=-1)
    return out


def window_of(tokens):
    window = recall.RecallWindow(L, E, K)
    for token in tokens:
        window.push(token)
    return window


def recall_online(window, current, cut, targets):
    """[n, E]: the window's in-sequence recall for a token routed as current [L, K] up to cut."""
    rows = CHANNELS.create("recall").sources(window.history(), None, np.array([recall.UNKNOWN])).row(0)
    return rows.recall(rows.weights(recall.known_sets(current, cut, E)), targets, E)


def test_first_and_earlier_rows_stay_inside_each_sequence():
    first = recall.first_rows(np.array([7, 7, 7, 3, 3]))
    assert first.tolist() == [0, 0, 0, 3, 3]
    earlier, valid = recall.earlier_rows(first)
    assert earlier[2, :2].tolist() == [1, 0] and valid[2].sum() == 2
    assert earlier[4, 0] == 3 and valid[4].sum() == 1 and valid[3].sum() == 0


def test_tokens_that_routed_alike_dominate_the_recall():
    current = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [0, 2]])
    alike = current.copy()
    alike[4] = [6, 7]  # shares layers 0..3, differs at the target
    unlike = np.array([[6, 7], [6, 7], [6, 7], [0, 1], [3, 4]])
    out = recall_online(window_of([alike, unlike]), current, 3, np.array([4]))[0]
    assert out[6] > 0.9 and out[3] < 0.1
    assert np.isclose(out.sum(), K)


def test_nothing_known_gives_the_mean_of_the_window():
    tokens = routed(np.random.default_rng(0), 4)
    out = recall_online(window_of(tokens), tokens[0], -1, np.arange(L))
    np.testing.assert_allclose(out, hot(tokens).mean(axis=0), atol=1e-6)


def test_the_window_keeps_only_the_last_tokens(monkeypatch):
    monkeypatch.setattr(recall, "WINDOW", 2)
    tokens = routed(np.random.default_rng(1), 5)
    out = recall_online(window_of(tokens), tokens[0], -1, np.arange(L))
    np.testing.assert_allclose(out, hot(tokens[-2:]).mean(axis=0), atol=1e-6)


@pytest.mark.parametrize("cut", [-1, 0, 2, 3])
def test_online_trace_and_batch_recall_agree(cut):
    rng = np.random.default_rng(2)
    experts = routed(rng, 12)
    seq_ids = np.array([0] * 7 + [1] * 5)
    earlier, valid = recall.earlier_rows(recall.first_rows(seq_ids))
    layer = cut + 1
    bit_sets = recall.masks(experts, E)
    offline = recall.trace_recall(bit_sets, bit_sets, experts, earlier, valid, cut, layer, E, chunk_rows=5)
    cuts = np.full((len(experts), L), cut)
    batch = recall.batch_recall(bit_sets, bit_sets[earlier], experts[earlier], valid, cuts, E)[:, layer]
    np.testing.assert_allclose(batch, offline, atol=1e-5)
    for start, end in ((0, 7), (7, 12)):
        window = recall.RecallWindow(L, E, K)
        for row in range(start, end):
            online = recall_online(window, experts[row], cut, np.array([layer]))[0]
            np.testing.assert_allclose(online, offline[row], atol=1e-5)
            window.push(experts[row])


def test_masks_count_shared_experts_beyond_one_word():
    a = np.array([[[0, 63, 64, 130]]])  # [1, 1, K]
    b = np.array([[[[63, 64, 100, 131]]]])  # [1, 1, 1, K]
    assert recall.masks(a, 140).shape == (1, 1, 3)
    assert recall.shared_ids(recall.masks(a, 140), recall.masks(b, 140)).item() == 2
