"""Prefix-aware routing across the replicas of one model.

Replicas that share the model's request stream take whatever they read first, which throws their prefix
caches away: a conversation's fourth turn lands on a replica that never saw the first three. So each replica
publishes what it served recently and how loaded it is, and the client sends an interactive request to the
replica that already holds the longest part of its prompt (or to the least loaded one) on that replica's own
stream, which the replica reads before the shared one.

What is published, and why text digests rather than the block manager's hashes: the web tier never has the
prompt's token ids (the engine owns the tokenizer and the chat template), and asking an engine to tokenize
first would cost a round trip to a busy engine per request. So the prefix is keyed by what both sides have,
the request itself: a chain of digests (blake2b, deterministic across processes, unlike Python's salted
`hash()` of str) over its leading pieces - one per chat message (a conversation's next turn repeats the
earlier messages, and a shared system prompt is the first message), one per `CHUNK_CHARS` characters of a
text prompt, one per `CHUNK_TOKENS` ids of a token prompt. Each digest covers everything before it, so a
prefix is one set-membership lookup per piece. The engine records the chain of every request it admits in a
sorted set (score: when last served), trimmed to the most recent ones, at most as many as its KV cache has
blocks (each piece takes at least about a block, so the cache cannot hold more prefixes than that): it
approximates the engine's LRU prefix cache without a hook into it. A digest whose blocks were evicted
meanwhile only costs a prefill; the answer is the same wherever a request runs.

Keys (per replica, all expiring with the replica's heartbeat): its sorted set of digests, a hash with its
load, and its request stream. Only interactive requests are routed: bulk ones stay on the shared
low-priority stream, where any replica with room takes them.

Policy per request (`choose`): the replica with the longest cached prefix wins, unless its load (requests in
flight plus those queued on its stream) exceeds the least loaded replica's by more than `margin`; then the
least loaded one. With fewer than two replicas publishing, the shared stream (policy ``shared``).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference_engine.bus import protocol as P

CHUNK_CHARS = 256
CHUNK_TOKENS = 64
MAX_DIGESTS = 256  # pieces of one prompt looked up at most (a longer prompt is routed by its start)
PREFIX, LEAST_LOADED, SHARED = "prefix", "least_loaded", "shared"


def summary_key(keys: P.Keys, replica: str) -> str:
    """The replica's sorted set of prefix digests (score: when it last served one)."""
    return f"{keys.prefix}:prefixes:{replica}"


def load_key(keys: P.Keys, replica: str) -> str:
    """The replica's load (a hash); while it exists, requests may be routed to the replica."""
    return f"{keys.prefix}:load:{replica}"


def routed_stream(keys: P.Keys, model: str, replica: str) -> str:
    """The replica's own interactive request stream (same consumer group as the shared one)."""
    return f"{keys.prefix}:reqr:{model}:{replica}"


def prefix_digests(message: P.Generate) -> list[tuple[str, int]]:
    """The request's chain of prefix digests, each with the length (characters or tokens) it covers."""
    seed = json.dumps([message.tools, message.chat_options], sort_keys=True) if message.messages else ""
    pieces: list[str]
    if message.messages is not None:
        pieces = [json.dumps(m, sort_keys=True) for m in message.messages]
    elif message.prompt is not None:
        text = message.prompt
        pieces = [text[i : i + CHUNK_CHARS] for i in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS)]
    else:
        ids = message.prompt_token_ids or []
        pieces = [
            ",".join(map(str, ids[i : i + CHUNK_TOKENS]))
            for i in range(0, len(ids) - CHUNK_TOKENS + 1, CHUNK_TOKENS)
        ]
    digest = hashlib.blake2b(seed.encode(), digest_size=12).digest()
    chain, covered = [], 0
    for piece in pieces[:MAX_DIGESTS]:
        digest = hashlib.blake2b(digest + piece.encode(), digest_size=12).digest()
        covered += len(piece) if message.prompt_token_ids is None else CHUNK_TOKENS
        chain.append((digest.hex(), covered))
    return chain


@dataclass
class Decision:
    policy: str  # PREFIX, LEAST_LOADED or SHARED
    replica: str | None = None  # None: the shared stream
    matched: int = 0  # characters (or tokens) of the prompt the chosen replica has served before


def replica_load(load: dict[str, str], queued: int) -> int:
    """Requests a replica has in flight, plus those routed to it that it has not read yet."""
    inflight = int(load.get("inflight", 0))
    return inflight + max(0, queued - int(load.get("inflight_routed", 0)))


def choose(loads: dict[str, int], matches: dict[str, int], margin: int) -> Decision:
    """Where a request goes: `loads` (replica -> load) and `matches` (replica -> prefix length it holds)."""
    if len(loads) < 2:
        return Decision(SHARED)
    least = min(loads.values())
    best = max(matches.values(), default=0)
    if best > 0:
        holders = [r for r, m in matches.items() if m == best]
        replica = min(holders, key=lambda r: loads[r])
        if loads[replica] - least <= margin:
            return Decision(PREFIX, replica, best)
    return Decision(LEAST_LOADED, random.choice([r for r, load in loads.items() if load == least]))


def longest_match(digests: list[tuple[str, int]], scores: list[Any]) -> int:
    """The length covered by the longest digest of the chain that a replica's set holds."""
    found = [covered for (_, covered), score in zip(digests, scores, strict=True) if score is not None]
    return max(found, default=0)


# Who wants to hear of each routing decision (the web tier's /metrics counter): (model, policy) callbacks.
_listeners: list[Callable[[str, str], None]] = []


def on_route(listener: Callable[[str, str], None]) -> None:
    _listeners.append(listener)


def routed(model: str, policy: str) -> None:
    for listener in _listeners:
        listener(model, policy)


class Summary:
    """The engine side: the digests of what it admitted since the last publish, and when to publish."""

    def __init__(self, keys: P.Keys, replica: str, size: int, interval: float, ttl: float) -> None:
        self.keys, self.replica = keys, replica
        self.size, self.interval, self.ttl = size, interval, ttl
        self._new: dict[str, float] = {}
        self._next = 0.0

    def record(self, message: P.Generate) -> None:
        now = time.time()
        for digest, _ in prefix_digests(message):
            self._new[digest] = now

    def due(self, force: bool = False) -> bool:
        """Whether to publish now (at most every `interval`, unless forced); if so, the next is `interval`
        away."""
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.interval
        return True

    def publish(self, pipe: Any, load: dict[str, int]) -> None:
        """Queues on `pipe` the digests recorded since the last publish, the load, and both keys' expiry."""
        summary, ttl = summary_key(self.keys, self.replica), int(self.ttl * 1000)
        if self._new:
            pipe.zadd(summary, self._new)
            pipe.zremrangebyrank(summary, 0, -self.size - 1)
            self._new = {}
        pipe.pexpire(summary, ttl)
        pipe.hset(load_key(self.keys, self.replica), mapping=load)
        pipe.pexpire(load_key(self.keys, self.replica), ttl)
