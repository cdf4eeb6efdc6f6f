"""The scheduler is the one place where tokens are chosen and sequences end: the sampler's reason
first, then max_tokens ("length"), then an end-of-sequence token ("stop"); a cancelled sequence ends
before the next step; a static batch keeps its ended rows until all have ended, then the next runs."""

import torch

from moestream.runtime.runner import Sequence
from moestream.runtime.scheduling.scheduler import Scheduler, StaticBatches

EOS = 7


class Sampler:
    def __init__(self, reason=None):
        self.reason, self.cancelled = reason, False

    def choose(self, logits):
        return int(logits.argmax())

    def stop_reason(self, output_ids):
        return "abort" if self.cancelled else self.reason


def _logits(*tokens):
    """[B, V] whose argmax of row r is tokens[r]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), 10).float()


def _scheduler(max_batch_size, ended):
    return Scheduler(StaticBatches(max_batch_size), {EOS}, ended.append)


def test_each_sequence_ends_once_for_its_first_reason():
    ended = []
    scheduler = _scheduler(4, ended)
    seqs = [Sequence(0, [1], max_tokens=2), Sequence(1, [1], max_tokens=1), Sequence(2, [1]),
            Sequence(3, [1], max_tokens=1, sampler=Sampler("stop"))]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.seqs == seqs
    assert scheduler.postprocess(batch, _logits(3, EOS, 4, 5)) == [3, EOS, 4, 5]
    assert [s.finish_reason for s in seqs] == [None, "length", None, "stop"]
    batch = scheduler.schedule()
    assert not batch.is_prefill and batch.seqs == seqs  # ended rows stay in a static batch
    assert scheduler.postprocess(batch, _logits(EOS, 1, EOS, 1)) == [EOS, None, EOS, None]
    assert [s.finish_reason for s in seqs] == ["length", "length", "stop", "stop"]
    assert sorted(ended) == [0, 1, 2, 3] and scheduler.schedule() is None
    assert [s.output_ids for s in seqs] == [[3, EOS], [EOS], [4, EOS], [5]]


def test_a_cancelled_sequence_ends_before_the_next_step_and_the_next_batch_waits():
    ended = []
    scheduler = _scheduler(2, ended)
    sampler = Sampler()
    first, second, later = Sequence(0, [1], sampler=sampler), Sequence(1, [1], max_tokens=2), Sequence(2, [1])
    for seq in (first, second, later):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second]
    scheduler.postprocess(batch, _logits(2, 2))
    sampler.cancelled = True
    batch = scheduler.schedule()
    assert first.finish_reason == "abort" and ended == [0] and batch.seqs == [first, second]
    assert scheduler.postprocess(batch, _logits(3, 3)) == [None, 3]
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.seqs == [later] and first.output_ids == [2]
