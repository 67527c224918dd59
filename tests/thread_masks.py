"""The CPUs each thread of this process may run on, read from /proc (Linux): what a test of thread placement
compares before and after."""

from __future__ import annotations

from pathlib import Path

TASKS = Path("/proc/self/task")


def thread_masks() -> dict[int, set[int]]:
    """Every thread of this process and the CPUs it may run on."""
    masks = {}
    for task in TASKS.iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        masks[int(task.name)] = cpus_of(line.split(":", 1)[1].strip())
    return masks


def cpus_of(ranges: str) -> set[int]:
    cpus = set()
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus
