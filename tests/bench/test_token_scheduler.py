"""`moestream bench token-scheduler` runs the continuous batcher once per token scheduler and prints
activated experts per decode batch, hit rate, throughput and peak RSS for each."""

import json

from moestream.cli import main


def test_bench_token_scheduler_reports_each_scheduler(tiny_checkpoint, tmp_path, capsys):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    out = tmp_path / "bench.json"
    assert main(["bench", "token-scheduler", "--model", str(model), "--data-dir", str(tmp_path), "--num-seqs", "6",
                 "--max-batch-size", "2", "--max-tokens", "6", "--expert-budget", "0.5", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["scheduler"] for r in runs] == ["fifo", "expertflow"]
    for run in runs:
        assert 0 < run["activated_experts_per_batch"] <= run["num_experts_total"]
        assert 0 <= run["hit_rate"] <= 1 and run["decode_tokens_per_s"] > 0
        assert run["num_tokens"] >= 6 * 6 // 2  # timed once every sequence is prefilled, not after all finish
        assert run["peak_rss_mib"] > 0 and isinstance(run["rss_growth_mib"], float)
    lines = [line for line in capsys.readouterr().out.splitlines() if "experts activated per decode batch" in line]
    assert len(lines) == 2 and all("peak RSS" in line for line in lines)


def test_bench_token_scheduler_refuses_an_unknown_scheduler(capsys):
    assert main(["bench", "token-scheduler", "--schedulers", "fifo,psychic"]) == 2
    assert "psychic" in capsys.readouterr().err
