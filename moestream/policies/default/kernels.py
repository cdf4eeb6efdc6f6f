"""The compiled inner loops of `default` (numba): a routed layer's update, the duel's ghosts and the
eviction's ranking. The same arithmetic as the numpy forms (up to float32 rounding: sums in another order,
and 1 / (1 + exp(-x)) for scipy's expit); `observe_one` runs add_routed, add_cut_recall and absorb for a
decode's one row in one call, in the same order. The duel's and the eviction's kernels decide exactly as
the Python they replaced (tests/policies/default/test_decision_path.py). Compiled on first use, cached on
disk. Knows arrays, the features' block order and reuse.py's inputs, not events, caches or policies.
"""

from __future__ import annotations

import numba
import numpy as np

from moestream.policies.default import reuse
from moestream.policies.default.model import NUM_BLOCKS

CUR, BEFORE, PREV, RECALL, SHARE = 0, 1, 2, 4, 5  # blocks of the features (model.py), each E rows of dense


def _compile(function):
    """numba.njit, cached on disk where numba finds a writable place (else compiled in each process)."""
    try:
        return numba.njit(cache=True)(function)
    except RuntimeError:  # numba's "no locator available": a read-only install without a cache directory
        return numba.njit(function)


@_compile
def _first(ids, j):
    """Whether ids[j] does not occur before j (a row's repeated expert is one one-hot entry)."""
    for i in range(j):
        if ids[i] == ids[j]:
            return False
    return True


@_compile
def _add_block(pre_t, dense_c, ids, block):
    """pre_t [3, U]: buckets 0 and 1 gain the rows of `block` of dense_c [3, 7E, U] at each distinct ids [k]."""
    offset = block * (dense_c.shape[1] // NUM_BLOCKS)
    for j in range(ids.shape[0]):
        if _first(ids, j):
            for u in range(pre_t.shape[1]):
                pre_t[0, u] += dense_c[0, offset + ids[j], u]
                pre_t[1, u] += dense_c[1, offset + ids[j], u]


@_compile
def add_routed(pre, dense_c, now, before, steps):
    """pre [T, 3, U] += the routed blocks' part (dense_c [3, 7E, U]: cut c's weights): buckets 0 and 1 gain
    block 0 at now [T, k] (routed at c) and block 1 at before [T, k'] (at c-1); START gains prev, recall
    (x steps[t, 0]) and share (x steps[t, 1]) at now's experts."""
    num_experts = dense_c.shape[1] // NUM_BLOCKS
    for t in range(pre.shape[0]):
        _add_block(pre[t], dense_c, now[t], CUR)
        _add_block(pre[t], dense_c, before[t], BEFORE)
        recall_step, share_step = steps[t, 0, 0], steps[t, 1, 0]
        for j in range(now.shape[1]):
            e = now[t, j]
            if _first(now[t], j):
                for u in range(pre.shape[2]):
                    pre[t, 2, u] += (dense_c[2, PREV * num_experts + e, u]
                                     + recall_step * dense_c[2, RECALL * num_experts + e, u]
                                     + share_step * dense_c[2, SHARE * num_experts + e, u])


@_compile
def union_into(out, probs, rows):
    """out [n, E] = the chance that at least one of `rows` of probs [T, n, E] needs each expert."""
    for b in range(out.shape[0]):
        for e in range(out.shape[1]):
            if len(rows) == 1:
                out[b, e] = probs[rows[0], b, e]
                continue
            missed = np.float32(1.0)
            for t in rows:
                missed *= np.float32(1.0) - probs[t, b, e]
            out[b, e] = np.float32(1.0) - missed


@_compile
def expect(next_use, ahead, state, first, stop, passed):
    """next_use [L, E] of layers first..stop-1: l + L x the wait in iterations from the reuse state: its
    PASSED wait at layer `passed` (-1: none), else (1 - ahead[l]) x its AHEAD wait."""
    num_layers = next_use.shape[0]
    for layer in range(first, stop):
        for e in range(next_use.shape[1]):
            if layer == passed:
                wait = state[reuse.PASSED, layer, e]
            else:
                wait = (1.0 - np.float64(ahead[layer, e])) * state[reuse.AHEAD, layer, e]
            next_use[layer, e] = layer + wait * num_layers


AGE_EDGES, DECAYS = np.array(reuse.AGE_EDGES, np.float64), np.array(reuse.DECAYS)
FIRST_AVERAGE = 1 + len(reuse.AGE_EDGES)  # the averages among reuse.inputs


@_compile
def waits(s1, s2, s4, s8):
    """(passed, ahead) in iterations from the survival at reuse.HORIZONS: the expected wait to the next use
    (capped at 8, the survival linear between the horizons), and the same given no use next iteration."""
    passed = 1.0 + s1 + 1.5 * s2 + 3.0 * s4 + 1.5 * s8
    return passed, (passed - 1.0) / max(s1, 1e-12)


@_compile
def reuse_row(state, weights, now, c, logit):
    """The reuse state at layer c once now [T, k] routed there: ages and averages take the use; PASSED and
    AHEAD the `waits` of the chances weights[c] [H, F] give from reuse.inputs (logit [E]: the next token's)."""
    num_experts, edges = state.shape[2], AGE_EDGES.shape[0]
    used = np.zeros(num_experts, np.bool_)
    for t in range(now.shape[0]):
        for j in range(now.shape[1]):
            used[now[t, j]] = True
    w, averages, survive = weights[c], np.empty(DECAYS.shape[0]), np.empty(weights.shape[1])
    for e in range(num_experts):
        age = 0.0 if used[e] else state[reuse.AGE, c, e] + 1.0
        state[reuse.AGE, c, e] = age
        bucket = 0
        while bucket + 1 < edges and age >= AGE_EDGES[bucket + 1]:
            bucket += 1
        for d in range(DECAYS.shape[0]):
            averages[d] = DECAYS[d] * state[reuse.FIRST_EMA + d, c, e] + (1.0 - DECAYS[d]) * used[e]
            state[reuse.FIRST_EMA + d, c, e] = averages[d]
        clipped, chance = min(max(np.float64(logit[e]), -reuse.LOGIT_LIMIT), reuse.LOGIT_LIMIT), 0.0
        for h in range(w.shape[0]):
            z = w[h, 0] * clipped + w[h, 1 + bucket]
            for d in range(DECAYS.shape[0]):
                z += w[h, FIRST_AVERAGE + d] * averages[d]
            chance = max(chance, 1.0 / (1.0 + np.exp(-z)))
            survive[h] = 1.0 - chance
        state[reuse.PASSED, c, e], state[reuse.AHEAD, c, e] = waits(survive[0], survive[1], survive[2], survive[3])


@_compile
def absorb(logits, every, last, c, fresh, ahead, following, next_use, now, state, weights):
    """From cut c's logits [T, 3, E]: fresh [3, E] = the union over every row of buckets 0, 1 and over the
    `last` rows of START; ahead[c+1..c+2] and following[c] take them; reuse_row takes layer c and `expect`
    renews next_use of rows c..c+2."""
    probs = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))  # [T, 3, E]
    union_into(fresh[:2], probs[:, :2], every)
    union_into(fresh[2:], probs[:, 2:], last)
    num_ahead = min(2, ahead.shape[0] - 1 - c)
    ahead[c + 1:c + 1 + num_ahead] = fresh[:num_ahead]
    following[c] = fresh[2]
    if last.shape[0] == 1:
        logit = logits[last[0], 2]
    else:  # the union's, kept inside (0, 1)
        union = np.minimum(np.maximum(fresh[2], np.float32(1e-30)), np.float32(1.0 - 1e-7))
        logit = np.log(union) - np.log1p(-union)
    reuse_row(state, weights, now, c, logit)
    expect(next_use, ahead, state, c, c + 1 + num_ahead, c)


@_compile
def add_cut_recall(pre, ring, count, now, shared, c, beta, window_recall, dense_c):
    """pre [n, U] (one row's buckets c+1, c+2) += gain [n, E] @ dense_c's recall block, gain = the window's
    recall weighted by exp(beta x experts shared at c and c-1) minus window_recall [L+2, E]. ring [L, W, E]:
    the window, `count` slots filled; now [k]: the row's experts at c; shared [W]: shared at c-1, then c."""
    num_experts, total = ring.shape[2], np.float32(0.0)
    weights = np.empty(count, np.float32)
    for i in range(count):
        same = np.float32(0.0)
        for j in range(now.shape[0]):
            if _first(now, j):
                same += ring[c, i, now[j]]
        weights[i] = np.exp(np.float32(beta) * (same + shared[i]))
        shared[i] = same
        total += weights[i]
    weights /= max(total, np.float32(1e-12))
    gain = np.empty(num_experts, np.float32)
    for d in range(pre.shape[0]):
        for e in range(num_experts):
            gain[e] = -window_recall[c + 1 + d, e]
        for i in range(count):
            for e in range(num_experts):
                gain[e] += weights[i] * ring[c + 1 + d, i, e]
        for e in range(num_experts):
            for u in range(pre.shape[1]):
                pre[d, u] += gain[e] * dense_c[d, RECALL * num_experts + e, u]


@_compile
def observe_one(routed, pre, fixed, dense, now, before, steps, c, ring, count, shared, beta, window_recall, every,
                last, fresh, ahead, following, next_use, state, weights):
    """IterationState.observe of layer c in one call (one row, linear model, cut recall): the same
    arithmetic, in the same order, as marking routed, add_routed, add_cut_recall and absorb one by one."""
    for j in range(now.shape[1]):
        routed[0, c, now[0, j]] = 1.0
    pre[:] = fixed[c]
    add_routed(pre, dense[c], now, before, steps)
    num_ahead = min(2, ahead.shape[0] - 1 - c)
    add_cut_recall(pre[0, :num_ahead], ring, count, now[0], shared[0], c, beta, window_recall[0], dense[c])
    absorb(pre, every, last, c, fresh, ahead, following, next_use, now, state, weights)


@_compile
def refresh(masked, table, first, stop):
    """masked [L, E] = table at its entries above -inf (the residents), in rows first..stop-1 (below L)."""
    for layer in range(first, min(stop, masked.shape[0])):
        for e in range(masked.shape[1]):
            if masked[layer, e] > -np.inf:
                masked[layer, e] = table[layer, e]


@_compile
def largest(values, out):
    """Fills out [m] with the indices of the m largest values above -inf, largest first, the smaller index
    first among equals (repeated argmaxes' order); returns how many it found."""
    size, count = out.shape[0], 0
    for i in range(values.shape[0]):
        value = values[i]
        if not value > -np.inf or (count == size and not value > values[out[size - 1]]):
            continue
        slot = min(count, size - 1)
        while slot > 0 and values[out[slot - 1]] < value:
            out[slot] = out[slot - 1]
            slot -= 1
        out[slot] = i
        count = min(count + 1, size)
    return count


# The duel's ghosts in one int64 array [6, max(L*E + 1, 8)], by row: the LRU ghost as a ring through the
# sentinel L*E, least recent first (previous -1: not held); the model ghost's residents (the first MODEL_SIZE),
# each one's place there, whether each is held; and the counters (the window's hits, lookups and next slot).
LRU_BEFORE, LRU_AFTER, MEMBERS, POSITION, HELD, COUNTS = range(6)  # (BEFORE is a block above)
CAPACITY, MODEL_SIZE, LRU_SIZE, MODEL_HITS, LRU_HITS, KEPT, SLOT, TOP_K = range(8)


def _inline(function):
    """A kernel's helper, compiled into each caller (no call: arrays passed to a call cost a reference count)."""
    return numba.njit(inline="always")(function)


@_inline
def _evicted_first(wait, index, other_wait, other_index):
    """Whether the model ghost evicts (wait, index) before the other: numpy's argmax order over the
    waits (a NaN first, then the largest, the smaller flat index among equals)."""
    if np.isnan(wait):
        return not np.isnan(other_wait) or index < other_index
    if np.isnan(other_wait):
        return False
    return wait > other_wait or (wait == other_wait and index < other_index)


@_inline
def _queue(order, waits, first, slot, wait, index):
    """Puts (wait, index) at order/waits[slot] in eviction order (from first on), shifting later ones down."""
    while slot > first and _evicted_first(wait, index, waits[slot - 1], order[slot - 1]):
        order[slot], waits[slot] = order[slot - 1], waits[slot - 1]
        slot -= 1
    order[slot], waits[slot] = index, wait


@_inline
def _take_model(ghosts, index, wait, order, waits, first, end):
    """(held, first, end): whether the model ghost held flat index; it holds it now, evicting the first of
    the queue order/waits[first:end] (empty: it does not take it), which it joins unless its wait is -inf."""
    members, position, held, counts = ghosts[MEMBERS], ghosts[POSITION], ghosts[HELD], ghosts[COUNTS]
    if held[index]:
        return True, first, end
    size = counts[MODEL_SIZE]
    if size >= counts[CAPACITY]:
        if first == end:
            return False, first, end
        victim, last = order[first], members[size - 1]
        first += 1
        members[position[victim]], position[last] = last, position[victim]
        held[victim] = 0
        size -= 1
    held[index], members[size], position[index] = 1, index, size
    counts[MODEL_SIZE] = size + 1
    if wait != -np.inf:
        _queue(order, waits, first, end, wait, index)
        end += 1
    return False, first, end


@_inline
def _look_lru(ghosts, index, sentinel):
    """Whether the LRU ghost held flat index; now the most recent, the least recent leaving past capacity."""
    before, after, counts = ghosts[LRU_BEFORE], ghosts[LRU_AFTER], ghosts[COUNTS]
    hit = before[index] >= 0
    if hit:
        after[before[index]], before[after[index]] = after[index], before[index]
    else:
        counts[LRU_SIZE] += 1
    last = before[sentinel]
    before[index], after[index], after[last], before[sentinel] = last, sentinel, index, index
    if counts[LRU_SIZE] > counts[CAPACITY]:
        oldest = after[sentinel]
        after[sentinel], before[after[oldest]], before[oldest] = after[oldest], sentinel, -1
        counts[LRU_SIZE] -= 1
    return hit


@_inline
def _count(outcomes, counts, model_hit, lru_hit):
    """Adds one lookup's hits to the window outcomes [W] (a ring: bit 0 the model's, bit 1 LRU's)."""
    slot = counts[SLOT]
    if counts[KEPT] == outcomes.shape[0]:
        counts[MODEL_HITS] -= outcomes[slot] & 1
        counts[LRU_HITS] -= outcomes[slot] >> 1
    else:
        counts[KEPT] += 1
    outcomes[slot] = np.uint8(model_hit) + 2 * np.uint8(lru_hit)
    counts[MODEL_HITS] += np.int64(model_hit)
    counts[LRU_HITS] += np.int64(lru_hit)
    counts[SLOT] = (slot + 1) % outcomes.shape[0]


@_compile
def duel_observe(ghosts, outcomes, table, layer, routed, probs):
    """One layer of the duel on ghosts and outcomes [W]: each distinct expert of routed [T, k], smallest
    first, is looked up in both ghosts and counted; then the model ghost takes the top_k of probs [E]
    (layer + 1's; empty: none), most probable first. It evicts the latest next use in table [L, E] (smaller
    flat index on a tie), never one routed at `layer`. Returns whether the window is full and LRU hit more."""
    counts, num_experts, flat = ghosts[COUNTS], table.shape[1], table.reshape(table.size)
    first, chosen = layer * num_experts, np.zeros(num_experts, np.bool_)
    for t in range(routed.shape[0]):
        for j in range(routed.shape[1]):
            chosen[routed[t, j]] = True
    num_expected = min(counts[TOP_K], probs.shape[0])
    evictions = num_expected + np.sum(chosen)  # at most one per lookup
    order, waits = np.empty(evictions + num_expected, np.int64), np.empty(evictions + num_expected)
    members, end = ghosts[MEMBERS], 0
    for i in range(counts[MODEL_SIZE] if evictions else 0):
        index = members[i]
        if first <= index < first + num_experts and chosen[index - first]:
            continue  # never one of the layer's own experts
        wait = np.float64(flat[index])
        if wait == -np.inf or (end == evictions and not _evicted_first(wait, index, waits[end - 1], order[end - 1])):
            continue
        _queue(order, waits, 0, min(end, evictions - 1), wait, index)
        end = min(end + 1, evictions)
    start = 0
    for e in range(num_experts):
        if chosen[e]:
            hit, start, end = _take_model(ghosts, first + e, -np.inf, order, waits, start, end)
            _count(outcomes, counts, hit, _look_lru(ghosts, first + e, table.size))
    chosen[:] = False
    for _ in range(num_expected):
        best = -1
        for e in range(num_experts):
            p = probs[e]  # the first in a stable sort by -probability, NaN last
            if not chosen[e] and (best < 0 or (not np.isnan(p) and (np.isnan(probs[best]) or p > probs[best]))):
                best = e
        chosen[best] = True
        index = first + num_experts + best
        _, start, end = _take_model(ghosts, index, np.float64(flat[index]), order, waits, start, end)
    return counts[KEPT] == outcomes.shape[0] and counts[LRU_HITS] > counts[MODEL_HITS]
