"""scripts/gpu-check.sh parses and refuses a bad preset at once; its table script lists every run of every
bench engine JSON, the all-resident run first, and each step's exit status. (The smoke run itself takes
minutes: its command is in the script's header.)"""

import importlib.util
import json
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def table_module():
    spec = importlib.util.spec_from_file_location("gpu_check_table", SCRIPTS / "gpu_check_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(policy, mode, budget, tpot, limit=None):
    return {"policy": policy, "mode": mode, "budget": budget, "ttft_ms": 50.0, "tpot_ms": tpot,
            "stall_ms_per_token": 1.0, "hit_rate": 0.5, "bytes_per_token": 2e6, "limit_tpot_ms": limit,
            "peak_rss_mib": 900.0}


def test_the_script_parses_and_refuses_a_bad_preset(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu-check.sh")]).returncode == 0
    done = subprocess.run([str(SCRIPTS / "gpu-check.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GPU_CHECK_PRESET": "huge", "OUT": str(tmp_path)})
    assert done.returncode == 2 and "GPU_CHECK_PRESET must be full, half or small" in done.stderr


def test_the_table_has_every_run_and_step(tmp_path):
    document = {"model": "/tmp/ck", "checkpoint": "26 MoE layers x 64 experts (top-6)", "device": "cuda",
                "replay_routing": "trace.npz", "prompts": 1, "max_new_tokens": 6, "disk_bw_gbps": 2.5,
                "dense_mib": 2500.0, "floor_rss_mib": 700.0,
                "runs": [run("lru", "async", 1.0, 20.0, 20.0), run("lru", "sync", 0.25, 90.0, 40.0),
                         run("default", "async", 0.25, 50.0, 40.0)],
                "skipped": [{"policy": "hf-accelerate", "mode": "sync", "budget": "0.25", "reason": "on cuda"}]}
    (tmp_path / "bench-engine-25.json").write_text(json.dumps(document))
    (tmp_path / "bench-engine-10.json").write_text("{not json")
    (tmp_path / "steps.tsv").write_text("step\texit\tseconds\ntests\t0\t40\nbench-10\t124\t150\n")
    lines = table_module().table(tmp_path).splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    assert rows[:3] == ["| step | exit | seconds |", "| tests | 0 | 40 |", "| bench-10 | 124 | 150 |"]
    assert any("bench-engine-10.json: unreadable" in line for line in lines)
    assert [row.split(" | ")[:3] for row in rows[4:]] == [["| all resident", "lru", "async"], ["| 25%", "default", "async"],
                                                          ["| 25%", "lru", "sync"]]
    assert "| 2.25 |" in rows[-1] and "device cuda" in "\n".join(lines) and lines[-1].startswith("- skipped hf-accelerate sync at 0.25")


def test_plain_transformers_follows_the_resident_run_with_the_comparison_and_host_bytes(tmp_path):
    plain = run("transformers", "plain", 1.0, 18.0) | {"hit_rate": None, "stall_ms_per_token": None,
                                                        "host_bytes_per_token": None, "steady_tpot_ms": 17.5}
    offloaded = run("lru", "sync", 0.25, 30.0) | {"host_bytes_per_token": 5e6, "device_slots": 416, "host_slots": 1664}
    document = {"model": "/tmp/ck", "device": "cuda", "max_new_tokens": 6, "disk_bw_gbps": 2.5, "dense_mib": 2500.0,
                "floor_rss_mib": 700.0, "host_budget": "100%", "host_budget_mib": 28000.0, "h2d_gbps": 50.1,
                "runs": [run("lru", "async", 1.0, 20.0) | {"steady_tpot_ms": 19.0}, offloaded, plain], "skipped": [],
                "transformers": {"warmup_steps": 3, "resident_steady_tpot_ms": 19.0, "transformers_steady_tpot_ms": 17.5,
                                 "ratio": 19.0 / 17.5, "same_tokens": True, "dtype": "bfloat16",
                                 "experts_implementation": "grouped_mm"}}
    (tmp_path / "bench-engine-25.json").write_text(json.dumps(document))
    lines = table_module().table(tmp_path).splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "budget" not in line]
    assert [row[:3] for row in rows] == [["| all resident", "lru", "async"], ["| all resident", "transformers", "plain"],
                                         ["| 25%", "lru", "sync"]]
    assert rows[2][9:12] == ["5", "-", "416+1664"]  # host MB per token beside the disk's, no host compute, slots
    assert any("1.09x; same tokens" in line for line in lines)
    assert any("host budget 100% (28000 MiB), host -> device copy 50.10 GB/s" in line for line in lines)
