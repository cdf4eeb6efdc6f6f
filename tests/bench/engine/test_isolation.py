"""Runs in a fresh process under a memory cgroup: which hierarchy is found, and a cap that holds."""

import sys

import pytest

from moestream.bench.engine import isolation


def test_a_limit_that_cannot_be_written_leaves_no_cgroup_behind(tmp_path):
    group = isolation.MemoryCgroup(tmp_path / "group", 1, "no-such-dir/memory.limit_in_bytes", "peak")
    group.path.mkdir()
    with pytest.raises(OSError):
        with isolation._child_cgroup(group, 1 << 20):
            pass
    assert list(group.path.iterdir()) == []


def test_without_a_memory_controller_the_cap_says_why(tmp_path):
    (tmp_path / "proc-cgroup").write_text("5:cpu:/\n")
    assert "no memory cgroup" in isolation.cap_support(tmp_path / "cgroup", tmp_path / "proc-cgroup")


@pytest.fixture
def real_cgroup():
    reason = isolation.cap_support()
    if reason is not None:
        pytest.skip(f"no memory cgroup can be created here: {reason}")
    return isolation.own_cgroup()


def test_a_process_over_its_cap_is_killed_and_the_cap_holds(real_cgroup):
    grow = [sys.executable, "-c", "import sys; block = b'x' * (int(sys.argv[1]) << 20)"]
    with isolation._child_cgroup(real_cgroup, 96 << 20) as path:
        with pytest.raises(isolation.RunFailed, match="killed"):
            isolation.call(grow + ["256"], {}, path / "cgroup.procs")
        peak = isolation._read_int(path / real_cgroup.peak_file)  # None: a kernel without the file (v2 before 5.19)
        assert peak is None or peak <= 96 << 20
    assert not path.exists()  # removed after the run


def test_a_process_within_its_cap_runs_and_its_peak_is_charged(real_cgroup):
    grow = [sys.executable, "-c", "import sys; block = b'x' * (int(sys.argv[1]) << 20)"]
    with isolation._child_cgroup(real_cgroup, 256 << 20) as path:
        isolation.call(grow + ["64"], {}, path / "cgroup.procs")
        peak = isolation._read_int(path / real_cgroup.peak_file)
        assert peak is None or 64 << 20 <= peak <= 256 << 20


GRANDPARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def test_a_run_past_its_timeout_fails_in_one_line_and_ends_what_it_started(tmp_path):
    import os
    import time

    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(isolation.RunFailed, match="no result within 2 s"):
        isolation.call([sys.executable, "-c", GRANDPARENT, str(pid_file)], dict(os.environ), timeout_s=2)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, killed and waiting for init to reap it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
