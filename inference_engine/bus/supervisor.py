"""The engine supervisor: one engine process per served model, loaded and unloaded by control messages.

Each model runs as a child `python -m inference_engine serve` process, so a model's crash, memory and
threads stay its own, and unloading it returns all of its memory. The control stream is read through a
consumer group, so load/unload messages sent while the supervisor was down are handled when it comes back.
A child that dies unexpectedly is withdrawn from the bus at once (its heartbeat deleted: clients waiting on it
hear within a poll, not a heartbeat TTL) and restarted as `backoff` says (at once the first time, with a
growing delay while it keeps dying; given up on after `MAX_QUICK_RESTARTS` quick restarts in a row); the new
process takes over its predecessor's pending requests.

With ``spares`` the supervisor also keeps one standby process per model (`serve --standby`: model loaded, not
on the bus), started once the model has served for a while. When the serving process dies, the spare takes
over at once (a signal puts it on the bus) instead of the model being loaded anew, and a new spare is started.
Loading a model takes seconds to minutes; this turns an engine crash into an outage of about one poll.

The engines outlive their supervisor: a supervisor started with ``LLMSERVE_ADOPT_GROUP`` set to the process
groups (comma-separated) of those that died before it (the launcher sets it when it restarts one) adopts the
``serve`` processes there, serving and spare, instead of loading their models again, so its death interrupts
no request. It watches them through /proc (only their dead parent could wait for them) and restarts them, if
they die later, with its own default engine arguments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from inference_engine.bus import protocol as P
from inference_engine.bus.backoff import RestartBackoff
from inference_engine.bus.heartbeat import withdraw_process
from inference_engine.config import engine_flags

log = logging.getLogger(__name__)

CONTROL_GROUP = "supervisor"
MAX_QUICK_RESTARTS = 5  # a child that died this often in a row soon after its start is given up on
SPARE_AFTER = 10.0  # seconds a model serves before its spare starts loading (not competing with its start)
ADOPT_GROUP_ENV = "LLMSERVE_ADOPT_GROUP"  # see the module docstring


@dataclass
class _Child:
    name: str
    model: str | None
    engine_args: dict[str, Any]
    process: subprocess.Popen | Adopted
    backoff: RestartBackoff = field(default_factory=lambda: RestartBackoff(MAX_QUICK_RESTARTS))
    state: str = "running"  # "running" | "restarting" (at `restart_at`) | "failed"
    restart_at: float = 0.0
    started: float = field(default_factory=time.monotonic)
    spare: subprocess.Popen | Adopted | None = None  # a standby `serve` process, loaded, waiting for SIGUSR1


class Adopted:
    """A `serve` process an earlier supervisor started, with the `subprocess.Popen` methods the supervisor
    uses. Its exit status goes to its new parent (init), so `returncode` is -1 once it is gone."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None and not _running(self.pid):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _serve_processes(group: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the `python -m inference_engine serve` processes in a process group."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            pgrp = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if pgrp == group and argv[1:4] == ["-m", "inference_engine", "serve"] and _running(int(proc.name)):
            found.append((int(proc.name), argv))
    return found


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def serve_command(
    redis_url: str, name: str, model: str | None, engine_args: dict[str, Any], prefix: str, extra: list[str]
) -> list[str]:
    """The `serve` command line for one model; `engine_args` uses EngineConfig / CLI names (dashes or not)."""
    cmd = [
        sys.executable,
        "-m",
        "inference_engine",
        "serve",
        "--redis-url",
        redis_url,
        "--served-model-name",
        name,
        "--prefix",
        prefix,
    ]
    if model:
        cmd += ["--model", model]
    return cmd + engine_flags(engine_args) + extra


class Supervisor:
    def __init__(
        self,
        redis_url: str,
        name: str = "default",
        prefix: str = P.DEFAULT_PREFIX,
        serve_extra: list[str] | None = None,
        heartbeat_interval: float = 1.0,
        default_engine_args: dict[str, Any] | None = None,
        spares: bool = False,
    ) -> None:
        self.spares = spares
        self.redis_url, self.name, self.prefix = redis_url, name, prefix
        self.default_engine_args = default_engine_args or {}
        self.serve_extra = serve_extra or []
        self.heartbeat_interval = heartbeat_interval
        self.keys = P.Keys(prefix)
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=10)
        self.children: dict[str, _Child] = {}
        self._stopping = threading.Event()
        for group in os.environ.get(ADOPT_GROUP_ENV, "").split(","):
            if group.isdigit():
                self.adopt(int(group))

    def adopt(self, group: int) -> None:
        """Take over the `serve` processes a dead supervisor left in process group `group` (see the module
        docstring): per model, the one serving (a spare that took over still has ``--standby`` in its command
        line: its live replica on the bus tells) and its spare; a model with only a spare left gets it on the
        bus; anything more is stopped."""
        found: dict[str, list[tuple[int, list[str]]]] = {}
        for pid, argv in _serve_processes(group):
            name = _flag(argv, "--served-model-name")
            if name is None:  # nothing this supervisor would have started
                os.kill(pid, signal.SIGTERM)
                continue
            found.setdefault(name, []).append((pid, argv))
        now = time.monotonic()
        for name, processes in found.items():
            live = self._serving_pids(name)
            processes.sort(key=lambda p: ("--standby" in p[1] and p[0] not in live, p[0]))
            (pid, argv), *rest = processes
            if "--standby" in argv and pid not in live:  # its serving process died too
                os.kill(pid, signal.SIGUSR1)
            child = _Child(name, _flag(argv, "--model"), {}, Adopted(pid), started=now)
            if rest:
                child.spare = Adopted(rest[0][0])
            for extra, _ in rest[1:]:
                os.kill(extra, signal.SIGTERM)
            self.children[name] = child
            spare = rest[0][0] if rest else None
            log.warning("adopted %r (pid %s, spare %s) from a supervisor that died", name, pid, spare)

    def _serving_pids(self, model: str) -> set[int]:
        """Pids of this host's processes with a live replica of `model` on the bus."""
        host = socket.gethostname()
        try:
            replicas = sorted(self.redis.smembers(self.keys.replicas(model)))
            beats = self.redis.mget([self.keys.replica(r) for r in replicas]) if replicas else []
        except redis.RedisError:
            return set()
        live = [r for r, beat in zip(replicas, beats, strict=True) if beat is not None]
        prefix = f"{host}-"
        return {
            int(r[len(prefix) :].split("-", 1)[0])
            for r in live
            if r.startswith(prefix) and r[len(prefix) :].split("-", 1)[0].isdigit()
        }

    def stop(self) -> None:
        self._stopping.set()

    def load(self, name: str, model: str | None, engine_args: dict[str, Any]) -> None:
        if name in self.children and self.children[name].process.poll() is None:
            log.info("model %r is already loaded", name)
            return
        cmd = self._command(name, model, engine_args)
        log.info("loading %r: %s", name, " ".join(cmd))
        self.children[name] = _Child(name, model, engine_args, subprocess.Popen(cmd))

    def unload(self, name: str, timeout: float = 30.0) -> None:
        child = self.children.pop(name, None)
        if child is None:
            log.info("model %r is not loaded", name)
            return
        log.info("unloading %r", name)
        for process in (child.process, child.spare):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)  # the engine drains, then withdraws its heartbeat
        for process in (child.process, child.spare):
            if process is None:
                continue
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def run(self) -> None:
        stream = self.keys.control(self.name)
        try:
            self.redis.xgroup_create(stream, CONTROL_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._beat()  # clients refuse to send control messages to a supervisor that is not alive
        next_beat = 0.0
        try:
            while not self._stopping.is_set():
                try:
                    self._reap()
                    reply = self.redis.xreadgroup(
                        CONTROL_GROUP, f"{self.name}-{os.getpid()}", {stream: ">"}, count=16, block=500
                    )
                    for _, items in reply or ():
                        for entry_id, fields in items:
                            self._handle(P.parse(fields))
                            self.redis.xack(stream, CONTROL_GROUP, entry_id)
                    if time.monotonic() >= next_beat:
                        next_beat = time.monotonic() + self.heartbeat_interval
                        self._beat()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    log.warning("lost Redis (%s); retrying", exc)
                    self._stopping.wait(1.0)
                except redis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    self.redis.xgroup_create(stream, CONTROL_GROUP, id="0", mkstream=True)
        finally:
            for name in list(self.children):
                self.unload(name)
            self.redis.delete(self.keys.supervisor(self.name))

    def _command(self, name: str, model: str | None, engine_args: dict[str, Any]) -> list[str]:
        args = {**self.default_engine_args, **engine_args}
        return serve_command(self.redis_url, name, model, args, self.prefix, self.serve_extra)

    def _handle(self, message: P.Message) -> None:
        try:
            if isinstance(message, P.Load):
                self.load(message.name, message.model, message.engine_args or {})
            elif isinstance(message, P.Unload):
                self.unload(message.name)
            else:
                log.warning("unknown control message %r", message)
        except Exception:
            log.exception("control message %r failed", message)

    def _reap(self) -> None:
        now = time.monotonic()
        for child in self.children.values():
            if child.state == "restarting" and now >= child.restart_at:
                child.state, child.started = "running", now
                child.process = subprocess.Popen(self._command(child.name, child.model, child.engine_args))
            if child.state != "running":
                continue
            if child.process.poll() is None:
                self._keep_spare(child, now)
                continue
            withdrawn = withdraw_process(
                self.redis, self.keys, child.name, socket.gethostname(), child.process.pid
            )
            if child.spare is not None and child.spare.poll() is None:
                log.warning(
                    "model %r exited with %s (replicas withdrawn: %s); its spare takes over",
                    child.name,
                    child.process.returncode,
                    withdrawn,
                )
                child.spare.send_signal(signal.SIGUSR1)
                child.process, child.spare, child.started = child.spare, None, now
                continue
            delay = child.backoff.died(now - child.started)
            if child.backoff.given_up:
                log.error("model %r keeps dying (exit %s); giving up", child.name, child.process.returncode)
                child.state = "failed"
                continue
            log.warning(
                "model %r exited with %s (replicas withdrawn: %s); restarting in %gs",
                child.name,
                child.process.returncode,
                withdrawn,
                delay,
            )
            child.state, child.restart_at = "restarting", now + delay

    def _keep_spare(self, child: _Child, now: float) -> None:
        if not self.spares or now - child.started < SPARE_AFTER:
            return
        if child.spare is None or child.spare.poll() is not None:
            command = [*self._command(child.name, child.model, child.engine_args), "--standby"]
            child.spare = subprocess.Popen(command)

    def _beat(self) -> None:
        children = {
            c.name: {
                "pid": c.process.pid,
                "model": c.model,
                "state": c.state,
                "restarts": c.backoff.failures,
                "spare": c.spare.pid if c.spare is not None and c.spare.poll() is None else None,
            }
            for c in self.children.values()
        }
        payload = json.dumps({"pid": os.getpid(), "children": children})
        self.redis.set(self.keys.supervisor(self.name), payload, px=int(self.heartbeat_interval * 5000))
