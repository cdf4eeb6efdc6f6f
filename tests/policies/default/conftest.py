"""The default's tests share a synthetic train/test split and a policy fitted on its training part
(one per test module)."""

import pytest

from tests.policies.default.common import fitted_policy, split_traces


@pytest.fixture(scope="module")
def traces():
    return split_traces()


@pytest.fixture(scope="module")
def policy(traces):
    return fitted_policy(traces[0])
