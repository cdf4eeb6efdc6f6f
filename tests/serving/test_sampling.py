"""SamplingParams refuses bad values; sampling respects temperature, top-k, top-p and seeds."""

import pytest
import torch

from moestream.serving.sampling import SamplingError, SamplingParams, SequenceSampler, sample_token, stop_index


@pytest.mark.parametrize("fields", [
    {"max_tokens": 0}, {"max_tokens": 1.5}, {"temperature": -0.1}, {"temperature": float("nan")},
    {"temperature": 1000}, {"top_p": 0}, {"top_p": 1.2}, {"top_k": -1}, {"seed": -3},
    {"stop": [""]}, {"stop": [3]}, {"stop": ["x"] * 17}, {"max_tokens": True},
])
def test_bad_params_are_refused(fields):
    with pytest.raises(SamplingError):
        SamplingParams(**fields)


def test_a_single_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def test_top_k_one_and_tiny_top_p_pick_the_argmax():
    logits = torch.randn(50, generator=_generator(1))
    best = int(logits.argmax())
    for seed in range(10):
        assert sample_token(logits, SamplingParams(temperature=5.0, top_k=1), _generator(seed)) == best
        assert sample_token(logits, SamplingParams(temperature=5.0, top_p=1e-6), _generator(seed)) == best


def test_top_k_keeps_the_k_most_likely():
    logits = torch.arange(20, dtype=torch.float)
    drawn = {sample_token(logits, SamplingParams(temperature=100.0, top_k=3), _generator(s)) for s in range(200)}
    assert drawn == {17, 18, 19}


def test_the_same_seed_draws_the_same_tokens():
    logits = torch.zeros(100)
    params = SamplingParams(temperature=1.0)
    first = [sample_token(logits, params, _generator(7)) for _ in range(5)]
    assert first == [sample_token(logits, params, _generator(7)) for _ in range(5)]
    assert len({sample_token(logits, params, _generator(s)) for s in range(20)}) > 3


def test_each_sequence_follows_its_own_params():
    logits = torch.randn(2, 30, generator=_generator(0))  # [B, V]
    greedy, sampled = SequenceSampler(SamplingParams(), str), SequenceSampler(SamplingParams(temperature=1.0, seed=3), str)
    assert greedy.choose(logits[0]) == int(logits[0].argmax())
    assert sampled.choose(logits[1]) == sample_token(logits[1], SamplingParams(temperature=1.0), _generator(3))


def test_stops_on_a_stop_string_and_cancel():
    """max_tokens and EOS end a sequence in the scheduler (tests/runtime/test_scheduler.py)."""
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731
    stopping, other = SequenceSampler(SamplingParams(stop=("cd",), max_tokens=9), decode), \
        SequenceSampler(SamplingParams(max_tokens=9), decode)
    assert stopping.stop_reason([0, 2]) is None and stopping.stop_reason([0, 2, 3, 4]) == "stop"
    assert stopping.text([0, 2, 3, 4]) == "a"
    assert other.stop_reason([0]) is None and not other.cancelled
    other.cancel()
    assert other.cancelled and other.stop_reason([0]) == "abort"


def test_stop_index_is_the_earliest():
    assert stop_index("hello world", ("world", "lo")) == 3
    assert stop_index("hello", ("x",)) is None
