"""SamplingParams refuses bad values; sampling respects temperature, top-k, top-p and seeds."""

import pytest
import torch

from moestream.serving.sampling import BatchSampler, SamplingError, SamplingParams, sample_token, stop_index


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


class _Seq:
    def __init__(self, ids):
        self.output_ids, self.finished = ids, False


def test_batch_sampler_rows_follow_their_own_params():
    logits = torch.randn(2, 30, generator=_generator(0))  # [B, V]
    sampler = BatchSampler([SamplingParams(), SamplingParams(temperature=1.0, seed=3)], str)
    tokens = sampler.choose(logits, [_Seq([]), _Seq([])])
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == sample_token(logits[1], SamplingParams(temperature=1.0), _generator(3))


def test_stops_on_stop_string_length_and_cancel():
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731
    sampler = BatchSampler([SamplingParams(stop=("cd",), max_tokens=9), SamplingParams(max_tokens=2),
                            SamplingParams(max_tokens=9)], decode)
    assert not sampler.stops(0, _Seq([0, 2])) and sampler.stops(0, _Seq([0, 2, 3, 4]))
    assert sampler.finish_reason(0) == "stop" and sampler.text(0, [0, 2, 3, 4]) == "a"
    assert not sampler.stops(1, _Seq([0])) and sampler.stops(1, _Seq([0, 1]))
    assert sampler.finish_reason(1) == "length"
    sampler.cancel(2)
    assert sampler.stops(2, _Seq([0])) and sampler.finish_reason(2) == "abort"


def test_stop_index_is_the_earliest():
    assert stop_index("hello world", ("world", "lo")) == 3
    assert stop_index("hello", ("x",)) is None
