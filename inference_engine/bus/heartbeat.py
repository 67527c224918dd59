"""A replica's heartbeat, published from a thread so that a long scheduler step never looks like death."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from typing import Any

import redis

from inference_engine.bus import routing
from inference_engine.bus.protocol import Keys

log = logging.getLogger(__name__)


def new_replica_id() -> str:
    """This process's replica id: host and pid first, so that the process's supervisor can find it."""
    return f"{process_prefix(socket.gethostname(), os.getpid())}{uuid.uuid4().hex[:6]}"


def process_prefix(host: str, pid: int) -> str:
    return f"{host}-{pid}-"


def withdraw_process(client: redis.Redis, keys: Keys, model: str, host: str, pid: int) -> list[str]:
    """Withdraw the replicas a dead process left behind, at once rather than when their heartbeats expire:
    clients waiting on them fail over (or fail cleanly) within a poll instead of a TTL. Returns their ids."""
    prefix = process_prefix(host, pid)
    gone = [r for r in client.smembers(keys.replicas(model)) if _text(r).startswith(prefix)]
    if gone:
        with client.pipeline(transaction=False) as pipe:
            for replica in gone:
                pipe.delete(keys.replica(_text(replica)), *_routing_keys(keys, _text(replica)))
                pipe.srem(keys.replicas(model), replica)
            pipe.execute()
    return [_text(r) for r in gone]


def _routing_keys(keys: Keys, replica: str) -> list[str]:
    """The replica's routing summary and load (`routing`), which live and die with its heartbeat."""
    return [routing.summary_key(keys, replica), routing.load_key(keys, replica)]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Heartbeat:
    """Publishes `payload` every `interval` seconds under a key that expires after `ttl` seconds.

    The key's existence is the replica's liveness: other replicas claim the pending requests of a consumer
    whose key is gone, and clients stop waiting for a model none of whose keys exist.
    """

    def __init__(
        self, redis_url: str, keys: Keys, replica_id: str, model: str, interval: float, ttl: float
    ) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.keys, self.replica_id, self.model = keys, replica_id, model
        self.interval, self.ttl = interval, ttl
        self.payload: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-heartbeat", daemon=True)

    def beat(self) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.replica(self.replica_id), json.dumps(self.payload), px=int(self.ttl * 1000))
            for key in _routing_keys(self.keys, self.replica_id):
                pipe.pexpire(key, int(self.ttl * 1000))
            pipe.sadd(self.keys.replicas(self.model), self.replica_id)
            pipe.sadd(self.keys.models, self.model)
            pipe.execute()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except redis.RedisError as exc:  # Redis is down: the main loop reconnects; keep trying
                log.debug("heartbeat failed: %s", exc)

    def stop(self) -> None:
        """Stop beating and withdraw the replica at once (clients see it gone without waiting a TTL)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval + 1)
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.replica(self.replica_id), *_routing_keys(self.keys, self.replica_id))
                pipe.srem(self.keys.replicas(self.model), self.replica_id)
                pipe.execute()
        except redis.RedisError:
            pass
        self.redis.close()
