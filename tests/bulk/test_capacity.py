"""How many bulk requests to keep on the bus: from replica heartbeats as the engine publishes them."""

from __future__ import annotations

from inference_engine.bus.protocol import ReplicaInfo
from llmserve.bulk import capacity


def replica(max_inflight: int = 16, num_blocks: int = 200, block_size: int = 16) -> ReplicaInfo:
    data = {
        "max_inflight": max_inflight,
        "config": {"max_num_seqs": max_inflight, "block_size": block_size},
        "stats": {"num_blocks": num_blocks, "num_free_blocks": num_blocks},
    }
    return ReplicaInfo("r", "m", data)


def test_a_replica_runs_its_batch_or_what_its_kv_cache_holds() -> None:
    assert capacity.replica_slots(replica(16), None) == 16  # nothing observed yet: the batch size
    assert capacity.replica_slots(replica(16), 100) == 16  # 7 blocks an item: 198 usable hold 28
    assert capacity.replica_slots(replica(16, num_blocks=200), 480) == 6  # 30 blocks an item
    assert capacity.replica_slots(replica(16, num_blocks=10), 5000) == 1  # never below one


def test_target_is_every_batch_full_and_one_waiting_within_the_bus_bound() -> None:
    replicas = [replica(16), replica(8)]
    assert capacity.bulk_target(replicas, None, max_queue=1024) == 48
    assert capacity.bulk_target(replicas, None, max_queue=40) == 40
    assert capacity.bulk_target([], None, max_queue=1024) == 0  # no live replica: nothing to send


def test_jobs_share_fairly_and_leave_nothing_idle() -> None:
    assert capacity.job_share(32, 1, {1: 0}) == 32  # alone: all of it
    assert capacity.job_share(32, 2, {1: 32, 2: 0}) == 16  # a newcomer is owed its half at once...
    assert capacity.job_share(32, 1, {1: 32, 2: 0}) == 32  # ...which the first gives up as items finish
    assert capacity.job_share(32, 1, {1: 20, 2: 12}) == 20
    assert capacity.job_share(32, 1, {1: 16, 2: 16}) == 16
    assert capacity.job_share(30, 3, {1: 10, 2: 10, 3: 10}) == 10
    assert capacity.job_share(32, 1, {1: 28, 2: 4}) == 28  # what a finishing job does not use is free
