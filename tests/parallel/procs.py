"""Processes a test started, found again by a mark in their environment (children and grandchildren
inherit it, whoever adopted them since)."""

import os
import uuid
from pathlib import Path

MARK = "MOESTREAM_TEST_MARK"


def new_mark() -> dict[str, str]:
    """Environment variables that mark every process started with them."""
    return {MARK: uuid.uuid4().hex}


def marked(mark: dict[str, str]) -> list[int]:
    """The live processes (not zombies) whose environment carries the mark."""
    needle = f"{MARK}={mark[MARK]}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found
