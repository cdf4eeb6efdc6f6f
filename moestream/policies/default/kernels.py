"""The compiled inner loops of `default`'s online state (numba): a routed layer's update in a few calls.

The same arithmetic as the numpy forms (up to float32 rounding: sums in another order, and
1 / (1 + exp(-x)) for scipy's expit) in one pass each: `add_routed` (the weight rows of the one-hot
routed blocks), `absorb` (probabilities, the batch's union, the expected next uses; `union_into` and
`expect` serve begin too) and `add_cut_recall` (a row's recall gain, features.recall_weights).
Compiled on first use and cached on disk. Knows arrays and the block order of the features
(model.NUM_BLOCKS), not events, caches or policies.
"""

from __future__ import annotations

import numba
import numpy as np

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
    """pre_t [3, U]: buckets 0 and 1 (c+1, c+2) gain the rows of `block` of dense_c [3, 7E, U] at each
    distinct expert of ids [k]."""
    offset = block * (dense_c.shape[1] // NUM_BLOCKS)
    for j in range(ids.shape[0]):
        if _first(ids, j):
            for u in range(pre_t.shape[1]):
                pre_t[0, u] += dense_c[0, offset + ids[j], u]
                pre_t[1, u] += dense_c[1, offset + ids[j], u]


@_compile
def add_routed(pre, dense_c, now, before, steps):
    """pre [T, 3, U] += the routed blocks' part, with dense_c [3, 7E, U] the weights of cut c:
    buckets 0 and 1 gain block 0 at the experts now [T, k] routed at c and block 1 at those before
    [T, k'] routed at c-1 (k' = 0 at the first layer); the next token's START bucket gains its prev
    (block 2), recall (block 4, x steps[t, 0]) and share (block 5, x steps[t, 1]) at now's experts."""
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
    """out [n, E] = the chance that at least one of `rows` of probs [T, n, E] needs each expert (rows
    independent; one row: its probability)."""
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
def expect(next_use, ahead, following, first, stop, passed):
    """next_use [L, E] of layers first..stop-1: l + L(1 - p)/q for a layer still ahead in this token,
    l + L/q for the layer `passed` (or none: -1), p = ahead[l], q = following[l] floored at 1e-4."""
    num_layers = next_use.shape[0]
    for layer in range(first, stop):
        for e in range(next_use.shape[1]):
            wait = 1.0 if layer == passed else 1.0 - np.float64(ahead[layer, e])
            next_use[layer, e] = layer + wait / np.float64(max(following[layer, e], np.float32(1e-4))) * num_layers


@_compile
def absorb(logits, every, last, c, fresh, ahead, following, next_use):
    """From the logits [T, 3, E] of cut c: fresh [3, E] = the union of every row's probabilities for
    buckets 0 and 1 (c+1, c+2) and of the `last` rows' for START (the next token's c); ahead[c+1],
    ahead[c+2] (below L) and following[c] take them, and `expect` renews next_use of rows c..c+2."""
    probs = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))  # [T, 3, E]
    union_into(fresh[:2], probs[:, :2], every)
    union_into(fresh[2:], probs[:, 2:], last)
    num_ahead = min(2, ahead.shape[0] - 1 - c)
    ahead[c + 1:c + 1 + num_ahead] = fresh[:num_ahead]
    following[c] = fresh[2]
    expect(next_use, ahead, following, c, c + 1 + num_ahead, c)


@_compile
def add_cut_recall(pre, ring, count, now, shared, c, beta, window_recall, dense_c):
    """pre [n, U] (buckets c+1 and c+2 below L of one row) += gain [n, E] @ the recall block (block
    4) of dense_c [3, 7E, U], gain = the recall at c+1.. weighted by exp(beta x experts shared at c
    and c-1) minus window_recall [L+2, E] (the window's mean). ring [L, W, E] holds the sequence's
    window, its first `count` slots filled; now [k] the row's experts at c; shared [W] what each
    slot shared with the row at c-1, replaced by what it shares at c."""
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
