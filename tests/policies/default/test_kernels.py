"""The compiled kernels against the numpy arithmetic they replace (one-hot products, unions, waits)."""

import subprocess
import sys

import numpy as np
import pytest

from moestream.policies.default.kernels import absorb, add_routed, expect, union_into

E, U, L = 8, 8, 5


def one_hot(ids: np.ndarray) -> np.ndarray:
    rows = np.zeros((len(ids), E), np.float32)
    rows[np.arange(len(ids))[:, None], ids] = 1.0  # a repeated expert is one entry
    return rows


@pytest.mark.parametrize("with_before", [False, True])
def test_add_routed_is_the_one_hot_rows_times_the_weights(with_before):
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(3, 7 * E, U)).astype(np.float32)  # [3, 7E, U]
    now = np.array([[1, 4], [2, 2], [7, 0]])  # the second row repeats an expert
    before = np.array([[3, 5], [6, 1], [0, 0]]) if with_before else np.zeros((3, 0), np.int64)
    steps = rng.uniform(size=(3, 2, 1)).astype(np.float32)
    pre = rng.normal(size=(3, 3, U)).astype(np.float32)
    want = pre.astype(np.float64)
    cur, prev = one_hot(now), one_hot(before) if with_before else np.zeros((3, E), np.float32)
    want[:, :2] += np.einsum("te,bue->tbu", cur, dense[:2, :E].swapaxes(1, 2))
    want[:, :2] += np.einsum("te,bue->tbu", prev, dense[:2, E:2 * E].swapaxes(1, 2))
    start = dense[2, 2 * E:3 * E] + steps[:, 0, :, None] * dense[2, 4 * E:5 * E] + steps[:, 1, :, None] * dense[2, 5 * E:6 * E]
    want[:, 2] += np.einsum("te,teu->tu", cur, start)
    add_routed(pre, dense, now, before, steps)
    np.testing.assert_allclose(pre, want, rtol=1e-5, atol=1e-5)


def test_union_is_the_chance_that_some_row_needs_the_expert():
    probs = np.random.default_rng(1).uniform(size=(4, 2, E)).astype(np.float32)
    out = np.zeros((2, E), np.float32)
    union_into(out, probs, np.array([0, 2, 3]))
    np.testing.assert_allclose(out, 1.0 - np.prod(1.0 - probs[[0, 2, 3]], axis=0), rtol=1e-6)
    union_into(out, probs, np.array([1]))
    assert np.array_equal(out, probs[1])  # one row: its own probabilities, exactly
    union_into(out, probs, np.zeros(0, np.int64))
    assert not out.any()  # no rows: nothing is needed


def test_expect_waits_for_layers_ahead_and_for_the_next_token_at_the_layer_passed():
    rng = np.random.default_rng(2)
    ahead, following = rng.uniform(size=(2, L, E)).astype(np.float32)
    following[3, 0] = 0.0  # floored at 1e-4
    next_use = np.full((L, E), -1.0)
    expect(next_use, ahead, following, 2, 4, 2)
    q = np.maximum(following, np.float32(1e-4)).astype(np.float64)
    layers = np.arange(L)[:, None]
    np.testing.assert_allclose(next_use[2], 2 + L / q[2])
    np.testing.assert_allclose(next_use[3], 3 + L * (1 - ahead[3].astype(np.float64)) / q[3])
    assert (next_use[[0, 1, 4]] == -1.0).all()  # rows outside first..stop stay
    expect(next_use, ahead, following, 0, L, -1)
    np.testing.assert_allclose(next_use, layers + L * (1 - ahead.astype(np.float64)) / q)


def test_absorb_fills_the_cut_s_layers_and_the_next_token_s():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 3, E)).astype(np.float32)
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    fresh, ahead, following = (np.zeros((n, E), np.float32) for n in (3, L, L))
    next_use = np.zeros((L, E))
    c = L - 2  # one layer left in this token
    absorb(logits, np.arange(3), np.array([2]), c, fresh, ahead, following, next_use)
    np.testing.assert_allclose(fresh[0], 1 - np.prod(1 - probs[:, 0], axis=0), rtol=1e-5)
    np.testing.assert_allclose(fresh[2], probs[2, 2], rtol=1e-5)  # the next token: the last row alone
    assert np.array_equal(ahead[c + 1], fresh[0]) and not ahead[:c + 1].any()
    assert np.array_equal(following[c], fresh[2])
    assert next_use[c:].all() and not next_use[:c].any()


def test_numba_loads_only_when_a_default_state_runs():
    """Importing the policies (every CLI command does) must not load numba and LLVM."""
    code = ("import sys, moestream.policies, moestream.sim; assert 'numba' not in sys.modules, 'numba was imported'; "
            "from moestream.policies.default.state import compiled; compiled(); assert 'numba' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
