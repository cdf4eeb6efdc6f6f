"""Experts computed where their host bytes are (--host-compute): the rules' choices, the mechanism's
tokens (every miss forced to the host, and the default rule) and the flags' bad input."""

import pytest

from moestream.checkpoint.quantize import quantize_checkpoint
from moestream.cli import main
from moestream.errors import MoestreamError
from moestream.policies.compute_placement import Candidate, ComputeCosts, compute_rule, finish_ms
from moestream.quant.encode import IntScheme
from moestream.runtime import Engine, EngineConfig
from moestream.topology import ExpertKey
from tests.runtime.conftest import PROMPTS, auto_class, reference_generate

# a PCIe-4.0-like link, a server CPU and a GPU, DeepSeek-V2-Lite's expert (bf16)
COSTS = ComputeCosts(link_bytes_per_ms=25e6, host_bytes_per_ms=40e6, device_bytes_per_ms=3e9, host_flops_per_ms=1e9,
                     device_flops_per_ms=4e11, expert_bytes=17_301_504, expert_params=8_650_752, row_bytes=4096)


def candidates(rows: list[int]) -> list[Candidate]:
    return [Candidate(ExpertKey(0, e), r) for e, r in enumerate(rows)]


def test_off_computes_nothing_on_the_host_and_share_takes_the_fewest_rows_first():
    assert compute_rule("off").place(candidates([1, 1]), [1], 0, COSTS) == frozenset()
    chosen = compute_rule("share:0.5").place(candidates([4, 1, 3, 2]), [], 0, COSTS)
    assert chosen == {ExpertKey(0, 1), ExpertKey(0, 3)}
    assert len(compute_rule("share:1").place(candidates([5, 5, 5]), [], 0, COSTS)) == 3


def test_the_default_rule_lowers_the_finish_time_at_decode_and_keeps_prefill_on_the_device():
    decode = candidates([1] * 6)
    chosen = compute_rule("default").place(decode, [1] * 4, 0, COSTS)
    assert chosen  # a copy (0.69 ms) costs more than streaming the expert on the host (0.43 ms)
    host = [c for c in decode if c.key in chosen]
    device = [c for c in decode if c.key not in chosen]
    assert finish_ms(device, host, [1] * 4, 0, COSTS) < finish_ms(decode, [], [1] * 4, 0, COSTS)
    prefill = candidates([256] * 6)  # a 256-token prompt's rows per expert: arithmetic-bound on the host
    assert compute_rule("default").place(prefill, [256] * 4, 0, COSTS) == frozenset()


@pytest.mark.parametrize("text, words", [("lots", "unknown rule"), ("share:2", "between 0 and 1"),
                                         ("share:x", "share:F"), ("off:1", "no argument")])
def test_a_bad_rule_names_the_flag(text, words):
    with pytest.raises(MoestreamError, match=f"--host-compute.*{words}"):
        EngineConfig(host_compute=text)


@pytest.mark.parametrize("threads", ["0", "100000"])
def test_host_threads_beyond_the_machine_are_one_error_line(tiny_checkpoint, capsys, threads):
    path = tiny_checkpoint("mixtral", num_layers=2)
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--host-compute", "default",
                 "--host-threads", threads]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host-threads" in err[0]


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("family, rule", [("mixtral", "share:1"), ("deepseek_v2", "share:1"), ("qwen3_moe", "default"),
                                          ("gpt_oss", "share:0.5")])
def test_tokens_are_transformers_tokens_with_misses_computed_on_the_host(checkpoint, family, rule, sync):
    path = checkpoint(family)
    config = EngineConfig(expert_budget="0.25", host_budget="0.5", direct_io=False, sync=sync, host_compute=rule)
    with Engine(path, config) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        result = engine.generate(prompts, max_new_tokens=5)
        pad_id = engine.pad_id
        assert engine.store.host_slots > 0  # a host tier apart, also on the CPU
    assert result.token_ids == reference_generate(auto_class(family).from_pretrained(path).eval(), prompts, 5, pad_id)
    if rule == "share:1":
        assert result.metrics.host_computed > 0


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_misses_only_on_disk_are_read_into_host_buffers_and_computed_there(checkpoint, sync):
    """No host tier: every miss is only on disk; share:1 sends the first DISK_CANDIDATES of a layer's to the
    host, which reads each into a buffer of its own: the tokens stay transformers'."""
    path = checkpoint("mixtral")
    off, on_host = (_generate(path, rule, sync, host_budget="0") for rule in ("off", "share:1"))
    assert on_host.metrics.host_computed > 0 and off.metrics.host_computed == 0
    assert on_host.token_ids == off.token_ids
    with Engine(path, EngineConfig(expert_budget="0.25", direct_io=False)) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
        pad_id = engine.pad_id
    assert on_host.token_ids == reference_generate(auto_class("mixtral").from_pretrained(path).eval(), prompts, 5,
                                                   pad_id)


def _generate(path, rule: str, sync: bool, host_budget: str = "0.5"):
    config = EngineConfig(expert_budget="0.25", host_budget=host_budget, direct_io=False, sync=sync,
                          host_compute=rule)
    with Engine(path, config) as engine:
        return engine.generate([engine.encode(p) for p in PROMPTS], max_new_tokens=5)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_experts_decode_on_the_host_into_the_device_path_tokens(tiny_checkpoint, tmp_path_factory, fmt, sync):
    """Every miss decoded and computed on the host (its own decoder's scratch, beside the compute thread's):
    the tokens of the all-device path, which the quantized suite checks against transformers."""
    path = tiny_checkpoint("qwen3_moe", num_layers=2, quant="fp8")
    if fmt == "int4":
        source, path = tiny_checkpoint("qwen3_moe", num_layers=2), tmp_path_factory.mktemp("int4") / "q"
        quantize_checkpoint(source, path, IntScheme(4, 32))
    on_host = _generate(path, "share:1", sync)
    assert on_host.metrics.host_computed > 0
    assert on_host.token_ids == _generate(path, "off", sync).token_ids
