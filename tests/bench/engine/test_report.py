"""The issue's targets at 25%, read off a bench document: ok, missed, or not measured."""

from moestream.bench.engine.report import targets


def _run(policy: str, mode: str, tpot_ms: float, budget: float = 0.25, rss: float = 500.0,
         cap: float | None = None) -> dict:
    return {"policy": policy, "mode": mode, "budget": budget, "budget_mib": 100.0, "tpot_ms": tpot_ms,
            "limit_tpot_ms": 80.0, "peak_rss_mib": rss, "memory_cap_mib": cap}


def _document(*runs) -> dict:
    return {"runs": list(runs), "resident_tpot_ms": 70.0, "floor_rss_mib": 300.0, "dense_mib": 50.0}


def test_every_target_is_checked_against_its_reference():
    verdicts = targets(_document(_run("default", "async", 90.0), _run("lru", "sync", 190.0),
                                 _run("hf-accelerate", "sync", 85.0), _run("default", "async", 10.0, budget=0.5)))
    by_start = {name.split(" (")[0][:30]: verdict.split()[0] for name, verdict in verdicts.items()}
    assert list(by_start.values()) == ["ok", "ok", "ok", "missed", "ok", "not"]  # 90 > 85: slower than HF; no cap
    assert verdicts["default TPOT <= 1.25x physical limit"] == "ok (1.12x)"
    assert verdicts["default >= 2.0x faster than --sync LRU"] == "ok (2.11x faster)"


def test_missing_runs_are_not_measured_rather_than_passed():
    verdicts = targets(_document(_run("default", "async", 200.0, rss=600.0)))
    assert verdicts["default TPOT <= 1.25x physical limit"].startswith("missed")
    assert verdicts["default >= 2.0x faster than --sync LRU"] == "not measured"
    assert verdicts["default faster than HF accelerate offload"] == "not measured"
    assert targets(_document(_run("lru", "sync", 1.0))) == {"default at 25%": "not measured (no default run at 25%)"}


def test_a_capped_run_is_compared_with_its_uncapped_twin_and_replaces_it_nowhere():
    uncapped, capped = _run("default", "async", 100.0), _run("default", "async", 108.0, rss=900.0, cap=514.0)
    verdicts = targets(_document(uncapped, capped, _run("lru", "sync", 170.0, cap=514.0)))
    assert verdicts["default TPOT under the memory cap <= 1.1x uncapped"] == "ok (1.08x)"
    assert verdicts["default TPOT <= 1.3x all resident"] == "missed (1.43x)"  # the uncapped 100 ms, not 108
    assert verdicts["default >= 2.0x faster than --sync LRU"] == "not measured"  # only a capped LRU ran
    assert next(v for k, v in verdicts.items() if k.startswith("default peak RSS")) == "ok (0.97x)"  # 500 of 514
    slower = targets(_document(uncapped, _run("default", "async", 140.0, cap=514.0)))
    assert slower["default TPOT under the memory cap <= 1.1x uncapped"] == "missed (1.40x)"


def test_a_capped_run_that_was_killed_misses_the_target():
    document = _document(_run("default", "async", 100.0)) | {"skipped": [
        {"policy": "default", "budget": "0.25", "mode": "async", "memory_cap_mib": 514.0,
         "reason": "exit status -9 (killed: out of memory under the cap?)"}]}
    verdict = targets(document)["default TPOT under the memory cap <= 1.1x uncapped"]
    assert verdict.startswith("missed (the capped run failed: exit status -9")


def test_the_oracle_s_bytes_per_token_are_printed_beside_each_uncapped_run_s():
    from moestream.bench.engine.report import _bytes_line

    runs = [_run("default", "async", 90.0) | {"bytes_per_token": 8e8}, _run("lru", "sync", 150.0) | {"bytes_per_token": 9e8},
            _run("lru", "sync", 150.0, cap=514.0) | {"bytes_per_token": 1e9},
            _run("lru", "sync", 90.0, budget=0.5) | {"bytes_per_token": 5e8}]
    assert _bytes_line("0.25", 4.5e8, runs) == ("bytes per token at 0.25: offline oracle 450 MB; default async 800 MB; "
                                                 "lru sync 900 MB")


def _versus(ours: float | None, theirs: float | None, same: bool | None) -> dict:
    return {"transformers": {"warmup_steps": 3, "resident_steady_tpot_ms": ours,
                             "transformers_steady_tpot_ms": theirs, "ratio": ours / theirs if ours and theirs else None,
                             "same_tokens": same,
                             "dtype": "bfloat16", "experts_implementation": "grouped_mm"}}


def test_the_all_resident_run_meets_the_transformers_target_only_with_the_same_tokens():
    from moestream.bench.engine.report import versus_transformers_line

    assert versus_transformers_line(_versus(10.5, 10.0, True)).endswith(
        "moestream 10.50 ms, transformers 10.00 ms: 1.05x (target <= 1.1x with the same tokens): ok; the same tokens")
    missed = versus_transformers_line(_versus(12.0, 10.0, True))
    assert ": 1.20x (target <= 1.1x with the same tokens): missed;" in missed
    assert versus_transformers_line(_versus(9.0, 10.0, False)).endswith("missed; DIFFERENT tokens")
    assert "not measured: no prompt decoded more than 3 steps" in versus_transformers_line(_versus(None, 10.0, True))
    assert versus_transformers_line({"transformers": None}) is None


def test_the_host_line_says_what_the_cpu_made_of_the_host_budget():
    from moestream.bench.engine.report import host_line

    document = {"host_budget": "100%", "host_budget_mib": 1024.0, "h2d_gbps": 9.5, "device": "cpu"}
    assert host_line(document).startswith("host budget 100% (1024 MiB), its tier filled before the timed steps; "
                                          "host -> device copy 9.50 GB/s (memcpy)")
    assert "only --sync runs keep a host tier apart" in host_line(document)
    assert "pinned H2D" in host_line(document | {"device": "cuda"}) and "only --sync" not in host_line(
        document | {"device": "cuda"})
    assert host_line(document | {"host_budget_mib": 0.0}) is None
