"""This process's memory cgroup: where it is, which files limit and measure it, and how much of its
limit is left. Reads /proc and /sys only; knows nothing of what the memory is for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup in each hierarchy
NO_LIMIT = 1 << 60  # v1 writes 'no limit' as a number near 2**63


@dataclass(frozen=True)
class MemoryCgroup:
    """This process's memory cgroup and the names of the files that limit and measure a child."""

    path: Path
    version: int  # 2: the unified hierarchy; 1: the memory controller's own
    limit_file: str
    peak_file: str

    def headroom_bytes(self) -> int | None:
        """The limit less what the cgroup uses now, or None where it has no limit (or cannot be read)."""
        try:
            limit = (self.path / self.limit_file).read_text().strip()
            used = int((self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).read_text())
        except (OSError, ValueError):
            return None
        return None if limit == "max" or int(limit) >= NO_LIMIT else max(0, int(limit) - used)

    @property
    def label(self) -> str:
        return f"cgroup v{self.version} {self.limit_file}"

    def swap_settings(self, limit_bytes: int) -> tuple[tuple[str, str], ...]:
        """(file, value) that forbid swap beyond the limit, each written where the kernel has the file:
        v2 swap.max 0; v1 memory + swap at the memory limit, and swappiness 0 where swap is not counted."""
        if self.version == 2:
            return (("memory.swap.max", "0"),)
        return ("memory.memsw.limit_in_bytes", str(limit_bytes)), ("memory.swappiness", "0")


def own_cgroup(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> MemoryCgroup | None:
    """This process's memory cgroup (v2, else v1's memory controller), or None; `root` and `proc`: for tests."""
    lines = proc.read_text().splitlines() if proc.is_file() else []
    if (root / "cgroup.controllers").is_file():
        path = next((line[3:] for line in lines if line.startswith("0::")), None)
        return None if path is None else MemoryCgroup(root / path.lstrip("/"), 2, "memory.max", "memory.peak")
    mount = root / "memory"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and mount.is_dir():
            group = mount / path.lstrip("/")  # a container's mount is its own cgroup: the path is not under it
            return MemoryCgroup(group if group.is_dir() else mount, 1, "memory.limit_in_bytes",
                                "memory.max_usage_in_bytes")
    return None
