"""EngineConfig refuses bad settings before anything is loaded."""

import pytest
import torch

from moestream.errors import BudgetError, MoestreamError, UnknownNameError
from moestream.policies import POLICIES
from moestream.runtime import EngineConfig
from moestream.store.config import Budget, StoreConfig


def test_defaults_parse_into_budgets():
    config = EngineConfig()
    assert config.expert_budget == Budget(ratio=0.25) and config.host_budget == Budget(size_bytes=0)
    assert StoreConfig.of(config).device == "cpu"


@pytest.mark.parametrize("settings, error, named", [
    (dict(expert_budget="plenty"), BudgetError, "plenty"),
    (dict(expert_budget="1.5"), BudgetError, "1.5"),
    (dict(policy="no-such-policy"), UnknownNameError, "no-such-policy"),
    (dict(horizon_layers=-1), MoestreamError, "horizon_layers"),
    (dict(device="tpu"), BudgetError, "tpu"),
])
def test_bad_settings_name_the_problem(settings, error, named):
    with pytest.raises(error, match=named):
        EngineConfig(**settings)


def test_offline_policies_are_for_the_simulator():
    offline = [name for name in POLICIES.names() if POLICIES.get(name).offline]
    for name in offline:
        with pytest.raises(MoestreamError, match="simulator"):
            EngineConfig(policy=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(BudgetError, match="CUDA is not available"):
        EngineConfig(device="cuda")


def test_a_device_is_taken_as_text_or_as_a_torch_device():
    from moestream.config import parse_device

    assert parse_device("cpu") == parse_device(torch.device("cpu")) == "cpu"
    assert EngineConfig(device=torch.device("cpu")).device == "cpu"
