from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEEPSEEK_DEV = SHARED_DATA / "routing" / "deepseek-v2-lite" / "puffin_dev.npz"
# the families the deep tests (index, loader, kernels, engine budgets, batching) run on, one of each kind:
# multi-head latent attention with shared experts and dense layers, sigmoid routing, fused-on-disk experts
# with biases, renamed blocks, a shared expert with its gate, per-expert layouts, fixed top-2, a swapped
# encoder-decoder. Every other family runs the contract suite (tests/families/test_contract.py).
SAMPLE_FAMILIES = ("deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe",
                   "switch_transformers")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny matmuls are fastest on one thread, and CI runs two test workers on two cores."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def deepseek_dev_path() -> Path:
    if not DEEPSEEK_DEV.exists():
        pytest.skip(f"real routing data not found at {DEEPSEEK_DEV}")
    return DEEPSEEK_DEV


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory `tiny_checkpoint(family, **fields) -> Path`: a small random checkpoint of `family`
    (a transformers model_type) written by `moestream make-model`, cached for the session.

    `fields` are `moestream.checkpoint.spec.ModelSpec` fields (num_layers=4, num_experts=8, top_k,
    hidden_size=64, intermediate_size=64, vocab_size=512, seed=0, dtype="fp32", max_shard_bytes,
    config_overrides). The same arguments return the same directory: treat it as read-only.
    """
    from moestream.checkpoint.make_model import make_model
    from moestream.checkpoint.spec import ModelSpec

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    written: dict[tuple, Path] = {}

    def make(family: str, **fields) -> Path:
        key = (family, repr(sorted(fields.items())))
        if key not in written:
            written[key] = make_model(ModelSpec(family, **fields), root / f"{family}-{len(written)}")
        return written[key]

    return make
