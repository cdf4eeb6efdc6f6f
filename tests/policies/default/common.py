"""What the default's tests share: a small topology, quick training settings, a synthetic
train/test split and a policy fitted on it."""

from moestream.policies import POLICIES
from moestream.predictors.configs import TrainConfig
from moestream.topology import Topology
from tests.synthetic import synthetic_trace

TOPOLOGY = Topology(moe_layer_ids=(1, 2, 3, 4, 5), num_experts=8, top_k=2, expert_bytes=1024)
QUICK = TrainConfig(num_epochs=30, learning_rate=2e-2, batch_size=64)


def split_traces():
    return synthetic_trace(TOPOLOGY, num_sequences=30, tokens_per_sequence=20, seed=1).split(0.3, seed=0)


def fitted_policy(trace, **kwargs):
    policy = POLICIES.create("default", TOPOLOGY, train=kwargs.pop("train", QUICK), **kwargs)
    policy.fit(trace)
    return policy
