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
    assert group.swap_settings(1 << 20) == (("memory.swap.max", "0"),) and group.label == "cgroup v2 memory.max"


def test_a_v1_hierarchy_uses_the_memory_controller_s_own_directory(fake_root):
    (fake_root / "cgroup" / "memory" / "jobs" / "7").mkdir(parents=True)
    (fake_root / "proc-cgroup").write_text("5:cpu,cpuacct:/\n4:memory:/jobs/7\n0::/\n")
    group = isolation.own_cgroup()
    assert (group.path, group.version) == (fake_root / "cgroup" / "memory" / "jobs" / "7", 1)
    assert group.limit_file == "memory.limit_in_bytes"
    assert dict(group.swap_settings(1 << 20)) == {"memory.memsw.limit_in_bytes": str(1 << 20), "memory.swappiness": "0"}


def test_a_v1_container_s_cgroup_is_its_mount(fake_root):
    """In a container the memory mount is the container's own cgroup: the path /proc names is not under it."""
    (fake_root / "cgroup" / "memory").mkdir(parents=True)
    (fake_root / "proc-cgroup").write_text("4:memory:/docker/0123abcd\n")
    assert isolation.own_cgroup().path == fake_root / "cgroup" / "memory"


def test_a_limit_that_cannot_be_written_leaves_no_cgroup_behind(fake_root):
    group = isolation.MemoryCgroup(fake_root / "group", 1, "no-such-dir/memory.limit_in_bytes", "peak")
    group.path.mkdir()
    with pytest.raises(OSError):
        with isolation._child_cgroup(group, 1 << 20):
            pass
    assert list(group.path.iterdir()) == []


def test_without_a_memory_controller_the_cap_says_why(fake_root):
    (fake_root / "proc-cgroup").write_text("5:cpu:/\n")
    assert isolation.own_cgroup() is None
    assert "no memory cgroup" in isolation.cap_support()


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
            isolation._call(grow + ["256"], {}, path / "cgroup.procs")
        peak = isolation._read_int(path / real_cgroup.peak_file)  # None: a kernel without the file (v2 before 5.19)
        assert peak is None or peak <= 96 << 20
    assert not path.exists()  # removed after the run


def test_a_process_within_its_cap_runs_and_its_peak_is_charged(real_cgroup):
    grow = [sys.executable, "-c", "import sys; block = b'x' * (int(sys.argv[1]) << 20)"]
    with isolation._child_cgroup(real_cgroup, 256 << 20) as path:
        isolation._call(grow + ["64"], {}, path / "cgroup.procs")
        peak = isolation._read_int(path / real_cgroup.peak_file)
        assert peak is None or 64 << 20 <= peak <= 256 << 20
