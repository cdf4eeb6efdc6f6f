"""`bench engine --device cuda`'s runs: the engine's greedy tokens on CUDA are transformers' own on CUDA,
all resident, offloaded and on demand. Skipped without CUDA (scripts/gpu-check.sh runs it on a GPU)."""

import pytest
import torch
import transformers

from moestream.bench.engine.child import run_spec
from moestream.bench.engine.spec import RunSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ("The cat sat on", "def add(a, b):\n    return")
NEW_TOKENS = 8


def transformers_tokens(path, prompt: str) -> list[int]:
    """Greedy new tokens of plain transformers on CUDA, cut after the first EOS."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").to("cuda").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to("cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = out[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return next((tokens[: i + 1] for i, token in enumerate(tokens) if token in eos), tokens)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("budget, sync, preload", [("1.0", False, True), ("0.25", False, False),
                                                   ("0.25", True, False)])
def test_greedy_tokens_on_cuda_are_transformers_tokens_on_cuda(tiny_checkpoint, dtype, budget, sync, preload):
    path = tiny_checkpoint("deepseek_v2", num_layers=3, num_experts=16, top_k=4, dtype=dtype)
    spec = RunSpec(model=str(path), budget=budget, sync=sync, preload=preload, device="cuda", prompts=PROMPTS,
                   max_new_tokens=NEW_TOKENS, direct_io=False)
    result = run_spec(spec)
    assert result["token_ids"] == [transformers_tokens(path, prompt) for prompt in PROMPTS]
    assert result["decode_tokens"] > 0 and (preload or result["expert_misses"] > 0)
