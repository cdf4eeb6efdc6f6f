"""The compiled kernels against the numpy arithmetic they replace (one-hot products, unions, waits)."""

import subprocess
import sys

import numpy as np
import pytest
from scipy.special import expit

from moestream.policies.default import reuse
from moestream.policies.default.kernels import absorb, add_cut_recall, add_routed, expect, reuse_row, union_into, waits

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
    recall, share = steps[:, 0, :, None] * dense[2, 4 * E:5 * E], steps[:, 1, :, None] * dense[2, 5 * E:6 * E]
    start = dense[2, 2 * E:3 * E] + recall + share  # [T, E, U]: prev, recall and share at each expert
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


def random_reuse_state(rng) -> np.ndarray:
    state = reuse.initial_state(L, E)
    state[reuse.AGE] = rng.choice([0.0, 1.0, 3.0, 7.0, 40.0, reuse.NEVER], size=(L, E))
    state[reuse.FIRST_EMA:reuse.PASSED] = rng.uniform(size=(len(reuse.DECAYS), L, E))
    state[reuse.PASSED:] = rng.uniform(1.0, 20.0, size=(2, L, E))
    return state


def test_expect_waits_for_layers_ahead_and_for_the_next_token_at_the_layer_passed():
    rng = np.random.default_rng(2)
    ahead = rng.uniform(size=(L, E)).astype(np.float32)
    state = random_reuse_state(rng)
    next_use = np.full((L, E), -1.0)
    expect(next_use, ahead, state, 2, 4, 2)
    passed, later = state[reuse.PASSED], state[reuse.AHEAD]
    np.testing.assert_allclose(next_use[2], 2 + L * passed[2])  # only the next iterations can need it
    np.testing.assert_allclose(next_use[3], 3 + L * (1 - ahead[3].astype(np.float64)) * later[3])
    assert (next_use[[0, 1, 4]] == -1.0).all()  # rows outside first..stop stay
    expect(next_use, ahead, state, 0, L, -1)
    np.testing.assert_allclose(next_use, np.arange(L)[:, None] + L * (1 - ahead.astype(np.float64)) * later)


@pytest.mark.parametrize("survival", [(0.9, 0.8, 0.6, 0.2), (0.5, 0.5, 0.5, 0.5), (0.0, 0.0, 0.0, 0.0)])
def test_the_waits_sum_the_survival_up_to_the_last_horizon(survival):
    """The expected wait counted as 8 if later, sum(S(k), k < 8), S linear between the horizons; past an
    iteration that missed the expert, sum(S(k), 1 <= k < 8) / S(1)."""
    at = np.interp(np.arange(8), (0, *reuse.HORIZONS), (1.0, *survival))  # S(0) .. S(7)
    passed, ahead = waits(*survival)
    assert passed == pytest.approx(at.sum())
    assert ahead == pytest.approx(at[1:].sum() / max(survival[0], 1e-12))


def test_waits_grow_as_the_survival_does():
    low, high = waits(0.5, 0.3, 0.2, 0.1), waits(0.6, 0.5, 0.4, 0.35)
    assert low[0] < high[0] and low[1] < high[1]


def test_reuse_row_keeps_the_stream_s_inputs_and_turns_the_model_s_chances_into_waits():
    """reuse.inputs of the updated age and averages, the chances made non-decreasing over the horizons,
    kernels.waits of their survival; the other layers stay."""
    rng = np.random.default_rng(5)
    state = random_reuse_state(rng)
    weights = rng.normal(size=(L, len(reuse.HORIZONS), reuse.NUM_INPUTS)).astype(np.float32)
    logit = rng.normal(scale=5.0, size=E).astype(np.float32)  # some past the clip
    now, c = np.array([[1, 4], [4, 6]]), 2
    before = state.copy()
    reuse_row(state, weights, now, c, logit)
    used = np.isin(np.arange(E), now)
    decays = np.array(reuse.DECAYS)[:, None]
    np.testing.assert_array_equal(state[reuse.AGE, c], np.where(used, 0.0, before[reuse.AGE, c] + 1))
    ema = decays * before[reuse.FIRST_EMA:reuse.PASSED, c] + (1 - decays) * used
    np.testing.assert_allclose(state[reuse.FIRST_EMA:reuse.PASSED, c], ema)
    x = reuse.inputs(logit.astype(np.float64), state[reuse.AGE, c], ema)  # [E, F]
    survive = 1 - np.maximum.accumulate(expit(x @ weights[c].T.astype(np.float64)), axis=1)  # [E, H]
    want = np.array([waits(*row) for row in survive])  # [E, 2]
    np.testing.assert_allclose(state[reuse.PASSED:, c].T, want, rtol=1e-9)
    others = np.arange(L) != c
    np.testing.assert_array_equal(state[:, others], before[:, others])


def test_absorb_gives_the_reuse_state_the_logit_of_the_last_rows_union():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(3, 3, E)).astype(np.float32)
    fresh, ahead, following = (np.zeros((n, E), np.float32) for n in (3, L, L))
    state, weights = random_reuse_state(rng), rng.normal(size=(L, len(reuse.HORIZONS), reuse.NUM_INPUTS))
    want = state.copy()
    now, last = np.array([[0, 3], [5, 3], [2, 7]]), np.array([0, 2])
    absorb(logits, np.arange(3), last, 1, fresh, ahead, following, np.zeros((L, E)), now, state, weights)
    union = fresh[2].astype(np.float64)
    reuse_row(want, weights, now, 1, np.log(union) - np.log1p(-union))
    np.testing.assert_allclose(state, want, rtol=1e-5)


@pytest.mark.parametrize("c", [0, L - 2, L - 1])
def test_absorb_fills_the_cut_s_layers_and_the_next_token_s(c):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 3, E)).astype(np.float32)
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    fresh, ahead, following = (np.zeros((n, E), np.float32) for n in (3, L, L))
    ahead_before, following_before = rng.uniform(size=(2, L, E)).astype(np.float32)
    ahead[:], following[:] = ahead_before, following_before
    next_use, state = np.zeros((L, E)), random_reuse_state(rng)
    weights = rng.normal(size=(L, len(reuse.HORIZONS), reuse.NUM_INPUTS)).astype(np.float32)
    want_state = state.copy()
    now = np.array([[0, 3], [5, 3], [2, 7]])
    absorb(logits, np.arange(3), np.array([2]), c, fresh, ahead, following, next_use, now, state, weights)
    for bucket in (0, 1):  # every row's union
        np.testing.assert_allclose(fresh[bucket], 1 - np.prod(1 - probs[:, bucket], axis=0), rtol=1e-5)
    np.testing.assert_allclose(fresh[2], probs[2, 2], rtol=1e-5)  # the next token: the last row alone
    ahead_now = min(2, L - 1 - c)  # the layers of this token after c
    want_ahead, want_following = ahead_before.copy(), following_before.copy()
    want_ahead[c + 1:c + 1 + ahead_now], want_following[c] = fresh[:ahead_now], fresh[2]
    assert np.array_equal(ahead, want_ahead) and np.array_equal(following, want_following)
    reuse_row(want_state, weights, now, c, logits[2, 2])  # layer c's reuse, from the last row's next token
    np.testing.assert_array_equal(state, want_state)
    wait = (1 - want_ahead.astype(np.float64)) * state[reuse.AHEAD]
    wait[c] = state[reuse.PASSED, c]  # the layer just passed: only the next tokens can need it
    rows = slice(c, c + 1 + ahead_now)
    np.testing.assert_allclose(next_use[rows], np.arange(L)[rows, None] + L * wait[rows])
    assert not np.delete(next_use, np.arange(L)[rows], axis=0).any()  # the other rows stay


def reference_cut_recall(ring, count, now, shared, c, beta, window_recall, dense, n):
    """The numpy arithmetic the kernel replaced (state._cut_recall before it was compiled)."""
    from moestream.policies.default.features import recall_weights

    same = ring[c, :count] @ one_hot(now[None])[0]  # [count]
    weights = recall_weights(same + shared[:count], 1.0, beta)
    gain = np.einsum("i,die->de", weights, ring[c + 1:c + 1 + n, :count]) - window_recall[c + 1:c + 1 + n]
    return np.einsum("de,deu->du", gain, dense[:n, 4 * E:5 * E]), same


@pytest.mark.parametrize("count, n, now", [(3, 2, [1, 4]), (4, 1, [2, 2]), (0, 2, [0, 5])])
def test_cut_recall_weights_the_window_by_the_experts_shared(count, n, now):
    rng = np.random.default_rng(4)
    W = 4
    ring = (rng.uniform(size=(L, W, E)) < 0.3).astype(np.float32)  # [L, W, E]
    shared = rng.integers(0, 3, size=W).astype(np.float32)
    window_recall = rng.uniform(size=(L + 2, E)).astype(np.float32)
    dense = rng.normal(size=(3, 7 * E, U)).astype(np.float32)
    now, c = np.array(now), 1
    want, same = reference_cut_recall(ring, count, now, shared, c, 0.5, window_recall, dense, n)
    pre = np.zeros((n, U), np.float32)
    add_cut_recall(pre, ring, count, now, shared, c, 0.5, window_recall, dense)
    np.testing.assert_allclose(pre, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(shared[:count], same)  # each slot now holds what it shares at c


def test_kernels_compile_without_a_disk_cache_when_numba_has_nowhere_to_write_it(monkeypatch):
    import numba

    from moestream.policies.default import kernels

    real = numba.njit

    def njit(*args, **options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(*args, **options)

    monkeypatch.setattr(numba, "njit", njit)
    doubled = kernels._compile(lambda x: 2 * x)
    assert doubled(21) == 42 and hasattr(doubled, "signatures")  # a numba dispatcher, compiled in process


def test_numba_loads_only_when_a_default_state_runs():
    """Importing the policies (every CLI command does) must not load numba and LLVM."""
    code = ("import sys, moestream.policies, moestream.bench.sim; assert 'numba' not in sys.modules, 'numba was imported'; "
            "from moestream.policies.default.state import compiled; compiled(); assert 'numba' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


WARM_CHECK = """
import sys
from moestream.policies.default.policy import Default
from moestream.policies.default.state import compiled
from moestream.trace.format import load_trace
from moestream.bench.sim.replay import decode_stream, prefill

from moestream.cache import ExpertCache
from moestream.policies.driver import PolicyDriver
from moestream.bench.tools.overhead import LayerTimer

trace = load_trace(sys.argv[2])
policy = Default(trace.topology, predictor_dir=sys.argv[1])
# those state.py calls (union_into also inside absorb), the duel's and the eviction's
names = ("add_routed", "absorb", "expect", "add_cut_recall", "observe_one", "duel_observe", "largest", "refresh")
counts = [len(getattr(compiled(), name).signatures) for name in names]
assert min(counts) > 0, counts
eviction = policy.make_eviction("device")
driver = PolicyDriver(policy, [eviction])
timer = LayerTimer(driver, ExpertCache(trace.topology.total_experts // 2, eviction), trace.topology.num_layers)
for it in list(prefill(trace))[:2] + list(decode_stream(trace))[:30]:
    driver.run_iteration(it, timer)
assert [len(getattr(compiled(), name).signatures) for name in names] == counts, "compiled during a request"
"""


def test_a_loaded_default_has_compiled_what_prefill_and_decode_pass(policy, traces, tmp_path):
    from moestream.trace.format import save_trace

    policy.save(tmp_path / "default")
    save_trace(traces[1], tmp_path / "trace.npz")
    args = [sys.executable, "-c", WARM_CHECK, str(tmp_path / "default"), str(tmp_path / "trace.npz")]
    result = subprocess.run(args, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
