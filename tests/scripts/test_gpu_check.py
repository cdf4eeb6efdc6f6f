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
