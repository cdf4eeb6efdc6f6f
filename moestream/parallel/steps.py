"""One step across ranks: rank 0 schedules and announces each forward pass; the others run it too.

Rank 0's engine calls its `Leader` (the engine's `StepAnnouncer`) before every forward pass; the
Leader broadcasts a `StepMessage` (plain records: each row's sequence, the tokens it gained since the
last message, which sequences ended, whether the rank-0 cache is new) on the announcement group, whose
collectives time out after the transfer timeout. While rank 0 is idle (a server without requests calls
`idle`), the Leader sends a heartbeat when it has sent nothing for a quarter of that timeout: an empty
message that every rank answers (a barrier), so that a follower times out on a rank 0 that hangs or
died, and rank 0 on a follower, idle or busy. Every
other rank runs `follow`: it mirrors the sequences, runs the same forward pass over its own copy of
the batch's KV cache (`CacheMirror`), and joins each MoE layer's combine. Ended sequences end in the
followers' policies before the next step, as on rank 0. `Leader.close` sends the last message; a
follower returns then. Statistics of every rank are gathered on request (`Leader.rank_stats`).

The followers know no batching rule, request or sampler: rank 0 alone chooses tokens.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field

import torch.distributed as dist

from moestream.parallel.mirror import CacheMirror
from moestream.parallel.ranks import RankContext
from moestream.parallel.shard import ExpertShard
from moestream.runtime.runner import Sequence
from moestream.runtime.scheduler import ScheduledBatch

STEP, STATS, STOP, HEARTBEAT = "step", "stats", "stop", "heartbeat"
HEARTBEATS_PER_TIMEOUT = 4  # an idle rank 0 sends something at least this often per transfer timeout


@dataclass(frozen=True)
class SeqUpdate:
    seq_id: int
    prompt_ids: list[int] | None  # the first time a rank hears of the sequence
    new_ids: list[int]  # output tokens since the last message
    finished: bool


@dataclass(frozen=True)
class StepMessage:
    kind: str  # STEP, STATS, STOP or HEARTBEAT
    ended: list[int] = field(default_factory=list)  # sequences ended since the last message
    reset_stats: bool = False
    is_prefill: bool = False
    seqs: list[SeqUpdate] = field(default_factory=list)
    cache_id: int = 0  # rank 0's batch cache, numbered in order of first use
    empty_kv: bool = False  # a new cache starts with an empty KV (else the runner makes one)
    replay_paused: bool = False


@dataclass(frozen=True)
class RankStats:
    rank: int
    hits: int
    misses: int
    bytes_read: dict[str, int]
    combine_s: float
    owned_experts: int


def _broadcast(ranks: RankContext, message: StepMessage | None, what: str) -> StepMessage:
    box = [message]
    with ranks.collective(what):
        dist.broadcast_object_list(box, src=0, group=ranks.announce)
    return box[0]


def _answer_heartbeat(ranks: RankContext) -> None:
    with ranks.collective("a heartbeat"):
        dist.barrier(group=ranks.announce)


def rank_stats(engine, shard: ExpertShard) -> RankStats:
    stats = engine.store.stats()
    return RankStats(shard.ranks.rank, stats.hits, stats.misses, dict(stats.bytes_read), shard.combine_s,
                     int(shard.owned.sum()))


def _gather(engine, shard: ExpertShard) -> list[RankStats] | None:
    ranks = shard.ranks
    out = [None] * ranks.world_size if ranks.leads else None
    with ranks.collective("the gathering of statistics"):
        dist.gather_object(rank_stats(engine, shard), out, dst=0, group=ranks.announce)
    return out


class Leader:
    """Rank 0's announcer (runtime/sharding.py StepAnnouncer); `bind` it to its engine before use."""

    def __init__(self, shard: ExpertShard):
        self.shard = shard
        self.engine = None
        self._ended: list[int] = []
        self._reset = False
        self._sent: dict[int, int] = {}  # seq id -> output tokens announced
        self._cache_ids: dict[int, tuple[weakref.ref, int]] = {}  # id(cache) -> (the cache, its number)
        self._next_cache = 1
        self._heartbeat_s = shard.ranks.timeout_s / HEARTBEATS_PER_TIMEOUT
        self._last_sent = time.monotonic()

    def bind(self, engine) -> None:
        self.engine = engine

    def announce(self, batch: ScheduledBatch, replay_paused: bool) -> None:
        cache_id, new = self._cache_id(batch.cache)
        message = StepMessage(STEP, self._take_ended(), self._take_reset(), batch.is_prefill,
                              [self._update(s) for s in batch.seqs], cache_id,
                              new and batch.cache.kv is not None, replay_paused)
        self._send(message, "the announcement of a step")

    def idle(self) -> None:
        """Rank 0 has no step to run now: a heartbeat, every rank answering, if one is due."""
        if time.monotonic() - self._last_sent >= self._heartbeat_s:
            self._send(StepMessage(HEARTBEAT, self._take_ended(), self._take_reset()), "a heartbeat")
            _answer_heartbeat(self.shard.ranks)

    def ended(self, seq_id: int) -> None:
        self._ended.append(seq_id)
        self._sent.pop(seq_id, None)

    def reset_stats(self) -> None:
        self._reset = True
        self.shard.reset()

    def rank_stats(self) -> list[RankStats]:
        """Every rank's figures, in rank order."""
        self._send(StepMessage(STATS, self._take_ended(), self._take_reset()), "the request for statistics")
        return _gather(self.engine, self.shard)

    def close(self) -> None:
        """Tells the other ranks to return."""
        self._send(StepMessage(STOP), "the end of the run")

    def _send(self, message: StepMessage, what: str) -> None:
        _broadcast(self.shard.ranks, message, what)
        self._last_sent = time.monotonic()

    def _update(self, seq: Sequence) -> SeqUpdate:
        """What a follower needs of the row (a finished row of a static batch: all of it, every time)."""
        if seq.finished:
            return SeqUpdate(seq.seq_id, list(seq.prompt_ids), list(seq.output_ids), True)
        sent = self._sent.get(seq.seq_id)
        self._sent[seq.seq_id] = len(seq.output_ids)
        prompt = list(seq.prompt_ids) if sent is None else None
        return SeqUpdate(seq.seq_id, prompt, list(seq.output_ids[sent or 0:]), seq.finished)

    def _cache_id(self, cache) -> tuple[int, bool]:
        """The cache's number, and whether it is new."""
        entry = self._cache_ids.get(id(cache))
        if entry is not None and entry[0]() is cache:
            return entry[1], False
        self._cache_ids = {k: v for k, v in self._cache_ids.items() if v[0]() is not None}
        number, self._next_cache = self._next_cache, self._next_cache + 1
        self._cache_ids[id(cache)] = (weakref.ref(cache), number)
        return number, True

    def _take_ended(self) -> list[int]:
        ended, self._ended = self._ended, []
        return ended

    def _take_reset(self) -> bool:
        reset, self._reset = self._reset, False
        return reset


def follow(engine, shard: ExpertShard) -> None:
    """Runs rank 0's steps on this rank until rank 0 closes (a failed collective raises RankFailure)."""
    seqs: dict[int, Sequence] = {}
    mirror = CacheMirror(engine.config.device)
    while (message := _broadcast(shard.ranks, None, "the wait for rank 0's next step")).kind != STOP:
        for seq_id in message.ended:
            engine.end_sequence(seq_id)
            seqs.pop(seq_id, None)
            mirror.ended(seq_id)
        if message.reset_stats:
            engine.store.reset_stats()
            shard.reset()
        if message.kind == STATS:
            _gather(engine, shard)
        elif message.kind == HEARTBEAT:
            _answer_heartbeat(shard.ranks)
        else:
            _step(engine, message, [_mirrored(seqs, update) for update in message.seqs], mirror)


def _mirrored(seqs: dict[int, Sequence], update: SeqUpdate) -> Sequence:
    """The row's sequence on this rank (a finished one is not kept: it comes whole each time)."""
    if update.finished:
        seqs.pop(update.seq_id, None)
        return Sequence(update.seq_id, list(update.prompt_ids), output_ids=list(update.new_ids), finish_reason="ended")
    seq = seqs.get(update.seq_id)
    if seq is None:
        seq = seqs[update.seq_id] = Sequence(update.seq_id, list(update.prompt_ids or []))
    seq.output_ids.extend(update.new_ids)
    return seq


def _step(engine, message: StepMessage, seqs: list[Sequence], mirror: CacheMirror) -> None:
    """The announced forward pass, over this rank's copy of the batch's cache (the logits are rank 0's to use)."""
    batch = ScheduledBatch(message.is_prefill, seqs, mirror.cache(message, [s.seq_id for s in seqs]))
    paused = message.replay_paused and engine.replay is not None
    with engine.replay.paused() if paused else contextlib.nullcontext():
        engine.forward(batch)
