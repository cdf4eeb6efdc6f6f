"""One step across ranks: rank 0 schedules and announces each forward pass; the others run it too.

Before every forward pass, rank 0's `Leader` (the engine's `StepAnnouncer`) broadcasts a `StepMessage`; an idle
rank 0 sends a heartbeat every quarter of the transfer timeout, which every rank answers, so a hung or dead rank is
noticed. The others `follow`: they run the same pass over their copy of the batch's KV cache (`CacheMirror`) and
join each MoE layer's combine, until `Leader.close`. Rank 0 alone chooses tokens: followers know no batching rule."""

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
from moestream.runtime.scheduling.scheduler import ScheduledBatch

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


def broadcast(ranks: RankContext, message, what: str, group=None):
    """Rank 0's message on every rank (the others pass None), over `group` (default: the announcement group)."""
    box = [message]
    with ranks.collective(what):
        dist.broadcast_object_list(box, src=0, group=ranks.announce if group is None else group)
    return box[0]


def _answer_heartbeat(ranks: RankContext) -> None:
    with ranks.collective("a heartbeat"):
        dist.barrier(group=ranks.announce)


def _gather(engine, shard: ExpertShard) -> list[RankStats] | None:
    """Every rank's figures, in rank order, on rank 0 (None on the others)."""
    ranks, stats = shard.ranks, engine.store.stats()
    mine = RankStats(ranks.rank, stats.hits, stats.misses, dict(stats.bytes_read), shard.combine_s,
                     int(shard.owned.sum()))
    out = [None] * ranks.world_size if ranks.leads else None
    with ranks.collective("the gathering of statistics"):
        dist.gather_object(mine, out, dst=0, group=ranks.announce)
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
        self._send(STEP, "the announcement of a step", is_prefill=batch.is_prefill,
                   seqs=[self._update(s) for s in batch.seqs], cache_id=cache_id,
                   empty_kv=new and batch.cache.kv is not None, replay_paused=replay_paused)

    def idle(self) -> None:
        """Rank 0 has no step to run now: a heartbeat, every rank answering, if one is due."""
        if time.monotonic() - self._last_sent >= self._heartbeat_s:
            self._send(HEARTBEAT, "a heartbeat")
            _answer_heartbeat(self.shard.ranks)

    def ended(self, seq_id: int) -> None:
        self._ended.append(seq_id)
        self._sent.pop(seq_id, None)

    def reset_stats(self) -> None:
        self._reset = True
        self.shard.reset()

    def rank_stats(self) -> list[RankStats]:
        """Every rank's figures, in rank order."""
        self._send(STATS, "the request for statistics")
        return _gather(self.engine, self.shard)

    def close(self) -> None:
        """Tells the other ranks to return."""
        self._send(STOP, "the end of the run")

    def _send(self, kind: str, what: str, **fields) -> None:
        """Broadcasts a message of this kind, with the sequences ended and the statistics reset since the last."""
        message = StepMessage(kind, self._ended, self._reset, **fields)
        self._ended, self._reset = [], False
        broadcast(self.shard.ranks, message, what)
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


def follow(engine, shard: ExpertShard) -> None:
    """Runs rank 0's steps on this rank until rank 0 closes (a failed collective raises RankFailure)."""
    seqs: dict[int, Sequence] = {}
    mirror = CacheMirror(engine.config.device)
    handlers = {STATS: lambda message: _gather(engine, shard),
                HEARTBEAT: lambda message: _answer_heartbeat(shard.ranks),
                STEP: lambda message: _step(engine, message, [_mirrored(seqs, u) for u in message.seqs], mirror)}
    while (message := broadcast(shard.ranks, None, "the wait for rank 0's next step")).kind != STOP:
        for seq_id in message.ended:
            engine.end_sequence(seq_id)
            seqs.pop(seq_id, None)
            mirror.ended(seq_id)
        if message.reset_stats:
            engine.store.reset_stats()
            shard.reset()
        handlers[message.kind](message)


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
    with engine.replay.paused() if message.replay_paused and engine.replay is not None else contextlib.nullcontext():
        engine.forward(batch)
