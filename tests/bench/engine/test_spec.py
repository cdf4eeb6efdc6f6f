"""bench engine's peak RSS is the run's own, whatever the parent that started it held."""

import subprocess
import sys

import numpy as np
import pytest

from moestream.bench.engine.spec import peak_rss_mib


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_process_reports_its_own_peak_not_its_parents():
    held = np.ones(768 * 2**20 // 8)  # 768 MiB touched in this (the parent) process
    assert peak_rss_mib() >= 768
    code = "from moestream.bench.engine.spec import peak_rss_mib; print(peak_rss_mib())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0 < child < 256  # Python and moestream's spec module alone
    del held
