"""Reuse distance for `default`'s eviction: per (layer, expert), the chance of a use within the next 1, 2,
4 and 8 iterations, and the expected wait to the next use that follows from them.

Per (layer, horizon), a logistic model over one expert's inputs at a layer just routed (`inputs`): the
routing model's logit for the next token, the iterations since its last use there (one-hot over AGE_EDGES)
and its use averaged over the stream (whichever sequence routed) at each of DECAYS. The online state turns
the chances into expected waits (kernels.reuse_row, kernels.waits); `fit` trains it by Newton steps.
Knows arrays, not events, caches or the routing model's weights.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

HORIZONS = (1, 2, 4, 8)  # iterations ahead: the chance of a use within each
AGE_EDGES = (0, 1, 2, 3, 5, 9, 17)  # first age of each bucket of iterations since the last use
DECAYS = (0.5, 0.8, 0.95)  # of the stream's averages of each expert's use
NUM_INPUTS = 1 + len(AGE_EDGES) + len(DECAYS)  # the logit, the age buckets, the averages
NEVER = float(1 << 20)  # the age of an expert not routed yet
LOGIT_LIMIT = 9.0  # the routing model's logit is clipped to [-limit, limit]
AGE, FIRST_EMA = 0, 1  # rows of the online state (kernels.reuse_row): the age, then one average per decay
PASSED, AHEAD = FIRST_EMA + len(DECAYS), FIRST_EMA + len(DECAYS) + 1  # then the expected waits (below)
NUM_ROWS = AHEAD + 1


def initial_state(num_layers: int, num_experts: int) -> np.ndarray:
    """[NUM_ROWS, L, E] float64: nothing routed yet, each wait one iteration until a layer is routed."""
    state = np.zeros((NUM_ROWS, num_layers, num_experts))
    state[AGE], state[PASSED], state[AHEAD] = NEVER, 1.0, 1.0
    return state


def inputs(logit: np.ndarray, age: np.ndarray, ema: np.ndarray) -> np.ndarray:
    """[..., NUM_INPUTS] float64 from logit [...], age [...] and ema [D, ...] (the averages at DECAYS)."""
    bucket = np.searchsorted(np.array(AGE_EDGES), age, side="right") - 1
    ages = (bucket[..., None] == np.arange(len(AGE_EDGES))).astype(np.float64)
    averages = np.moveaxis(ema, 0, -1).astype(np.float64)
    return np.concatenate([np.clip(logit, -LOGIT_LIMIT, LOGIT_LIMIT)[..., None], ages, averages], axis=-1)


def stream_inputs(hot: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """age [B, L, E] and ema [D, B, L, E] in the stream hot [N, L, E] once each of rows (sorted) routed."""
    age, ema = np.full(hot.shape[1:], NEVER), np.zeros((len(DECAYS), *hot.shape[1:]))
    ages = np.zeros((len(rows), *hot.shape[1:]), np.float32)
    emas, taken = np.zeros((len(DECAYS), len(rows), *hot.shape[1:]), np.float32), 0
    decays = np.array(DECAYS)[:, None, None]
    for t in range(rows[-1] + 1 if len(rows) else 0):
        age = np.where(hot[t], 0.0, age + 1.0)
        ema = decays * ema + (1.0 - decays) * hot[t]
        if rows[taken] == t:
            ages[taken], emas[:, taken], taken = age, ema, taken + 1
    return ages, emas


def next_use_distance(hot: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[B, L, E] int: the iterations from each of rows to the expert's next use in hot [N, L, E]."""
    following = np.full(hot.shape[1:], len(hot) + HORIZONS[-1] + 1)
    out, wanted = np.zeros((len(rows), *hot.shape[1:]), np.int64), {row: i for i, row in enumerate(rows.tolist())}
    for t in range(len(hot) - 1, -1, -1):
        if t in wanted:
            out[wanted[t]] = following - t
        following = np.where(hot[t], t, following)
    return out


def fit(logit: np.ndarray, age: np.ndarray, ema: np.ndarray, distance: np.ndarray, iterations: int = 10,
        ridge: float = 1e-3) -> np.ndarray:
    """weights [L, H, F] float32: one ridge logistic regression per (layer, horizon) of a use within it
    (distance [B, L, E]) on the `inputs` (logit, age [B, L, E], ema [D, B, L, E])."""
    L = logit.shape[1]
    weights = np.zeros((L, len(HORIZONS), NUM_INPUTS))
    for layer in range(L):
        x = inputs(logit[:, layer].astype(np.float64), age[:, layer], ema[:, :, layer]).reshape(-1, NUM_INPUTS)
        for h, horizon in enumerate(HORIZONS):
            weights[layer, h] = _logistic(x, (distance[:, layer] <= horizon).ravel(), iterations, ridge)
    return weights.astype(np.float32)


def _logistic(x: np.ndarray, y: np.ndarray, iterations: int, ridge: float) -> np.ndarray:
    w = np.zeros(x.shape[1])
    for _ in range(iterations):
        p = expit(x @ w)
        gradient = x.T @ (p - y) / len(y) + ridge * w
        hessian = (x * (p * (1.0 - p))[:, None]).T @ x / len(y) + ridge * np.eye(len(w))
        w -= np.linalg.solve(hessian, gradient)
    return w
