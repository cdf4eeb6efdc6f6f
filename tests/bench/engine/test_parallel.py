"""bench engine --expert-parallel: each rank's figures summed over the prompts of generate's --json."""

import pytest

from moestream.bench.engine.parallel import summary


def record(tokens: int, tpot_ms: float, ranks: list[tuple[int, int, int, float]] | None = None) -> dict:
    out = {"token_ids": list(range(tokens)), "tpot_ms": tpot_ms, "expert_hits": 3, "expert_misses": 1,
           "bytes_read": {"disk": 400, "host": 0}}
    if ranks is not None:
        out["expert_parallel"] = {"world_size": len(ranks), "placement": "round-robin", "ranks": [
            {"rank": r, "hits": h, "misses": m, "bytes_read": {"disk": d, "host": 0}, "combine_s": c, "owned_experts": 4}
            for r, (h, m, d, c) in enumerate(ranks)]}
    return out


def test_one_process_is_one_rank():
    got = summary([record(4, 10.0), record(4, 20.0)])
    assert got["tpot_ms"] == 15.0
    assert got["per_rank"] == [{"hit_rate": 0.75, "disk_bytes_per_token": 100.0, "combine_ms_per_token": 0.0}]


def test_each_rank_is_summed_over_the_prompts():
    got = summary([record(2, 10.0, [(1, 1, 100, 0.001), (2, 0, 0, 0.002)]),
                   record(2, 10.0, [(1, 1, 300, 0.003), (0, 2, 400, 0.002)])])
    assert [r["hit_rate"] for r in got["per_rank"]] == [0.5, 0.5]
    assert [r["disk_bytes_per_token"] for r in got["per_rank"]] == [100.0, 100.0]
    assert [r["combine_ms_per_token"] for r in got["per_rank"]] == pytest.approx([1.0, 1.0])
