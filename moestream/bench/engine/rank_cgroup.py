"""`python -m moestream.bench.engine.rank_cgroup PREFIX COMMAND...`: enters the memory cgroup PREFIX followed
by this process's LOCAL_RANK (torchrun sets it; 0 without), then becomes COMMAND (exec). Started by torchrun,
it puts each rank under its own memory limit (isolation.rank_cgroups made the cgroups); what the rank
allocates from then on is charged to its cgroup. Knows nothing of what the rank runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    prefix, command = argv[0], argv[1:]
    Path(f"{prefix}{os.environ.get('LOCAL_RANK', '0')}/cgroup.procs").write_text(str(os.getpid()))
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
