"""`moestream bench experts` prints each expert MLP's effective bandwidth beside the read bandwidth."""

import json

from moestream.cli import main


def test_bench_experts_prints_a_line_per_case_and_writes_the_figures(tmp_path, capsys):
    path = tmp_path / "experts.json"
    args = ["bench", "experts", "--shapes", "demo", "--dtypes", "bf16,fp32", "--tokens", "1,3", "--repeats", "1",
            "--pool-mib", "8", "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("read bandwidth: ")
    assert len([line for line in out.splitlines() if line.startswith("demo ")]) == 4
    figures = json.loads(path.read_text())
    assert figures["read_bytes_per_s"] > 0 and figures["threads"] == 1
    cases = figures["cases"]
    assert [(c["dtype"], c["tokens"]) for c in cases] == [("bf16", 1), ("bf16", 3), ("fp32", 1), ("fp32", 3)]
    assert cases[0]["expert_bytes"] == 3 * 256 * 448 * 2 and cases[2]["expert_bytes"] == 3 * 256 * 448 * 4
    for case in cases:
        assert set(case["bytes_per_s"]) == {"per-expert", "stream", "grouped"}
        assert all(value > 0 for value in case["bytes_per_s"].values())
        assert case["read_fraction"]["stream"] == case["bytes_per_s"]["stream"] / figures["read_bytes_per_s"]


def test_bench_experts_names_a_bad_flag_in_one_line(capsys):
    for args, flag in ((["--shapes", "huge"], "--shapes"), (["--dtypes", "fp8"], "--dtypes"),
                       (["--tokens", "1,x"], "--tokens"), (["--repeats", "0"], "--repeats")):
        assert main(["bench", "experts", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err
