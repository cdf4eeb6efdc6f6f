"""save_trace / load_trace: round trips, detection by content, and every kind of bad file."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from moestream.errors import MoestreamError, TraceError
from moestream.topology import Topology
from moestream.trace import format as trace_format
from moestream.trace.format import HEADER_KEY, load_trace, save_trace
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 3, 5), num_experts=8, top_k=2, expert_bytes=4096, num_shared_experts=1)


@pytest.fixture
def full_trace():
    base = synthetic_trace(TOPOLOGY, num_sequences=3, tokens_per_sequence=5, seed=1)
    rng = np.random.default_rng(1)
    n, layers = base.num_tokens, TOPOLOGY.num_layers
    return dataclasses.replace(
        base,
        gate_weights=rng.random((n, layers, 2)).astype(np.float16),
        gate_probs=rng.dirichlet(np.ones(8), size=(n, layers)).astype(np.float16),
        hidden=rng.standard_normal((n, layers, 4)).astype(np.float16),
        embeddings=rng.standard_normal((n, 4)).astype(np.float16),
        tokens=[f"tok{i}-é✓" if i % 3 else "" for i in range(n)],
        texts={0: "première", 2: "third ✓"},
        source="unit-test",
    )


def _same(a, b):
    assert a.topology == b.topology and a.source == b.source and a.texts == b.texts and a.tokens == b.tokens
    for name in ("experts", "seq_ids", "positions", "is_prefill", "token_ids", "gate_weights", "gate_probs",
                 "hidden", "embeddings"):
        left, right = getattr(a, name), getattr(b, name)
        assert (left is None) == (right is None), name
        if left is not None:
            np.testing.assert_array_equal(left, right, err_msg=name)


def test_round_trip_keeps_every_field(tmp_path, full_trace):
    path = save_trace(full_trace, tmp_path / "t.npz")
    loaded = load_trace(path)
    _same(full_trace, loaded)
    assert loaded.experts.dtype == np.int16 and loaded.is_prefill.dtype == bool


def test_round_trip_without_optional_fields(tmp_path):
    bare = dataclasses.replace(synthetic_trace(TOPOLOGY, num_sequences=2, tokens_per_sequence=3), token_ids=None, tokens=None)
    _same(bare, load_trace(save_trace(bare, tmp_path / "bare.npz")))


def test_save_is_atomic_and_replaces(tmp_path, full_trace, monkeypatch):
    path = save_trace(full_trace, tmp_path / "t.npz")
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(trace_format.np, "savez_compressed", fail)
    with pytest.raises(MoestreamError, match="disk full"):
        save_trace(full_trace.select([0]), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]


def test_format_is_detected_by_content_not_name(tmp_path, full_trace):
    ours = save_trace(full_trace, tmp_path / "looks_like_deepseek.txt")
    assert load_trace(ours).source == "unit-test"


def _write_npz(path, **arrays):
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)
    return path


def _header(**overrides):
    header = {"format": "moestream-trace", "version": 1, "topology": TOPOLOGY.to_dict(), "source": "x"}
    return np.frombuffer(json.dumps(header | overrides).encode(), dtype=np.uint8)


def _valid_arrays(n=4):
    return {
        HEADER_KEY: _header(),
        "experts": np.tile(np.array([0, 1], np.uint8), (n, TOPOLOGY.num_layers, 1)),
        "seq_ids": np.zeros(n, np.int32),
        "positions": np.arange(n, dtype=np.int32),
        "is_prefill": np.zeros(n, bool),
    }


def test_hand_written_valid_file_loads(tmp_path):
    assert load_trace(_write_npz(tmp_path / "ok.npz", **_valid_arrays())).num_tokens == 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({HEADER_KEY: _header(format="other-trace")}, "unknown trace format"),
        ({HEADER_KEY: _header(version=2)}, "version 2 is newer"),
        ({HEADER_KEY: _header(version="one")}, "invalid moestream-trace version"),
        ({HEADER_KEY: np.frombuffer(b"{not json", dtype=np.uint8)}, "unreadable"),
        ({HEADER_KEY: _header(topology={"num_experts": 8})}, "invalid topology"),
        ({"positions": None}, "missing required array"),
        ({"experts": np.zeros((4, 3, 3), np.uint8)}, r"experts has shape \(4, 3, 3\)"),
        ({"experts": np.zeros((4, 2, 2), np.uint8)}, "topology and row count say"),
        ({"experts": np.full((4, 3, 2), 8, np.uint8)}, r"outside the topology's \[0, 7\]"),
        ({"experts": np.zeros((4, 3, 2), np.float32)}, "must hold integers"),
        ({"positions": np.arange(5, dtype=np.int32)}, r"positions has shape \(5,\)"),
        ({"gate_probs": np.zeros((4, 3, 7), np.float16)}, "gate_probs has shape"),
        ({"hidden": np.zeros((4, 2, 5), np.float16)}, "hidden has 2 layers"),
        ({"token_bytes": np.zeros(3, np.uint8), "token_offsets": np.array([0, 1], np.int64)}, "offsets"),
    ],
)
def test_bad_contents_raise_trace_error(tmp_path, change, message):
    arrays = _valid_arrays() | change
    arrays = {name: value for name, value in arrays.items() if value is not None}
    path = _write_npz(tmp_path / "bad.npz", **arrays)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="trace file not found"):
        load_trace(tmp_path / "nope.npz")


def test_directory_empty_and_text_files(tmp_path):
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(TraceError, match="empty file"):
        load_trace(tmp_path / "empty.npz")
    (tmp_path / "text.npz").write_text("experts,seq\n1,2\n")
    with pytest.raises(TraceError, match="not an npz"):
        load_trace(tmp_path / "text.npz")


def test_truncated_file(tmp_path, full_trace):
    data = save_trace(full_trace, tmp_path / "t.npz").read_bytes()
    for cut in (len(data) // 2, len(data) - 10):
        (tmp_path / "cut.npz").write_bytes(data[:cut])
        with pytest.raises(TraceError, match="truncated or corrupt"):
            load_trace(tmp_path / "cut.npz")


def test_corrupt_member(tmp_path, full_trace):
    data = bytearray(save_trace(full_trace, tmp_path / "t.npz").read_bytes())
    middle = len(data) // 3
    data[middle : middle + 64] = bytes(64)
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    with pytest.raises(TraceError):
        load_trace(tmp_path / "bad.npz")


def test_unknown_npz_lists_its_entries(tmp_path):
    path = _write_npz(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(TraceError, match="unknown trace format.*weights"):
        load_trace(path)


def test_tokens_file_is_only_for_deepseek(tmp_path, full_trace):
    path = save_trace(full_trace, tmp_path / "t.npz")
    with pytest.raises(TraceError, match="only to DeepSeek"):
        load_trace(path, tokens_path=tmp_path / "t_tokens.jsonl")


def test_real_deepseek_trace_round_trips(tmp_path, deepseek_dev_path):
    trace = load_trace(deepseek_dev_path)
    copy = tmp_path / "renamed.bin"
    shutil.copy(deepseek_dev_path, copy)
    assert load_trace(copy).tokens is None  # no tokens file beside the copy
    assert trace.tokens is not None and len(trace.tokens) == trace.num_tokens
    _same(trace, load_trace(save_trace(trace, tmp_path / "dev.npz")))
