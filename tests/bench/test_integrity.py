"""`moestream bench integrity` prints the cost of the digest check beside the disk read, and of the finite check."""

from moestream.bench.integrity import measure_digest_check, measure_finite_check
from moestream.checkpoint.demo import SMALL_NAME
from moestream.checkpoint.index import build_index
from moestream.cli import main


def test_bench_integrity_prints_both_costs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOESTREAM_CACHE", str(tmp_path))
    assert main(["bench", "integrity", "--small", "--buffered-io"]) == 0
    out = capsys.readouterr().out
    assert "digest check:" in out and "beside a disk read" in out and "ratio" in out
    assert "finite check:" in out and "us per token" in out
    model = tmp_path / SMALL_NAME
    digest = measure_digest_check(model, direct_io=False)
    topology = build_index(model).topology
    assert digest["experts_sampled"] == min(8, topology.num_experts) * topology.num_layers
    assert digest["digest_check_vs_disk_read"] > 0 and digest["digest_bytes_per_s"] > 0
    finite = measure_finite_check(model)
    assert finite["finite_checks_per_token"] == topology.num_layers + 1 and finite["finite_check_us_per_token"] > 0
