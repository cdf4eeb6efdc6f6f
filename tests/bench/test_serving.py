"""`moestream bench serving` serves each policy, replays the trace at each rate and names the best;
every run reports the process's peak RSS."""

import json

import pytest

from moestream.cli import main


def _arrivals(tmp_path):
    """An Azure-format arrival trace: one request a second for ten seconds."""
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" +
                     "".join(f"2023-11-16 18:15:{s:02d}.0000000,40,20\n" for s in range(10)))
    return trace


def test_bench_serving_reports_the_highest_rate_per_policy(tiny_checkpoint, tmp_path, capsys):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    trace = _arrivals(tmp_path)
    out = tmp_path / "bench.json"
    assert main(["bench", "serving", "--model", str(model), "--trace", str(trace), "--data-dir", str(tmp_path),
                 "--policies", "lru,lru:sync", "--rates", "2,4", "--duration", "1", "--min-requests", "3",
                 "--scale-lengths", "0.2", "--tpot-factor", "1000", "--json", str(out), "--plot-dir",
                 str(tmp_path / "plots")]) == 0
    figures = json.loads(out.read_text())
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "all-resident-2rps.png", "lru-2rps.png", "lru-4rps.png", "lru-sync-2rps.png", "lru-sync-4rps.png"]
    assert [r["policy"] for r in figures["runs"]] == ["all-resident", "lru", "lru", "lru:sync", "lru:sync"]
    assert [r["num_requests"] for r in figures["runs"]] == [3, 3, 4, 3, 4]  # 2 req/s lasts 1.5 s for 3 requests
    assert [r["mode"] for r in figures["runs"]] == ["async", "async", "async", "sync", "sync"]
    assert figures["best_rps"] == {"lru": 4.0, "lru:sync": 4.0}
    assert all(r["peak_rss_mib"] > 0 and isinstance(r["rss_growth_mib"], float) for r in figures["runs"])
    assert not any(r["replayed"] for r in figures["runs"])
    printed = capsys.readouterr()
    assert "lru: highest rate sustained 4 req/s" in printed.out
    assert "lru sustains 1.00x the rate of lru:sync" in printed.out
    run_lines = [line for line in printed.err.splitlines() if " req/s: " in line]
    assert len(run_lines) == 5 and all("peak RSS" in line and "share one peak" in line for line in run_lines)


@pytest.mark.parametrize("policies", ["lru:fast", "nope", ",", "default,lru:sync"])  # default: no --predictor-dir
def test_bench_serving_refuses_bad_policies_before_any_run(capsys, policies):
    assert main(["bench", "serving", "--policies", policies]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ("polic" in err)


@pytest.mark.parametrize("rates", ["2,1", "0,1", "fast"])
def test_bench_serving_refuses_bad_rates(capsys, rates):
    assert main(["bench", "serving", "--rates", rates]) == 2
    assert "--rates" in capsys.readouterr().err


def test_bench_serving_refuses_runs_of_no_request(capsys):
    assert main(["bench", "serving", "--policies", "lru", "--min-requests", "0"]) == 2
    assert "--min-requests must be >= 1" in capsys.readouterr().err


def test_bench_serving_all_rates_runs_past_an_unsustained_rate(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("qwen2_moe", num_layers=2)
    trace = _arrivals(tmp_path)
    out = tmp_path / "bench.json"
    assert main(["bench", "serving", "--model", str(model), "--trace", str(trace), "--data-dir", str(tmp_path),
                 "--policies", "lru", "--rates", "2,4", "--duration", "1", "--min-requests", "1",
                 "--scale-lengths", "0.2", "--tpot-factor", "1e-6", "--all-rates", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [r["policy"] for r in figures["runs"]] == ["all-resident", "lru", "lru"]
    assert figures["best_rps"] == {"lru": 0.0}


@pytest.mark.parametrize("rates, line", [((2.0, 1.0), "a sustains 2.00x the rate of b"),
                                         ((1.0, 0.0), "a sustains 1 req/s, b none of the rates tried"),
                                         ((0.0, 0.0), "neither a nor b sustains any rate tried")])
def test_the_ratio_line_says_what_was_sustained(rates, line):
    from moestream.bench.serving import _ratio_line

    assert _ratio_line("a", rates[0], "b", rates[1]) == line
