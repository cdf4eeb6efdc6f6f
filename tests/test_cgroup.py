"""This process's memory cgroup: which hierarchy is found, and how much of a limit is left."""

from moestream.cgroup import MemoryCgroup, own_cgroup


def _own(root):
    return own_cgroup(root / "cgroup", root / "proc-cgroup")


def test_the_unified_hierarchy_is_found_with_v2_file_names(tmp_path):
    (tmp_path / "cgroup" / "user.slice").mkdir(parents=True)
    (tmp_path / "cgroup" / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "proc-cgroup").write_text("0::/user.slice\n")
    group = _own(tmp_path)
    assert (group.path, group.version, group.limit_file) == (tmp_path / "cgroup" / "user.slice", 2, "memory.max")
    assert group.swap_settings(1 << 20) == (("memory.swap.max", "0"),) and group.label == "cgroup v2 memory.max"


def test_a_v1_hierarchy_uses_the_memory_controller_s_own_directory(tmp_path):
    (tmp_path / "cgroup" / "memory" / "jobs" / "7").mkdir(parents=True)
    (tmp_path / "proc-cgroup").write_text("5:cpu,cpuacct:/\n4:memory:/jobs/7\n0::/\n")
    group = _own(tmp_path)
    assert (group.path, group.version) == (tmp_path / "cgroup" / "memory" / "jobs" / "7", 1)
    assert group.limit_file == "memory.limit_in_bytes"
    assert dict(group.swap_settings(1 << 20)) == {"memory.memsw.limit_in_bytes": str(1 << 20), "memory.swappiness": "0"}


def test_a_v1_container_s_cgroup_is_its_mount(tmp_path):
    """In a container the memory mount is the container's own cgroup: the path /proc names is not under it."""
    (tmp_path / "cgroup" / "memory").mkdir(parents=True)
    (tmp_path / "proc-cgroup").write_text("4:memory:/docker/0123abcd\n")
    assert _own(tmp_path).path == tmp_path / "cgroup" / "memory"


def test_headroom_is_the_limit_less_the_usage_and_none_without_a_limit(tmp_path):
    v2 = MemoryCgroup(tmp_path, 2, "memory.max", "memory.peak")
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("300\n")
    assert v2.headroom_bytes() == 700
    (tmp_path / "memory.max").write_text("max\n")
    assert v2.headroom_bytes() is None
    v1 = MemoryCgroup(tmp_path, 1, "memory.limit_in_bytes", "memory.max_usage_in_bytes")
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory.usage_in_bytes").write_text("300\n")
    assert v1.headroom_bytes() is None
