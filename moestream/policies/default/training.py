"""Training of the lean routing model: torch over the same `logits` the numpy path runs (every step a
minibatch of rows and every (target layer, bucket) pair, each row's token memory without the row itself;
binary cross-entropy); then reuse.py's model on its leave-one-out probabilities. torch is imported here only.
"""

from __future__ import annotations

import logging

import numpy as np

from moestream.policies.default import reuse
from moestream.policies.default.features import TokenMemory, TraceFeatures, memory_index
from moestream.policies.default.model import NUM_BLOCKS, START, DefaultConfig, DefaultWeights, logits
from moestream.predictors.configs import TrainConfig
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

TOKEN_DROPOUT = 0.1  # share of training rows whose token is shown as unknown
INIT_STD = 0.05  # initial spread of the hidden layer's weights
REUSE_ROWS = 6000  # rows of the trace the reuse model is fitted on (at most)
CHUNK_ROWS = 512  # rows whose probabilities the reuse model's training computes at once


def pairs(num_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(anchors, buckets, targets, cuts) [P] of every trained weight block."""
    rows = [(c, b, c + 1 + b, c) for b in (0, 1) for c in range(num_layers - 1 - b)]
    rows += [(l, START, l, -1) for l in range(num_layers)]
    return tuple(np.array(column) for column in zip(*rows))


def pair_features(features: TraceFeatures, cuts: np.ndarray, targets: np.ndarray, rows: np.ndarray,
                  recall: np.ndarray, memory: np.ndarray) -> np.ndarray:
    """[B, P, 7E] float32 inputs of the rows for every pair (recall [N, P, E]; memory [B, L, E])."""
    hot, E = features.hot, features.hot.shape[2]
    out = np.zeros((len(rows), len(cuts), NUM_BLOCKS * E), dtype=np.float32)
    own = hot[rows]  # [B, L, E]
    for block, shift in ((0, 0), (1, 1)):
        has = cuts - shift >= 0
        out[:, has, block * E:(block + 1) * E] = own[:, (cuts - shift)[has]]
    for block, before in ((2, features.prev[rows]), (3, features.prev2[rows])):
        out[:, :, block * E:(block + 1) * E] = hot[np.maximum(before, 0)][:, targets] & (before >= 0)[:, None, None]
    out[:, :, 4 * E:5 * E] = recall[rows]
    out[:, :, 5 * E:6 * E] = features.share[rows][:, targets]
    out[:, :, 6 * E:] = memory[:, targets]
    return out


def train_weights(trace: "Trace", tokens: np.ndarray, vocab_size: int, config: DefaultConfig,
                  train: TrainConfig) -> tuple[DefaultWeights, np.ndarray, np.ndarray, list[float]]:
    """Fits the model, then reuse.py's; returns the weights, the token memory, the reuse weights and losses."""
    import torch

    from moestream.progress import progress_bar
    torch.manual_seed(train.seed)
    torch.set_num_threads(train.num_threads)
    rng = np.random.default_rng(train.seed)
    L, E = trace.topology.num_layers, trace.topology.num_experts
    anchors, buckets, targets, cuts = pairs(L)
    features = TraceFeatures(trace, tokens, None, config.window_tokens, config.recall_beta, config.cut_recall)
    memory = TokenMemory(features.hot, tokens, features.prev, vocab_size)
    features.memory = memory.table()
    recall = np.zeros((trace.num_tokens, len(targets), E), np.float32)  # [N, P, E]
    for cut in np.unique(cuts).tolist():
        recall[:, cuts == cut] = features.recall_many(targets[cuts == cut].tolist(), cut)
    labels = features.hot[:, targets]  # [N, P, E]
    zeros = DefaultWeights.zeros(L, E, vocab_size, config.token_rank, config.hidden_units)
    weights = DefaultWeights(**{name: torch.zeros(a.shape, requires_grad=True) for name, a in zeros.arrays().items()})
    with torch.no_grad():
        weights.token.normal_(0.0, 0.1)
        if config.hidden_units:  # break the hidden units' symmetry
            weights.dense.normal_(0.0, INIT_STD)
            weights.out.normal_(0.0, INIT_STD)
    optimizer = torch.optim.AdamW(list(weights.arrays().values()), lr=train.learning_rate,
                                  weight_decay=train.weight_decay)
    index = (torch.from_numpy(anchors), torch.from_numpy(buckets))
    steps = -(-trace.num_tokens // train.batch_size)
    bar = progress_bar(total=train.num_epochs * steps, desc="default", unit="step", disable=not train.progress)
    losses = []
    for _ in range(train.num_epochs):
        total = 0.0
        for rows in np.array_split(rng.permutation(trace.num_tokens), steps):
            shown = np.where(rng.random(len(rows)) < TOKEN_DROPOUT, 0, tokens[rows])
            rows_read = memory_index(shown, features.before[rows], vocab_size)
            known = memory.without(features.hot[rows], rows_read)  # [B, L, E]
            x = torch.from_numpy(pair_features(features, cuts, targets, rows, recall, known))
            out = logits(weights, x, torch.from_numpy(shown[:, None]), index)  # [B, P, E]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(out, torch.from_numpy(labels[rows]).float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(rows)
            bar.update()
        losses.append(total / trace.num_tokens)
        log.info("default epoch %d: loss %.4f", len(losses), losses[-1])
    bar.close()
    trained = DefaultWeights(**{name: t.detach().numpy().copy() for name, t in weights.arrays().items()})
    starts = np.flatnonzero(buckets == START)
    reuse_weights = train_reuse(trained, features, memory, recall[:, starts], targets[starts], rng)
    return trained, features.memory, reuse_weights, losses


def train_reuse(weights: DefaultWeights, features: TraceFeatures, memory: TokenMemory, recall: np.ndarray,
                targets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """reuse.py's weights, fitted at up to REUSE_ROWS rows that a token of their sequence follows."""
    following = np.flatnonzero(features.prev >= 0)  # rows whose previous row is of their sequence
    chosen = np.sort(rng.choice(following, min(REUSE_ROWS, len(following)), replace=False))
    logit = np.concatenate([next_token_logits(weights, features, memory, recall, targets, chunk)
                            for chunk in np.array_split(chosen, max(1, -(-len(chosen) // CHUNK_ROWS)))])
    rows = features.prev[chosen]
    age, ema = reuse.stream_inputs(features.hot, rows)
    return reuse.fit(logit, age, ema, reuse.next_use_distance(features.hot, rows))


def next_token_logits(weights: DefaultWeights, features: TraceFeatures, memory: TokenMemory, recall: np.ndarray,
                      targets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[B, L, E]: the rows' START logits as the previous row's iteration predicts them, leave-one-out."""
    vocab_size = len(memory.counts)
    shown = np.zeros(len(rows), np.int64)
    known = memory.without(features.hot[rows], memory_index(shown, features.before[rows], vocab_size))
    cuts = np.full(len(targets), -1)
    x = pair_features(features, cuts, targets, rows, recall, known)
    return logits(weights, x, shown[:, None], (targets, np.full(len(targets), START)))
