"""Bounding oneDNN's per-shape caches: the variables are set only where the user has not, and on a CPU
whose bf16 matmuls go through oneDNN the bound stops the heap from growing with every new shape."""

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
