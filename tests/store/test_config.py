import re

import pytest
import torch

from moestream.errors import BudgetError, MoestreamError
from moestream.store.config import Budget, StoreConfig
from moestream.topology import Topology

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3), num_experts=16, top_k=4, expert_bytes=1000)  # 48 experts


@pytest.mark.parametrize("text, size_bytes, ratio", [
    ("0.25", None, 0.25),
    ("25%", None, 0.25),
    ("1.0", None, 1.0),
    ("512MiB", 512 * 2**20, None),
    ("1GB", 10**9, None),
    ("1 gib", 2**30, None),
    ("1.5KiB", 1536, None),
    ("1073741824B", 1073741824, None),
    ("0", 0, None),
])
def test_parse_reads_ratios_and_sizes(text, size_bytes, ratio):
    budget = Budget.parse(text)
    assert (budget.size_bytes, budget.ratio) == (size_bytes, ratio)


@pytest.mark.parametrize("text", ["abc", "", "-1", "12XB", "1.5", "150%", "0.5.1", "1", "5"])
def test_parse_refuses_bad_budgets_naming_them(text):
    with pytest.raises(BudgetError) as err:
        Budget.parse(text)
    assert "budget" in str(err.value)


def test_budget_needs_exactly_one_of_bytes_and_ratio():
    with pytest.raises(BudgetError):
        Budget()
    with pytest.raises(BudgetError):
        Budget(size_bytes=10, ratio=0.5)


def test_resolve_gives_bytes():
    assert Budget.parse("0.25").resolve(48_000) == 12_000
    assert Budget.parse("3000B").resolve(48_000) == 3000
    assert Budget.parse("0.3").resolve(10) == 3  # no float truncation to 2


def test_config_parses_strings_and_validates_ratios():
    config = StoreConfig("0.5", "0")
    assert config.device_budget == Budget(ratio=0.5) and config.host_budget == Budget(size_bytes=0)
    assert StoreConfig("0.5", "0.0").host_budget.ratio == 0.0
    with pytest.raises(BudgetError, match="device budget ratio"):
        StoreConfig("0.0", "0.5")


@pytest.mark.parametrize("device", ["tpu", "gpu:0", "not a device"])
def test_config_refuses_unknown_devices(device):
    with pytest.raises(BudgetError, match="device"):
        StoreConfig("0.5", "0.5", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_config_refuses_cuda_without_cuda():
    with pytest.raises(BudgetError, match="CUDA is not available"):
        StoreConfig("0.5", "0.5", device="cuda")


def test_slots_are_budget_over_expert_bytes_capped_at_all_experts():
    config = StoreConfig("12500B", "0.5")
    assert config.device_slots(TOPOLOGY) == 12
    assert config.host_slots(TOPOLOGY) == 24
    assert StoreConfig("1.0", "10GB").host_slots(TOPOLOGY) == TOPOLOGY.total_experts
    assert StoreConfig("1.0", "0").host_slots(TOPOLOGY) == 0


def test_too_small_device_budget_states_a_sufficient_minimum():
    with pytest.raises(BudgetError) as err:
        StoreConfig("3999B", "0").device_slots(TOPOLOGY)
    message = str(err.value)
    assert "top_k=4" in message
    min_bytes = int(re.search(r"minimum is (\d+)B", message).group(1))
    min_ratio = re.search(r"a ratio of ([\d.e-]+)", message).group(1)
    assert min_bytes == TOPOLOGY.top_k * TOPOLOGY.expert_bytes
    assert StoreConfig(f"{min_bytes}B", "0").device_slots(TOPOLOGY) == TOPOLOGY.top_k
    with pytest.raises(BudgetError):
        StoreConfig(f"{min_bytes - 1}B", "0").device_slots(TOPOLOGY)
    assert StoreConfig(min_ratio, "0").device_slots(TOPOLOGY) >= TOPOLOGY.top_k


def test_minimum_ratio_suffices_for_awkward_sizes():
    topology = Topology(moe_layer_ids=tuple(range(26)), num_experts=64, top_k=6, expert_bytes=17_301_504)
    with pytest.raises(BudgetError) as err:
        StoreConfig("0.001", "0").device_slots(topology)
    min_ratio = re.search(r"a ratio of ([\d.e-]+)", str(err.value)).group(1)
    assert StoreConfig(min_ratio, "0").device_slots(topology) >= 6


def test_config_refuses_rounds_of_no_chunk():
    with pytest.raises(MoestreamError, match="chunks_in_flight must be >= 1, got 0"):
        StoreConfig("0.5", "0", chunks_in_flight=0)
