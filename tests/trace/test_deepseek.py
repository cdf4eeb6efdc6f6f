"""The DeepSeek routing npz importer and its tokens jsonl."""

import json

import numpy as np
import pytest

from moestream.errors import TraceError
from moestream.trace.deepseek import EXPERT_BYTES
from moestream.trace.format import load_trace

LENGTHS = {7: 3, 9: 2, 4: 4}  # prompt_id -> tokens, in file order


def _write(tmp_path, name="routing", experts=None, prompt_id=None, token_pos=None, records=None):
    rng = np.random.default_rng(0)
    n = sum(LENGTHS.values())
    if experts is None:
        experts = np.stack([rng.permutation(64)[:6] for _ in range(n * 26)]).reshape(n, 26, 6).astype(np.uint8)
    prompt_id = np.repeat(list(LENGTHS), list(LENGTHS.values())).astype(np.int32) if prompt_id is None else prompt_id
    token_pos = np.concatenate([np.arange(c) for c in LENGTHS.values()]).astype(np.int32) if token_pos is None else token_pos
    path = tmp_path / f"{name}.npz"
    with open(path, "wb") as handle:
        np.savez_compressed(handle, experts=experts, prompt_id=prompt_id, token_pos=token_pos,
                            moe_layer_ids=np.arange(1, 27, dtype=np.int32))
    if records is None:
        records = [{"prompt_id": p, "n_tokens": c, "tokens": [f"p{p}t{i}" for i in range(c)], "text": f"text {p}"}
                   for p, c in LENGTHS.items()]
    if records is not False:
        _write_lines(tmp_path / f"{name}_tokens.jsonl", records)
    return path, experts


def _write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")


def test_imports_topology_rows_and_tokens(tmp_path):
    path, experts = _write(tmp_path)
    trace = load_trace(path)
    t = trace.topology
    assert (t.moe_layer_ids, t.num_experts, t.top_k, t.num_shared_experts) == (tuple(range(1, 27)), 64, 6, 2)
    assert t.expert_bytes == EXPERT_BYTES == 3 * 2048 * 1408 * 2
    np.testing.assert_array_equal(trace.experts, experts)
    assert trace.sequence_ids() == [7, 9, 4]
    assert not trace.is_prefill.any()  # teacher-forced prompts are replayed as decode streams
    assert trace.tokens[:4] == ["p7t0", "p7t1", "p7t2", "p9t0"]
    assert trace.texts == {7: "text 7", 9: "text 9", 4: "text 4"}
    assert trace.token_ids is None


def test_tokens_file_is_optional_and_may_be_given_elsewhere(tmp_path):
    path, _ = _write(tmp_path, records=False)
    assert load_trace(path).tokens is None
    other = tmp_path / "elsewhere.jsonl"
    _write_lines(other, [{"prompt_id": p, "n_tokens": c, "tokens": ["x"] * c} for p, c in LENGTHS.items()])
    assert load_trace(path, tokens_path=other).tokens == ["x"] * 9


def test_explicit_tokens_file_must_exist(tmp_path):
    path, _ = _write(tmp_path)
    with pytest.raises(TraceError, match="tokens file not found"):
        load_trace(path, tokens_path=tmp_path / "missing.jsonl")


def _records(**change):
    records = [{"prompt_id": p, "n_tokens": c, "tokens": ["a"] * c} for p, c in LENGTHS.items()]
    records[0] |= change
    return records


@pytest.mark.parametrize(
    "records, message",
    [
        (_records()[:2], r"prompts missing from it \[4\]"),
        (_records() + [{"prompt_id": 99, "n_tokens": 1, "tokens": ["z"]}], r"prompts not in the npz \[99\]"),
        (_records(n_tokens=4, tokens=["a"] * 4), "prompt 7 has 4 tokens there, 3 in the npz"),
        (_records(n_tokens=2), "n_tokens is 2 but tokens holds 3 entries"),
        (["{broken"] + _records()[1:], ":1: not a tokens record"),
        (_records() + [_records()[0]], "appears twice"),
    ],
)
def test_tokens_file_that_disagrees(tmp_path, records, message):
    path, _ = _write(tmp_path, records=records)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_bad_npz_contents(tmp_path):
    n = sum(LENGTHS.values())
    bad_ids = np.zeros((n, 26, 6), np.uint8)
    bad_ids[2, 5, 1] = 64
    cases = [
        ({"experts": bad_ids}, "reach 64"),
        ({"experts": np.zeros((n, 25, 6), np.uint8)}, "moe_layer_ids lists"),
        ({"prompt_id": np.array([7, 7, 9, 9, 7, 4, 4, 4, 4], np.int32)}, "not grouped by prompt_id"),
        ({"token_pos": np.array([0, 2, 1, 0, 1, 0, 1, 2, 3], np.int32)}, "does not increase"),
        ({"token_pos": np.zeros(n - 1, np.int32)}, "token_pos must be"),
    ]
    for change, message in cases:
        path, _ = _write(tmp_path, records=False, **change)
        with pytest.raises(TraceError, match=message):
            load_trace(path)


def test_real_dev_trace(deepseek_dev_path):
    trace = load_trace(deepseek_dev_path)
    assert trace.num_tokens == len(trace.tokens) > 0
    assert trace.topology.num_layers == 26 and trace.topology.top_k == 6
    starts = [start for _, start, _ in trace.sequence_bounds()]
    assert (trace.positions[starts] == 0).all()
