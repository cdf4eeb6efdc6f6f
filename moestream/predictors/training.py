"""The shared offline training loop of learned predictors: seeded, minibatched, with a progress bar.

It knows a model, a loss on a batch of row indices and a number of rows; nothing about routing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import numpy as np
import torch

from moestream.predictors.configs import TrainConfig
from moestream.predictors.paths import expert_mask
from moestream.progress import progress_bar
from moestream.threads import torch_threads

log = logging.getLogger(__name__)


@contextlib.contextmanager
def seeded(seed: int, num_threads: int = 1) -> Iterator[None]:
    """Torch's global generator seeded, and its intra-op threads set, inside the block; both restored after."""
    with torch.random.fork_rng(devices=[]), torch_threads(num_threads):
        torch.manual_seed(seed)
        yield


def train_loop(
    model: torch.nn.Module,
    batch_loss: Callable[[np.ndarray], torch.Tensor],
    num_rows: int,
    config: TrainConfig,
    desc: str,
) -> list[float]:
    """Trains model with AdamW on shuffled minibatches of rows; returns the mean loss of each epoch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    rng = np.random.default_rng(config.seed)
    num_batches = -(-num_rows // config.batch_size)
    losses: list[float] = []
    model.train()
    with progress_bar(total=config.num_epochs * num_batches, desc=desc, disable=not config.progress, unit="batch") as bar:
        for epoch in range(config.num_epochs):
            order = rng.permutation(num_rows)
            total = 0.0
            for batch in np.array_split(order, num_batches):
                loss = batch_loss(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(batch)
                bar.update()
            losses.append(total / num_rows)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            log.info("%s epoch %d loss %.4f", desc, epoch + 1, losses[-1])
    model.eval()
    return losses


def multi_hot(experts: np.ndarray, num_experts: int) -> torch.Tensor:
    """[B, L, K] expert ids -> [B, L, E] float 0/1 targets."""
    return torch.from_numpy(expert_mask(np.asarray(experts), num_experts).astype(np.float32))
