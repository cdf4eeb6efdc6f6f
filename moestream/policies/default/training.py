"""Offline training of the `default` policy's routing model (torch), exported as numpy weights.

The network is the one `model.RoutingWeights` runs online; every (token, target layer) of a
minibatch is a training example with its own horizon, drawn at random (see ModelConfig). `num_members`
networks, each initialised apart, learn side by side from the same minibatches (each from its own
loss) and are exported as one model that averages their logits. AdamW with a short warm-up and a
linear decay of the learning rate. Knows traces and tensors, not policies.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from moestream.policies.default.memory import TokenMemory
from moestream.policies.default.model import (
    NUM_POSITION_BUCKETS,
    UNKNOWN,
    ModelConfig,
    RoutingWeights,
    join_members,
    position_bucket,
    sequence_affinity,
    token_indices,
    token_keys,
    unit_rms,
)
from moestream.policies.default.channels import CHANNELS, Channel
from moestream.policies.default.recall import History, earlier_rows, first_rows, masks
from moestream.policies.routing_stats import previous_rows
from moestream.predictors.configs import TrainConfig
from moestream.predictors.training import multi_hot, seeded
from moestream.trace.schema import Trace

log = logging.getLogger(__name__)

WARMUP_STEPS = 200
HIDDEN_DISTANCES = 3  # the router-input path has its own output weights at distances 1, 2 and >= 3
MAX_EPOCH_FACTOR = 8  # a small trace trains for at most this many times the configured epochs


class RoutingNet(nn.Module):
    def __init__(self, num_layers: int, num_experts: int, vocab_size: int, config: ModelConfig, gate: bool,
                 hidden_size: int = 0):
        super().__init__()
        L, E, H = num_layers, num_experts, config.hidden_dim

        def param(*shape, scale=0.05):
            return nn.Parameter(torch.randn(*shape) * scale)

        self.prefix, self.previous = param(L, E, H), param(L * E, H)
        self.gate = param(L, E, H) if gate else None
        self.hidden_in = param(L, hidden_size, H) if hidden_size else None  # the router-input path
        self.hidden_out = param(L, HIDDEN_DISTANCES, H, E) if hidden_size else None
        self.token, self.position = param(vocab_size, H), param(NUM_POSITION_BUCKETS, H)
        self.recent = param(config.num_recent_layers, L, E, H) if config.num_recent_layers else None
        self.target, self.horizon = nn.Parameter(torch.zeros(L, H)), nn.Parameter(torch.zeros(L, H))
        self.norm = nn.LayerNorm(H)
        self.drop = nn.Dropout(config.dropout)
        self.out_w, self.out_b = param(L, H, E), nn.Parameter(torch.zeros(L, E))
        self.skip = nn.Parameter(torch.zeros(2, L, E))
        names = config.channels()  # the recall channels
        self.channel_in = nn.ParameterDict({name: param(L, E, H) for name in names})
        self.channel_skip = nn.ParameterDict({name: nn.Parameter(torch.zeros(L, E)) for name in names})

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hot = batch["hot"]  # [n, L, E]
        step = torch.einsum("nle,leh->nlh", hot, self.prefix)
        if self.gate is not None:
            step = step + torch.einsum("nle,leh->nlh", batch["gate"], self.gate)
        cut = batch["cut"]  # [n, L] last known layer, -1: none
        prefix = at_source(torch.cumsum(step, dim=1), cut)  # [n, L, H]
        prev_hot = batch["prev_hot"]  # [n, L, E]
        context = self.token[batch["token"]] + self.position[batch["bucket"]] + prev_hot.flatten(1) @ self.previous
        layers = torch.arange(hot.shape[1])
        z = prefix + context[:, None] + self.target[None] + self.horizon[layers[None] - cut - 1]
        if self.recent is not None:
            z = z + self._recent(hot, cut)
        channels = batch["channels"]  # name -> [n, L, E]
        for name, x in channels.items():
            z = z + torch.einsum("nle,leh->nlh", x, self.channel_in[name])
        h = self.drop(torch.relu(self.norm(z)))
        logits = torch.einsum("nlh,lhe->nle", h, self.out_w) + self.out_b
        if self.hidden_in is not None:
            logits = logits + self._hidden_path(batch["hidden"], cut)
        for name, x in channels.items():
            logits = logits + self.channel_skip[name] * x
        return logits + self.skip[0] * prev_hot + self.skip[1] * batch["affinity"]

    def _recent(self, hot: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
        """[n, L, H]: each target's latest known layers cut, cut-1, ... embedded again, from multi-hots [n, L, E]."""
        return sum(at_source(torch.einsum("nle,leh->nlh", hot, table), cut - i) for i, table in enumerate(self.recent))

    def _hidden_path(self, hidden: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
        """[n, L, E] from router inputs [n, L, D]: each target reads its last known layer's input (none: 0)."""
        act = torch.relu(torch.einsum("nld,ldh->nlh", hidden, self.hidden_in))  # [n, L, H]: each source layer's
        latest = at_source(act, cut)  # [n, L, H]
        by_distance = torch.einsum("nlh,ldhe->nlde", self.drop(latest), self.hidden_out)  # [n, L, D, E]
        distance = (torch.arange(cut.shape[1])[None] - cut).clamp(max=HIDDEN_DISTANCES) - 1  # [n, L]
        index = distance[:, :, None, None].expand(-1, -1, 1, by_distance.shape[-1])
        return by_distance.gather(2, index)[:, :, 0]

    def arrays(self) -> dict[str, np.ndarray]:
        num_layers, num_experts, hidden = self.prefix.shape
        gate = self.gate if self.gate is not None else torch.zeros(num_layers, num_experts, hidden)
        arrays = {
            "prefix": self.prefix, "gate": gate, "token": self.token, "position": self.position,
            "previous": self.previous, "target": self.target, "horizon": self.horizon,
            "norm_w": self.norm.weight, "norm_b": self.norm.bias, "out_w": self.out_w, "out_b": self.out_b,
            "skip": self.skip,
        }
        if self.hidden_in is not None:
            arrays |= {"hidden_in": self.hidden_in, "hidden_out": self.hidden_out}
        if self.recent is not None:
            arrays["recent"] = self.recent
        arrays |= {f"{name}_in": w for name, w in self.channel_in.items()}
        arrays |= {f"{name}_skip": w for name, w in self.channel_skip.items()}
        return {name: value.detach().numpy().copy() for name, value in arrays.items()}


def at_source(per_source: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """[n, L, H]: for each target, per_source [n, L, H] at its source layer [n, L]; zero where source < 0."""
    padded = torch.cat([torch.zeros_like(per_source[:, :1]), per_source], dim=1)  # source j at j + 1
    index = (source.clamp(min=-1) + 1)[:, :, None].expand(-1, -1, per_source.shape[-1])
    return padded.gather(1, index)


class Members(nn.Module):
    """Independently initialised RoutingNets that see the same minibatches; logits [M, n, L, E]."""

    def __init__(self, num_members: int, *args):
        super().__init__()
        self.members = nn.ModuleList(RoutingNet(*args) for _ in range(num_members))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.stack([member(batch) for member in self.members])

    def export(self, memory: TokenMemory | None) -> RoutingWeights:
        joined = join_members([member.arrays() for member in self.members])
        return RoutingWeights(joined | (memory.arrays() if memory is not None else {}))


class Batches:
    """Builds minibatch tensors from trace rows, with the horizon of every target drawn at random."""

    def __init__(self, trace: Trace, config: ModelConfig, vocab: dict, rng: np.random.Generator):
        self.trace, self.config, self.rng = trace, config, rng
        keys, _ = token_keys(trace)
        self.tokens = token_indices(keys, vocab) if keys is not None else np.zeros(trace.num_tokens, dtype=np.int64)
        self.buckets = position_bucket(trace.positions)
        self.prev = previous_rows(trace.seq_ids)
        self.affinity = sequence_affinity(trace)  # [N, L, E] float16
        self.earlier, self.valid = earlier_rows(first_rows(trace.seq_ids))  # [N, W]
        self.bit_sets = masks(trace.experts, trace.topology.num_experts)  # [N, L, words]
        self.num_experts = trace.topology.num_experts
        self.channels = {name: CHANNELS.create(name) for name in config.channels()}
        self.memory = None
        if config.use_memory:
            self.memory = TokenMemory.build(trace.experts, self.tokens, trace.seq_ids, len(vocab) + 1, config.memory_rows,
                                            rng, self.num_experts)

    def __call__(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        trace, num_layers = self.trace, self.trace.topology.num_layers
        prev = self.prev[rows]
        prev_hot = multi_hot(trace.experts[np.maximum(prev, 0)], self.num_experts) * torch.from_numpy(prev >= 0)[:, None, None]
        tokens = self.tokens[rows].copy()
        tokens[self.rng.random(len(rows)) < self.config.token_dropout] = UNKNOWN
        cuts = self._cuts(len(rows), num_layers)
        batch = {
            "hot": multi_hot(trace.experts[rows], self.num_experts),
            "prev_hot": prev_hot.float(),
            "token": torch.from_numpy(tokens),
            "bucket": torch.from_numpy(self.buckets[rows]),
            "affinity": torch.from_numpy(self.affinity[rows].astype(np.float32)),
            "cut": torch.from_numpy(cuts),
        }
        batch["channels"] = {name: torch.from_numpy(self._channel(channel, rows, tokens, cuts))
                             for name, channel in self.channels.items()}
        if trace.gate_probs is not None:
            batch["gate"] = torch.from_numpy(trace.gate_probs[rows].astype(np.float32))
        if trace.hidden is not None:
            batch["hidden"] = torch.from_numpy(unit_rms(trace.hidden[rows]))  # [n, L, D]
        return batch

    def _channel(self, channel: Channel, rows: np.ndarray, tokens: np.ndarray, cuts: np.ndarray) -> np.ndarray:
        """[n, L, E]: one recall channel of the rows, for their tokens as shown (a dropped token has no
        memory and no repeats); the memory leaves out the rows' own sequences."""
        history = History(self.bit_sets, self.trace.experts, self.tokens, self.earlier[rows], self.valid[rows])
        sources = channel.sources(history, self.memory, tokens, self.trace.seq_ids[rows])
        return sources.batch(self.bit_sets[rows], cuts, self.num_experts)

    def _cuts(self, num_rows: int, num_layers: int) -> np.ndarray:
        """[n, L]: the last known layer of each target: l-1 with probability next_layer_share, else uniform in [-1, l-1]."""
        layers = np.arange(num_layers)[None, :]
        uniform = (self.rng.random((num_rows, num_layers)) * (layers + 1)).astype(np.int64) - 1
        nearest = self.rng.random((num_rows, num_layers)) < self.config.next_layer_share
        return np.where(nearest, layers - 1, uniform)


def train_network(trace: Trace, config: ModelConfig, train: TrainConfig, vocab: dict) -> tuple[RoutingWeights, list[float]]:
    """Trains the members on every row of trace; their joined numpy weights and the mean loss of each epoch."""
    t = trace.topology
    if token_keys(trace)[0] is None:
        config = replace(config, use_memory=False, use_repeat=False)  # no token keys: no memory, no repeats
    with seeded(train.seed, train.num_threads):
        hidden_size = 0 if trace.hidden is None else trace.hidden.shape[-1]
        net = Members(config.num_members, t.num_layers, t.num_experts, len(vocab) + 1, config,
                      trace.gate_probs is not None, hidden_size)
        batches = Batches(trace, config, vocab, np.random.default_rng(train.seed))
        num_batches = max(1, -(-trace.num_tokens // train.batch_size))
        wanted = -(-config.min_train_steps // num_batches)
        num_epochs = max(train.num_epochs, min(wanted, MAX_EPOCH_FACTOR * train.num_epochs))
        losses = _loop(net, batches, trace.num_tokens, replace(train, num_epochs=num_epochs))
    return net.export(batches.memory), losses


def _loop(net: Members, batches: Batches, num_rows: int, train: TrainConfig) -> list[float]:
    optimizer = torch.optim.AdamW(net.parameters(), lr=train.learning_rate, weight_decay=train.weight_decay)
    rng = np.random.default_rng(train.seed)
    num_batches = max(1, -(-num_rows // train.batch_size))
    total_steps, step, losses = train.num_epochs * num_batches, 0, []
    warmup = min(WARMUP_STEPS, 1 + total_steps // 10)
    loss_fn = nn.BCEWithLogitsLoss()
    net.train()
    with tqdm(total=total_steps, desc="default", disable=not train.progress, unit="batch") as bar:
        for _ in range(train.num_epochs):
            total = 0.0
            for rows in np.array_split(rng.permutation(num_rows), num_batches):
                for group in optimizer.param_groups:
                    group["lr"] = train.learning_rate * min(1.0, (step + 1) / warmup) * (1.0 - step / total_steps)
                batch = batches(rows)
                logits = net(batch)  # [M, n, L, E]
                loss = loss_fn(logits, batch["hot"].expand_as(logits))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(rows)
                step += 1
                bar.update()
            losses.append(total / num_rows)
            log.info("default routing model: epoch %d loss %.4f", len(losses), losses[-1])
    net.eval()
    return losses
