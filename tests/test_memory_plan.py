"""Automatic budgets: what is available, less the floor, the dense part, the KV and a margin."""

import pytest

from moestream.cli import main
from moestream.errors import BudgetError
from moestream.memory_plan import FLOOR_BYTES, Available, ModelSizes, kv_bytes_per_token, margin, plan_memory

GIB, MIB = 2**30, 2**20
SIZES = ModelSizes(dense_bytes=600 * MIB, expert_bytes=8 * MIB, num_experts=1600, num_moe_layers=25, top_k=6,
                   kv_bytes_per_token=32 * 1024)


def test_on_the_cpu_the_experts_get_what_the_rest_leaves():
    host = Available(10 * GIB, "MemAvailable")
    plan = plan_memory(SIZES, "cpu", kv_bytes=64 * MIB, host=host)
    left = 10 * GIB - FLOOR_BYTES - 600 * MIB - 64 * MIB - margin(10 * GIB, False)
    assert plan.expert_budget_bytes == left and plan.host_budget_bytes == 0
    assert any("MemAvailable: 10.0 GiB available" in line for line in plan.lines())


def test_a_budget_is_capped_at_every_expert_and_refused_below_one_layer_s_top_k():
    roomy = plan_memory(SIZES, "cpu", 0, host=Available(64 * GIB, "MemAvailable"))
    assert roomy.expert_budget_bytes == SIZES.total_expert_bytes
    with pytest.raises(BudgetError, match="--expert-budget auto: 1.3 GiB available"):
        plan_memory(SIZES, "cpu", 0, host=Available(1300 * MIB, "MemAvailable"))


def test_on_cuda_the_device_tier_takes_free_device_memory_and_the_host_tier_the_rest():
    plan = plan_memory(SIZES, "cuda:0", 0, host=Available(8 * GIB, "MemAvailable"), gpu=Available(4 * GIB, "cuda:0 free"))
    device = 4 * GIB - 600 * MIB - margin(4 * GIB, True)
    assert plan.expert_budget_bytes == device
    assert plan.host_budget_bytes == 8 * GIB - FLOOR_BYTES - margin(8 * GIB, False)
    assert plan.expert_budget_bytes + plan.host_budget_bytes < SIZES.total_expert_bytes


def test_on_cuda_the_kv_reserve_comes_out_of_the_device_tier():
    host, gpu = Available(8 * GIB, "MemAvailable"), Available(4 * GIB, "cuda:0 free")
    without = plan_memory(SIZES, "cuda:0", 0, host=host, gpu=gpu)
    plan = plan_memory(SIZES, "cuda:0", 512 * MIB, host=host, gpu=gpu)
    assert plan.expert_budget_bytes == without.expert_budget_bytes - 512 * MIB
    assert plan.expert_budget_bytes == 4 * GIB - 600 * MIB - 512 * MIB - margin(4 * GIB, True)
    assert plan.kv_bytes == 512 * MIB and any("KV 512.0 MiB" in line for line in plan.lines())


def test_kv_per_token_counts_keys_and_values_of_every_layer():
    from transformers import MixtralConfig

    config = MixtralConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                           dtype="bfloat16")
    assert kv_bytes_per_token(config) == 4 * 2 * (2 * 8) * 2  # layers x kv heads x (k + v) x bf16


def test_plan_and_an_auto_budget_from_the_command_line(tiny_checkpoint, capsys):
    path = tiny_checkpoint("mixtral")
    assert main(["plan", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "expert budget (device tier)" in out and "--expert-budget auto would use" in out
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2",
                 "--expert-budget", "auto", "--buffered-io"]) == 0
    assert "auto budgets:" in capsys.readouterr().err
