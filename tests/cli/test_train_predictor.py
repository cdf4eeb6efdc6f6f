import dataclasses
import os

import numpy as np
import pytest

from moestream.bench.sim.replay import decode_stream
from moestream.cli import main
from moestream.policies import POLICIES
from moestream.topology import Topology
from moestream.trace.format import save_trace
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology((1, 2, 3), num_experts=8, top_k=2, expert_bytes=1024)
SMALL = ["--epochs", "2", "--set", "model_dim=16", "--set", "num_heads=2", "--set", "window_tokens=4", "--no-progress"]


@pytest.fixture(scope="module")
def trace_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    trace = synthetic_trace(TOPOLOGY, num_sequences=10, tokens_per_sequence=12, seed=1)
    hidden = np.random.default_rng(1).standard_normal((trace.num_tokens, TOPOLOGY.num_layers, 8))
    save_trace(trace, root / "routing.npz")
    save_trace(dataclasses.replace(trace, hidden=hidden.astype(np.float16)), root / "hidden.npz")
    return root / "routing.npz", root / "hidden.npz"


def test_trains_saves_and_the_policy_loads_it(trace_paths, tmp_path, capsys):
    out = tmp_path / "ef"
    code = main(["train-predictor", "--kind", "expertflow", "--trace", str(trace_paths[0]), "--out", str(out),
                 "--holdout", "0.2", "--seed", "3", *SMALL])
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out top-k accuracy (iteration start)" in printed and f"saved to {out}" in printed
    assert sorted(p.name for p in out.iterdir()) == ["predictor.json", "weights.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ef"]  # no staging directory left behind
    umask = os.umask(0o022)
    os.umask(umask)
    assert [p.stat().st_mode & 0o777 for p in (out, *sorted(out.iterdir()))] == [
        0o777 & ~umask, 0o666 & ~umask, 0o666 & ~umask]  # as a plain write leaves them, not mkdtemp's 0700
    policy = POLICIES.create("expertflow", TOPOLOGY, predictor_dir=out)
    assert policy.config.model_dim == 16 and policy.predictor.train_config.seed == 3
    it = next(iter(decode_stream(synthetic_trace(TOPOLOGY, num_sequences=1, seed=2))))
    policy.predictor.begin_iteration(it.ctx)
    assert policy.predictor.predict(-1, 3)


@pytest.mark.parametrize("kind", ["promoe", "promoe-routing"])
def test_trains_promoe_kinds(trace_paths, tmp_path, kind):
    out = tmp_path / kind
    args = ["train-predictor", "--kind", kind, "--trace", str(trace_paths[1]), "--out", str(out), "--epochs", "1",
            "--set", "hidden_units=8", "--no-progress"]
    assert main(args) == 0
    POLICIES.create(kind, TOPOLOGY, predictor_dir=out)


def test_an_existing_output_needs_force(trace_paths, tmp_path, capsys):
    out = tmp_path / "ef"
    args = ["train-predictor", "--kind", "expertflow", "--trace", str(trace_paths[0]), "--out", str(out), *SMALL]
    assert main(args) == 0
    before = (out / "weights.safetensors").read_bytes()
    capsys.readouterr()
    assert main(args) == 2
    assert "--force" in capsys.readouterr().err
    assert main([*args, "--force", "--seed", "9"]) == 0
    assert (out / "weights.safetensors").read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["ef"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--kind", "promoe", "--trace", "{routing}"], "no 'hidden' field"),
        (["--kind", "lru", "--trace", "{routing}"], "learns no predictor"),
        (["--kind", "nope", "--trace", "{routing}"], "unknown policy"),
        (["--kind", "expertflow", "--trace", "{missing}"], "not found"),
        (["--kind", "expertflow", "--trace", "{routing}", "--set", "no_such=1"], "KEY one of"),
        (["--kind", "expertflow", "--trace", "{routing}", "--set", "model_dim=wide"], "expected a int"),
        (["--kind", "expertflow", "--trace", "{routing}", "--set", "num_heads=3"], "multiple of num_heads"),
        (["--kind", "expertflow", "--trace", "{routing}", "--epochs", "0"], "num_epochs"),
        (["--kind", "expertflow", "--trace", "{routing}", "--holdout", "1.5"], "--holdout"),
    ],
)
def test_bad_input_is_one_error_line(trace_paths, tmp_path, capsys, extra, message):
    paths = {"routing": trace_paths[0], "missing": tmp_path / "none.npz"}
    args = ["train-predictor", "--out", str(tmp_path / "out"), "--no-progress"] + [a.format(**paths) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moestream: error:") and message in err
    assert not (tmp_path / "out").exists()
