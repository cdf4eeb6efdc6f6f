"""bench engine's plain transformers run: the checkpoint in its dtype with its own experts, every weight in
memory, greedy with the KV cache outside `generate`: the tokens of our all-resident run, each decode step
timed, the warm-up steps left out of its steady TPOT."""

import pytest

from moestream.bench.engine.child import run_spec
from moestream.bench.engine.spec import RunSpec, steady_tpot_ms

PROMPTS = ("The cat sat on", "def add(a, b):\n    return")


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_plain_transformers_generates_the_all_resident_runs_tokens(tiny_checkpoint, dtype, torch_dtype):
    path = tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype=dtype)
    spec = RunSpec(model=str(path), budget="1.0", prompts=PROMPTS, max_new_tokens=7, direct_io=False)
    ours = run_spec(RunSpec(**{**spec.__dict__, "preload": True}))
    plain = run_spec(RunSpec(**{**spec.__dict__, "kind": "transformers"}))
    assert plain["token_ids"] == ours["token_ids"] and all(len(ids) == 7 for ids in ours["token_ids"])
    assert plain["dtype"] == torch_dtype and plain["experts_implementation"]
    assert plain["decode_tokens"] == ours["decode_tokens"] == 12
    assert plain["hit_rate"] is None and plain["host_bytes_per_token"] is None  # no store of ours
    for run in (ours, plain):
        assert 0 < run["steady_tpot_ms"] and run["tpot_ms"] > 0


def test_the_steady_tpot_leaves_out_each_generations_warm_up_steps():
    steps = [[9.0, 5.0, 3.0, 1.0, 1.0], [8.0, 2.0, 3.0, 3.0], [4.0, 4.0]]
    assert steady_tpot_ms(steps, 3) == 2.0  # median of 1.0 and 3.0; the third generation had too few steps
    assert steady_tpot_ms(steps, 0) == 4.0  # median of the means 3.8, 4.0 and 4.0
    assert steady_tpot_ms(steps, 5) is None
