"""How many bulk requests to keep on the bus: sized from the engines' heartbeats, shared fairly between jobs.

An engine replica runs at most ``max_inflight`` requests (its ``max_num_seqs``) and, for long items, at most
as many as its KV blocks hold. Bulk work should fill exactly that, plus one more batch waiting on the bus: the
engine reads its low-priority stream only while it has a free slot, so the waiting batch refills slots in the
very step they free up (with none waiting, every finished item leaves its slot empty for the round trip to the
runner and back), and it waits in Redis, not in the engine, so interactive requests, which come on their own
stream and preempt running bulk sequences, never queue behind it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from inference_engine.bus.protocol import ReplicaInfo


def replica_slots(replica: ReplicaInfo, tokens_per_item: float | None) -> int:
    """Sequences one replica can run at once for items of ``tokens_per_item`` (prompt + completion) tokens;
    None when that is not known yet."""
    data = replica.data
    slots = int(data.get("max_inflight") or data["config"]["max_num_seqs"])
    if tokens_per_item:
        blocks_per_item = math.ceil(tokens_per_item / data["config"]["block_size"])
        usable = replica.num_blocks - max(1, replica.num_blocks // 100)  # the scheduler's watermark
        slots = min(slots, max(1, usable // blocks_per_item))
    return slots


def bulk_target(replicas: Iterable[ReplicaInfo], tokens_per_item: float | None, max_queue: int) -> int:
    """Bulk requests to keep on the bus for one model, all jobs together: every replica's batch full and one
    batch waiting, within the bus's low-priority admission bound ``max_queue``."""
    running = sum(replica_slots(r, tokens_per_item) for r in replicas)
    return min(2 * running, max_queue)


def job_share(target: int, job_id: int, in_flight: Mapping[int, int]) -> int:
    """The part of ``target`` one job may use, given what each running job of the model has in flight
    (``in_flight`` maps job ids to counts, this job included).

    Every job is entitled to an equal share; what the others leave unused is free to take, so one job alone
    gets all of it, and a job that starts beside a running one gets its half as the other's items finish.
    """
    jobs = set(in_flight) | {job_id}
    others = sum(count for job, count in in_flight.items() if job != job_id)
    return max(math.ceil(target / len(jobs)), target - others)
