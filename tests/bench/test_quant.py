"""`moestream bench quant` end to end on a tiny model and its int4 copy: one line of figures per
checkpoint and policy at the same byte budget, and the ratios against the first. Figures are the
benchmark's business; the test checks what they count."""

import json

import pytest

from moestream.checkpoint.index import build_index
from moestream.checkpoint.quantize import quantize_checkpoint
from moestream.cli import main
from moestream.quant.encode import IntScheme


@pytest.fixture(scope="module")
def bench(tiny_checkpoint, tmp_path_factory):
    source = tiny_checkpoint("mixtral", num_layers=2, dtype="bf16")
    root = tmp_path_factory.mktemp("bench_quant")
    int4 = quantize_checkpoint(source, root / "int4", IntScheme(4, 32))
    out = root / "bench.json"
    code = main(["bench", "quant", "--models", f"{source},{int4}", "--policy", "lru", "--budget", "0.25",
                 "--max-new-tokens", "3", "--buffered-io", "--json", str(out)])
    return code, json.loads(out.read_text()), source, int4


def test_every_checkpoint_and_policy_runs_at_the_same_byte_budget(bench, capsys):
    code, rows, source, int4 = bench
    assert code == 0
    assert [(row["model"], row["sync"]) for row in rows] == [(str(source), False), (str(source), True),
                                                            (str(int4), False), (str(int4), True)]
    assert len({row["budget"] for row in rows}) == 1
    dense, packed = (build_index(path).topology.expert_bytes for path in (source, int4))
    assert [row["expert_bytes"] for row in rows] == [dense, dense, packed, packed]
    for row in rows:
        assert row["bytes_per_token"] == pytest.approx(row["expert_bytes"] * row["expert_misses"]
                                                       / row["decode_tokens"])
        assert row["mlp_ms"] > 0 and (row["decode_ms"] > 0) == (row["model"] == str(int4))


def test_the_quantized_checkpoint_holds_more_experts_in_the_budget(bench):
    _, rows, _, _ = bench
    assert rows[2]["hit_rate"] > rows[0]["hit_rate"] and rows[3]["hit_rate"] > rows[1]["hit_rate"]
