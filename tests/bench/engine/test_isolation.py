"""Runs in a fresh process under a memory cgroup: which hierarchy is found, and a cap that holds."""

import sys

import pytest

from moestream.bench.engine import isolation


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setattr(isolation, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(isolation, "PROC_CGROUP", tmp_path / "proc-cgroup")
    return tmp_path


def test_the_unified_hierarchy_is_found_with_v2_file_names(fake_root):
    (fake_root / "cgroup" / "user.slice").mkdir(parents=True)
    (fake_root / "cgroup" / "cgroup.controllers").write_text("cpu memory\n")
    (fake_root / "proc-cgroup").write_text("0::/user.slice\n")
    group = isolation.own_cgroup()
    assert (group.path, group.version, group.limit_file) == (fake_root / "cgroup" / "user.slice", 2, "memory.max")
    assert group.swap_value(1 << 20) == "0" and group.describe == "cgroup v2 memory.max"


def test_a_v1_hierarchy_uses_the_memory_controller_s_own_directory(fake_root):
    (fake_root / "cgroup" / "memory" / "jobs" / "7").mkdir(parents=True)
    (fake_root / "proc-cgroup").write_text("5:cpu,cpuacct:/\n4:memory:/jobs/7\n0::/\n")
    group = isolation.own_cgroup()
    assert (group.path, group.version) == (fake_root / "cgroup" / "memory" / "jobs" / "7", 1)
    assert group.limit_file == "memory.limit_in_bytes" and group.swap_value(1 << 20) == str(1 << 20)


def test_without_a_memory_controller_the_cap_says_why(fake_root):
    (fake_root / "proc-cgroup").write_text("5:cpu:/\n")
    assert isolation.own_cgroup() is None
    assert "no memory cgroup" in isolation.cap_support()


@pytest.mark.skipif(isolation.cap_support() is not None, reason="no memory cgroup can be created here")
def test_a_process_over_its_cap_is_killed_and_one_within_it_runs():
    group = isolation.own_cgroup()
    grow = [sys.executable, "-c", "import sys; block = b'x' * (int(sys.argv[1]) << 20)"]
    with isolation._child_cgroup(group, 96 << 20) as path:
        with pytest.raises(isolation.RunFailed, match="killed"):
            isolation._call(grow + ["256"], {}, path / "cgroup.procs")
        isolation._call(grow + ["16"], {}, path / "cgroup.procs")
        peak = isolation._read_int(path / group.peak_file)  # None: a kernel without the file (v2 before 5.19)
        assert peak is None or peak >= 16 << 20
    assert not path.exists()  # removed after the runs
