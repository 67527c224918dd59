"""The loop one bulk task runs: keep up to ``BULK_CONCURRENCY`` items in flight on the bus, store each result
as it arrives, and hand over to a fresh task after ``BULK_SLICE_SECONDS``.

Threads only wait on the bus (one blocking `EngineClient.generate` per in-flight item); every database write
happens on the runner's own thread, each one a single conditional UPDATE, so SQLite and concurrent runners
stay simple. Nothing here trusts the broker to deliver exactly once:

- an item is claimed by bumping ``attempts`` from the value read (compare-and-swap) and leasing it; the lease
  is renewed while the request runs, so only a dead runner's items become claimable again;
- the bus request id is derived from (job, item, attempt): a new attempt aborts the previous attempt's request
  by id, and the bus refuses a duplicate id;
- a result is stored only if the item is still pending, so at most one result per item is ever stored.

Engine outages (no live replica, a replica dying mid-request, overload) put the item back with a short
backoff; only errors that would recur (invalid request, prompt too long) mark an item failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta

from django.db.models import Min, Q
from django.utils import timezone

from inference_engine.bus.client import EngineClient, GenerationResult
from inference_engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    ModelNotFoundError,
)
from llmserve import conf
from llmserve.bulk import requests
from llmserve.bulk.models import BulkItem, BulkJob

log = logging.getLogger("llmserve.bulk")

TRANSIENT = (EngineUnavailableError, ModelNotFoundError, EngineOverloadedError)
BACKOFF = 1.0  # seconds before retrying after an engine outage
POLL = 0.25  # seconds between checks of the job's status while waiting on results


@dataclass
class _Flight:
    item_id: int
    index: int
    attempt: int
    request: requests.ItemRequest


class JobRunner:
    """Runs one slice of a job. `run()` returns whether work remains for another task."""

    def __init__(self, job_id: int, client: EngineClient, *, on_handover: Callable[[], None]) -> None:
        self.job_id, self.client, self.on_handover = job_id, client, on_handover
        self.concurrency = int(conf.get("BULK_CONCURRENCY"))
        self.lease = timedelta(seconds=float(conf.get("BULK_LEASE_SECONDS")))
        self.deadline = time.monotonic() + float(conf.get("BULK_SLICE_SECONDS"))
        self.flights: dict[Future[GenerationResult], _Flight] = {}
        self.paused_until = 0.0
        self.handed_over = False
        self.aborted = False

    def run(self) -> bool:
        now = timezone.now()
        BulkJob.objects.filter(pk=self.job_id, status=BulkJob.Status.QUEUED).update(
            status=BulkJob.Status.RUNNING, started_at=now
        )
        self.job = BulkJob.objects.get(pk=self.job_id)
        if not self.job.is_active:
            return False
        self.params = None if not self.job.template else requests.job_params(self.job.params)
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"bulk-{self.job_id}") as pool:
            try:
                return self._loop(pool)
            finally:
                for flight in self.flights.values():  # only non-empty when leaving by an exception
                    self.client.abort(self.job.model, self.job.request_id(flight.index, flight.attempt))

    def _loop(self, pool: ThreadPoolExecutor) -> bool:
        next_renewal = time.monotonic() + self.lease.total_seconds() / 3
        while True:
            status = BulkJob.objects.values_list("status", flat=True).get(pk=self.job_id)
            if status not in BulkJob.ACTIVE:
                self._abort_all()
                return False
            if status == BulkJob.Status.CANCELLING and not self.aborted:
                self._abort_all()
            now = time.monotonic()
            claiming = status == BulkJob.Status.RUNNING and now < self.deadline
            if claiming and now >= self.paused_until:
                self._claim(pool)
            if not claiming and not self.handed_over and self._others_pending():
                self.handed_over = True
                self.on_handover()  # the next slice starts while this one drains
            if not self.flights:
                if not claiming:
                    return self._finish(status)
                if not self._wait_for_others():
                    return self._finish(status)
                continue
            done, _ = wait(self.flights, timeout=POLL, return_when=FIRST_COMPLETED)
            for future in done:
                self._settle(self.flights.pop(future), future)
            if time.monotonic() >= next_renewal and self.flights:
                BulkItem.objects.filter(
                    pk__in=[f.item_id for f in self.flights.values()], status=BulkItem.Status.PENDING
                ).update(lease_until=timezone.now() + self.lease)
                next_renewal = time.monotonic() + self.lease.total_seconds() / 3

    # -------------------------------------------------------------------------------------------- claiming

    def _claimable(self) -> Q:
        return Q(lease_until__isnull=True) | Q(lease_until__lt=timezone.now())

    def _claim(self, pool: ThreadPoolExecutor) -> None:
        # BULK_CONCURRENCY bounds the whole job, not this task: while a previous slice drains, or a
        # redelivered task runs beside a live one, their leased items count too, so interactive traffic
        # keeps its slots.
        leased = self.job.items.filter(
            status=BulkItem.Status.PENDING, lease_until__gte=timezone.now()
        ).count()
        free = self.concurrency - max(leased, len(self.flights))
        if free <= 0:
            return
        pending = BulkItem.objects.filter(
            self._claimable(), job_id=self.job_id, status=BulkItem.Status.PENDING
        )
        candidates = pending.order_by("index").values_list("pk", "index", "attempts", "input")[: free * 2]
        for pk, index, attempts, item_input in candidates:
            if free == 0:
                break
            won = BulkItem.objects.filter(pk=pk, status=BulkItem.Status.PENDING, attempts=attempts).update(
                attempts=attempts + 1, lease_until=timezone.now() + self.lease
            )
            if not won:
                continue  # another runner took it
            try:
                request = requests.build(self.job, self.params, item_input)
            except requests.ItemError as exc:
                self._store_failure(pk, exc)
                continue
            flight = _Flight(pk, index, attempts + 1, request)
            self.flights[pool.submit(self._generate, flight)] = flight
            free -= 1

    def _generate(self, flight: _Flight) -> GenerationResult:
        model = self.job.model
        if flight.attempt > 1:  # a dead runner's request may still hold a batch slot
            self.client.abort(model, self.job.request_id(flight.index, flight.attempt - 1))
        request = flight.request
        with self.client.generate(
            model,
            request.prompt,
            request.params,
            messages=request.messages,
            tools=request.tools,
            request_id=self.job.request_id(flight.index, flight.attempt),
            priority=self.job.priority,
        ) as stream:
            return stream.result()

    def _others_pending(self) -> bool:
        mine = [f.item_id for f in self.flights.values()]
        return self.job.items.filter(status=BulkItem.Status.PENDING).exclude(pk__in=mine).exists()

    def _wait_for_others(self) -> bool:
        """Nothing claimable and nothing in flight: if items are still pending (leased by another runner, or
        backing off), sleep until the earliest lease ends; False when no item is pending any more."""
        pending = self.job.items.filter(status=BulkItem.Status.PENDING)
        earliest = pending.aggregate(earliest=Min("lease_until"))["earliest"]
        if not pending.exists():
            return False
        wait_s = 0.0 if earliest is None else (earliest - timezone.now()).total_seconds()
        time.sleep(min(max(wait_s, POLL), 1.0, max(self.deadline - time.monotonic(), POLL)))
        return True

    # ------------------------------------------------------------------------------------------- settling

    def _settle(self, flight: _Flight, future: Future[GenerationResult]) -> None:
        try:
            result = future.result()
        except TRANSIENT as exc:
            log.warning(
                "job %s item %s attempt %s: %s; retrying", self.job_id, flight.index, flight.attempt, exc
            )
            self._release(flight.item_id, BACKOFF)
            self.paused_until = time.monotonic() + BACKOFF
            return
        except EngineError as exc:
            self._store_failure(flight.item_id, requests.engine_item_error(exc))
            return
        if any(o.finish_reason == "abort" for o in result.outputs):
            self._release(flight.item_id, 0)  # cancelled, or superseded by a newer attempt
            return
        self._storable(flight.item_id).update(
            status=BulkItem.Status.DONE,
            lease_until=None,
            finished_at=timezone.now(),
            **flight.request.stored(result),
        )

    def _release(self, item_id: int, backoff: float) -> None:
        until = timezone.now() + timedelta(seconds=backoff) if backoff else None
        BulkItem.objects.filter(pk=item_id, status=BulkItem.Status.PENDING).update(lease_until=until)

    def _store_failure(self, item_id: int, exc: requests.ItemError) -> None:
        self._storable(item_id).update(
            status=BulkItem.Status.FAILED, lease_until=None, finished_at=timezone.now(), error=exc.as_json()
        )

    @staticmethod
    def _storable(item_id: int):
        """The item, while a result may still be stored: it is pending and its job is not final yet. A result
        that arrives after `finalize` (a cancel that found no lease) is dropped, so a finished job's counts
        and result files never disagree."""
        active = {"status": BulkItem.Status.PENDING, "job__status__in": BulkJob.ACTIVE}
        return BulkItem.objects.filter(pk=item_id, **active)

    def _abort_all(self) -> None:
        self.aborted = True
        for flight in self.flights.values():
            self.client.abort(self.job.model, self.job.request_id(flight.index, flight.attempt))
        self.deadline = 0.0  # claim nothing more; the aborted requests come back as "abort"

    def _finish(self, status: str) -> bool:
        """Called with nothing in flight: complete the job, or ask for another task."""
        from llmserve.bulk import services

        if status == BulkJob.Status.CANCELLING:
            services.finalize(self.job, BulkJob.Status.CANCELLED)
            return False
        if self.job.items.filter(status=BulkItem.Status.PENDING).exists():
            return not self.handed_over
        services.finalize(self.job, BulkJob.Status.COMPLETED)
        return False
