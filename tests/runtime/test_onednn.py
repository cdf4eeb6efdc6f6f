"""Bounding oneDNN's per-shape caches: the variables are set only where the user has not, and on a CPU
whose bf16 matmuls go through oneDNN the bound stops the heap from growing with every new shape."""

import contextlib
import os
import subprocess
import sys

import pytest

from moestream.runtime.onednn import VARIABLES, bound_shape_caches

GROWTH = """
import re, torch, torch.nn.functional as F
from moestream.runtime.onednn import bound_shape_caches
if {bound}:
    bound_shape_caches(4)
def heap_kib():
    text = open("/proc/self/smaps").read()
    return sum(int(kib) for kib in re.findall(r"\\[heap\\]\\n(?:.*\\n)*?Rss:\\s+(\\d+) kB", text))
torch.set_num_threads(1)
weight = torch.randn(448, 256).bfloat16()
F.linear(torch.randn(1, 256).bfloat16(), weight)
before = heap_kib()
for rows in range(2, 80):
    F.linear(torch.randn(rows, 256).bfloat16(), weight)
print(heap_kib() - before)
"""


def test_unset_variables_are_set_and_the_users_are_kept(monkeypatch):
    monkeypatch.setenv(VARIABLES[0], "")  # so that teardown restores the environment as it was
    monkeypatch.delenv(VARIABLES[0])
    monkeypatch.setenv(VARIABLES[1], "12")
    assert bound_shape_caches(5) == {VARIABLES[0]: "5", VARIABLES[1]: "12"}
    assert os.environ[VARIABLES[0]] == "5"


def heap_growth_kib(bound: bool) -> int:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    out = subprocess.run([sys.executable, "-c", GROWTH.format(bound=bound)], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc")
def test_a_bound_stops_the_heap_growing_with_every_new_shape():
    unbounded = heap_growth_kib(False)
    if unbounded < 8 * 1024:
        pytest.skip(f"bf16 matmuls here grow no per-shape cache ({unbounded} KiB over 78 shapes): no oneDNN bf16 path")
    assert heap_growth_kib(True) < unbounded / 4


@pytest.mark.parametrize("enabled, rows, device, off", [(True, 1, "cpu", True), (True, 2, "cpu", False),
                                                       (False, 1, "cpu", False), (True, 1, "meta", False)])
def test_native_single_row_turns_onednn_off_only_for_one_row_on_the_cpu(enabled, rows, device, off):
    import torch

    from moestream.runtime.onednn import native_single_row

    with pytest.raises(KeyError):
        with native_single_row(enabled, rows, device):
            assert torch.backends.mkldnn.enabled is not off
            raise KeyError  # restored on the way out of an error too
    assert torch.backends.mkldnn.enabled


def test_interleaved_native_steps_never_leave_onednn_off():
    """Two engines' steps on two threads: the first to begin turns oneDNN off and on again; the second
    finds it off and leaves it alone, so that it is on once both have ended, whatever the order."""
    import torch

    from moestream.runtime.onednn import native_single_row

    first, second = native_single_row(True, 1, "cpu"), native_single_row(True, 1, "cpu")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize("raises", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_kept_module_runs_with_onednn_inside_a_native_step_and_without_after_it(rows, raises):
    import torch

    from moestream.runtime.onednn import NativeGemv

    inside, after = [], []

    def forward(module, args):
        inside.append(torch.backends.mkldnn.enabled)
        if raises:
            raise KeyError

    native, module = NativeGemv(True, "cpu"), torch.nn.Identity()
    native.keep_onednn([module])
    module.register_forward_pre_hook(forward)  # after keep_onednn's own
    with native.step(rows):
        with pytest.raises(KeyError) if raises else contextlib.nullcontext():
            module(torch.zeros(1))
        after.append(torch.backends.mkldnn.enabled)
    assert inside == [True] and after == [rows != 1] and torch.backends.mkldnn.enabled


def test_kept_modules_of_interleaved_steps_never_leave_onednn_off():
    """B's native step turns oneDNN off; A's step begins (it finds it off: it is not A's to restore); A's kept
    module begins; B's step ends (oneDNN on); A's module ends; A's step ends: oneDNN is on."""
    import torch

    from moestream.runtime.onednn import NativeGemv

    a, b = NativeGemv(True, "cpu"), NativeGemv(True, "cpu")
    b_step, a_step = b.step(1), a.step(1)

    class EndsB(torch.nn.Module):
        def forward(self, x):
            b_step.__exit__(None, None, None)
            return x

    module = EndsB()
    a.keep_onednn([module])
    b_step.__enter__()
    with a_step:
        module(torch.zeros(1))
    assert torch.backends.mkldnn.enabled


def test_no_hooks_where_not_enabled_or_not_on_the_cpu():
    import torch

    from moestream.runtime.onednn import NativeGemv

    assert NativeGemv(False, "cpu").keep_onednn([torch.nn.Identity()]) == []
    assert NativeGemv(True, "cuda").keep_onednn([torch.nn.Identity()]) == []


@pytest.mark.parametrize("native", [False, True])
def test_native_gemv_runs_decode_steps_of_one_sequence_without_onednn(tiny_checkpoint, native):
    """Prefill (several rows) keeps oneDNN; a decode step of one sequence runs without it when asked, but
    for its attention, and its tokens equal transformers' greedy steps run the same way."""
    import torch

    from moestream.runtime import Engine, EngineConfig
    from moestream.runtime.loader import dense_modules
    from tests.runtime.conftest import auto_class

    path, prompt = tiny_checkpoint("mixtral", dtype="bf16"), [5, 6, 7, 8, 9]
    seen, in_attention = [], []
    with Engine(path, EngineConfig(expert_budget=1.0, native_gemv=native)) as engine:
        engine.model.register_forward_pre_hook(lambda module, args: seen.append(torch.backends.mkldnn.enabled))
        for attention in dense_modules(engine.model)["attention"]:
            attention.register_forward_pre_hook(lambda module, args: in_attention.append(torch.backends.mkldnn.enabled))
        tokens = engine.generate([prompt], max_new_tokens=4).token_ids[0]
    assert seen == [True] + [not native] * 3
    assert in_attention and all(in_attention)
    assert tokens == _greedy(auto_class("mixtral").from_pretrained(path), prompt, 4, native)


def _greedy(model, prompt: list[int], num_tokens: int, native: bool) -> list[int]:
    """transformers' model, greedy, the prompt with oneDNN and (native) each later step without it but in
    its attention."""
    import inspect

    import torch

    from moestream.runtime.loader import dense_modules
    from moestream.runtime.onednn import NativeGemv

    gemv = NativeGemv(native, "cpu")
    gemv.keep_onednn(dense_modules(model)["attention"])
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5.x
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(num_tokens - 1):
            with gemv.step(1):
                past = out[name] if name in out else out["past_key_values"]
                out = model(input_ids=torch.tensor([tokens[-1:]]), use_cache=True, **{name: past})
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens
