"""The scheduler admits: at most max_seqs sequences not ended and their KV bytes (prompt + max_tokens
positions each) within the budget; a sequence without room queues in order and is admitted when
another ends; one that could never fit, or a budget that holds no sequence, is refused."""

import pytest
import torch

from moestream.runtime.runner import Sequence
from moestream.runtime.scheduling.scheduler import Admission, KvBudgetError, Scheduler, StaticBatches


def _logits(rows):
    return torch.zeros(rows, 10)  # argmax 0: no end-of-sequence token


def _scheduler(admission, ended, detach=lambda: None):
    return Scheduler(StaticBatches(4), {7}, ended.append, admission=admission, detach=detach)


def test_a_sequence_without_a_place_queues_and_is_admitted_when_another_ends():
    ended = []
    scheduler = _scheduler(Admission(max_seqs=2), ended)
    short, long, later = Sequence(0, [1], max_tokens=1), Sequence(1, [1], max_tokens=3), Sequence(2, [1], max_tokens=1)
    for seq in (short, long, later):
        scheduler.add(seq)
    assert scheduler.seqs == [short, long] and [s for s, _ in scheduler.queued] == [later]
    assert not scheduler.can_admit(1)
    scheduler.postprocess(scheduler.schedule(), _logits(2))  # the short one ends
    assert ended == [0] and scheduler.seqs == [long]
    batch = scheduler.schedule()  # admitted at the next step; the static batch still decodes the long one
    assert scheduler.queued == [] and scheduler.waiting == [later] and batch.seqs == [short, long]
    while (batch := scheduler.schedule()) is not None:
        scheduler.postprocess(batch, _logits(len(batch.seqs)))
    assert [len(s.output_ids) for s in (short, long, later)] == [1, 3, 1] and sorted(ended) == [0, 1, 2]


def test_the_kv_budget_reserves_prompt_and_max_tokens_and_refuses_what_never_fits():
    ended = []
    scheduler = _scheduler(Admission(kv_budget_bytes=100, bytes_per_token=10), ended)
    first, second = Sequence(0, [1, 2], max_tokens=4), Sequence(1, [3, 4], max_tokens=4)  # 60 bytes each
    scheduler.add(first)
    assert scheduler.reserved_bytes == 60 and scheduler.can_admit(4) and not scheduler.can_admit(5)
    with pytest.raises(KvBudgetError, match="needs 110 bytes of KV cache, over the budget of 100"):
        scheduler.add(Sequence(2, [1], max_tokens=10))
    scheduler.add(second)  # a place is free, the bytes are not
    assert scheduler.seqs == [first] and [s for s, _ in scheduler.queued] == [second]
    scheduler.finish(first, "abort")
    assert scheduler.reserved_bytes == 0
    scheduler.schedule()
    assert scheduler.seqs == [second] and scheduler.reserved_bytes == 60


def test_a_budget_that_holds_no_sequence_is_refused():
    with pytest.raises(KvBudgetError, match="holds no request"):
        Admission(kv_budget_bytes=19, bytes_per_token=10)


def test_close_ends_queued_and_admitted_sequences_and_stops_observing_once():
    ended, detached = [], []
    scheduler = _scheduler(Admission(max_seqs=1), ended, detach=lambda: detached.append(1))
    seqs = [Sequence(0, [1]), Sequence(1, [1])]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.close()
    scheduler.close()
    assert [s.finish_reason for s in seqs] == ["abort", "abort"] and sorted(ended) == [0, 1] and detached == [1]
    assert scheduler.seqs == [] and scheduler.queued == [] and scheduler.schedule() is None
