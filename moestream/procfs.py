"""This process's own figures from Linux's /proc/self/status; None where it is absent (other systems).
Knows nothing of what they are used for."""

from __future__ import annotations


def status_field(name: str) -> str | None:
    """The value of a /proc/self/status field (e.g. 'VmHWM' -> '861232 kB'), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key == name:
                    return value.strip()
    except OSError:
        pass
    return None


def status_mib(name: str) -> float | None:
    """A /proc/self/status size field in MiB (e.g. 'VmRSS'), or None."""
    value = status_field(name)  # '861232 kB'
    return int(value.split()[0]) / 1024 if value is not None else None
