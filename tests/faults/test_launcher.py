"""The launcher's supervision of one service, without a stack: a service that dies is restarted, at once and
then with growing delays; what its process group left behind is killed first; its log is appended to, never
truncated (two stacks of one checkout keep their logs)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hostproject.run import Service

pytestmark = pytest.mark.timeout(60)


def test_a_dying_service_is_restarted_with_backoff_and_its_group_killed(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild.pid"
    # Leaves a grandchild in its process group, then dies.
    script = (
        "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(marker)!r}, 'a').write(f'{{p.pid}}\\n'); sys.exit(3)"
    )
    service = Service("dies", [sys.executable, "-c", script], dict(os.environ), tmp_path)
    delays: list[float] = []  # per death: how long the launcher waits before the restart
    deadline = time.monotonic() + 30
    while len(delays) < 2 or service.restart_at is not None:
        waiting, pid = service.restart_at is not None, service.process.pid
        service.keep_alive()
        if not waiting and service.restart_at is not None:
            delays.append(service.restart_at - time.monotonic())
        elif not waiting and service.process.pid != pid:
            delays.append(0.0)  # restarted within the same call
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The groups of the two dead starts were killed (the third start may still be running).
    for grandchild in [int(pid) for pid in marker.read_text().split()][:2]:
        assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text()
    assert delays[0] <= 0 and 0.9 <= delays[1] <= 1.0  # at once after the first death, 1 s after the next
    service.stop()
    log = (tmp_path / "dies.log").read_text()
    assert log.count("starting:") == 3  # appended at every start, never truncated


def test_two_services_of_one_name_share_a_log_without_truncating_it(tmp_path: Path) -> None:
    for word in ("first", "second"):
        service = Service("web-1", [sys.executable, "-c", f"print({word!r})"], dict(os.environ), tmp_path)
        service.process.wait(30)
    log = (tmp_path / "web-1.log").read_text()
    assert "first" in log and "second" in log


def test_the_supervisors_engines_outlive_it_until_the_launcher_stops(tmp_path: Path) -> None:
    """The engine service (`adopts`): a dead supervisor's group is left running and named to the next start
    (which adopts its engines); the launcher kills those groups only when it stops."""
    marker = tmp_path / "engine.pid"
    script = (
        "import os, subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(marker)!r}, 'a').write(f'{{p.pid}} {{os.environ.get(\"LLMSERVE_ADOPT_GROUP\")}}\\n'); "
        "sys.exit(3) if not os.environ.get('LLMSERVE_ADOPT_GROUP') else time.sleep(60)"
    )
    service = Service("engine", [sys.executable, "-c", script], dict(os.environ), tmp_path, adopts=True)
    first = service.process.pid
    deadline = time.monotonic() + 30
    while service.process.pid == first:  # dies, and is started again at once
        service.keep_alive()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    while len(marker.read_text().splitlines()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (engine, _), (_, named) = (line.split() for line in marker.read_text().splitlines())
    assert named == str(first)  # the dead start's process group, for the next to adopt
    assert Path(f"/proc/{engine}").exists()  # its engine serves on
    service.stop()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{engine}").exists() and "Z" not in Path(f"/proc/{engine}/stat").read_text():
        assert time.monotonic() < deadline, "the left group was not killed at the end"
        time.sleep(0.05)
