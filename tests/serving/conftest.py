"""A tiny random checkpoint shared by the serving tests."""

import pytest


@pytest.fixture(scope="session")
def serving_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen2_moe", num_layers=2)
