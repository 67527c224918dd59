"""The loop one bulk task runs: keep as many items on the bus as the engines can take (see `capacity`), store
finished items in batches, and hand over to a fresh task after ``BULK_SLICE_SECONDS`` (its requests go on in
the engine and the next task reads them).

The requests run as tasks of the async bus client on one event-loop thread (`bus_thread`); this thread does
the database work: claims a batch of items with one conditional UPDATE, writes a batch of results (and the
job's counters) in one transaction. Nothing here trusts the broker to deliver exactly once:

- an item belongs to the runner whose id it carries (``runner``), set only where it was NULL;
- a result is stored only where the item is still pending and still this runner's, so at most one result per
  item is ever stored, and none after the job is final (finalizing dismisses the runners);
- a runner is a row with a heartbeat: a runner known to be dead (its task redelivered, its process gone, its
  heartbeat stale) is deleted, which frees its items at once, and the runner that takes one over submits the
  same request id, finds it taken and reads the running request's output instead of generating it again.

Engine outages (no live replica, a replica dying mid-request, overload) put the item back with a short
backoff and a new attempt number; only errors that would recur (invalid request, prompt too long) mark an item
failed. Pause and cancel abort this runner's requests and put their items back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from datetime import timedelta

from django.db import transaction
from django.db.models import F, Q, Sum, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from inference_engine.bus.client import GenerationResult
from inference_engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    ModelNotFoundError,
    RequestAbortedError,
)
from llmserve import bus, conf, ratelimit
from llmserve.bulk import capacity, requests, services
from llmserve.bulk.bus_thread import BusThread, Flight, Outcome
from llmserve.bulk.models import BulkItem, BulkJob, BulkRunner
from llmserve.engines import engine_target, live_models

log = logging.getLogger("llmserve.bulk")

TRANSIENT = (EngineUnavailableError, ModelNotFoundError, EngineOverloadedError)
BACKOFF = 1.0  # seconds before retrying after an engine outage
POLL = 0.25  # longest wait for a result before looking at the job again
FLUSH_SECONDS = 0.5  # a finished result waits at most this long to be written...
FLUSH_ITEMS = 256  # ...or until this many have finished
# How long the client waits for a request's next entry. A queued bulk request waits for a free batch slot a
# whole generation or more; and a runner that left requests behind (handover, declared dead) still reads them
# until they end: if it gave up, the client would abort them under the runner now reading them. The client
# still gives up at once when no replica of the model is alive.
STREAM_TIMEOUT = 600.0
OWNER_TIMEOUTS = 4  # runner timeouts a dead runner's requests are kept for its successor (see `run`)

DONE_FIELDS = ["status", "runner", "finished_at", "output", "response", "prompt_tokens", "completion_tokens"]
FAILED_FIELDS = ["status", "runner", "finished_at", "error"]


class Reaped(Exception):
    """This runner was declared dead; its items belong to others now."""


class JobRunner:
    """Runs one slice of a job. `run()` returns whether work remains for another task."""

    def __init__(self, job_id: int, task_id: str) -> None:
        self.job_id, self.task_id = job_id, task_id
        self.deadline = time.monotonic() + float(conf.get("BULK_SLICE_SECONDS"))
        self.beat_interval = float(conf.get("BULK_RUNNER_TIMEOUT")) / 5
        self.flights: dict[int, Flight] = {}  # by item id
        self.cancelled: set[int] = set()
        self.results: list[tuple[Flight, Outcome]] = []
        self.first_result = 0.0
        self.limit = 0
        self.claims_resume = 0.0
        self.next_beat = 0.0
        self.observed_tokens, self.observed_items = 0, 0
        self.runner: BulkRunner | None = None

    def run(self) -> bool:
        BulkJob.objects.filter(pk=self.job_id, status=BulkJob.Status.QUEUED).update(
            status=BulkJob.Status.RUNNING, started_at=timezone.now()
        )
        self.job = BulkJob.objects.select_related("owner").get(pk=self.job_id)
        if self.job.status not in (BulkJob.Status.RUNNING, BulkJob.Status.CANCELLING):
            return False
        generates = self.job.template and self.job.kind != BulkJob.Kind.EMBED
        self.params = requests.job_params(self.job.params) if generates else None
        # A dead runner's requests run on while another runner takes its items over and adopts them
        # (`attach`), which takes a few runner timeouts; only requests left unadopted longer are aborted.
        settings = dataclasses.replace(
            bus.client_settings(),
            ack_timeout=STREAM_TIMEOUT,
            stream_timeout=STREAM_TIMEOUT,
            owner_ttl=OWNER_TIMEOUTS * float(conf.get("BULK_RUNNER_TIMEOUT")),
        )
        self.engine_model, lora_name = (
            (self.job.model, None)  # embeddings resolve their model as /v1/embeddings does
            if self.job.kind == BulkJob.Kind.EMBED
            else engine_target(self.job.model, list(live_models().values()))
        )
        self.bus = BusThread(conf.get("REDIS_URL"), settings, self.engine_model, self.job.priority, lora_name)
        try:
            # An earlier run of this very task is dead (a task runs once at a time; it was redelivered).
            BulkRunner.objects.filter(task_id=self.task_id).delete()
            self.runner = BulkRunner.objects.create(
                job=self.job, task_id=self.task_id, worker=services.worker_name(), heartbeat_at=timezone.now()
            )
            return self._loop()
        except Reaped:
            log.warning("job %s: runner %s was declared dead; leaving", self.job_id, self.runner.pk)
            return False
        finally:
            # Requests still in flight (a handover, or an error) go on in the engine: whoever gets their items
            # once this row is gone reads their output.
            self.bus.close()
            if self.runner is not None:
                BulkRunner.objects.filter(pk=self.runner.pk).delete()

    def _loop(self) -> bool:
        while True:
            self._collect()
            if time.monotonic() >= self.next_beat:
                self._beat()
            status = BulkJob.objects.values_list("status", flat=True).get(pk=self.job_id)
            if status not in BulkJob.ACTIVE:  # finalized elsewhere: nothing of ours can be stored any more
                self._abort(list(self.flights.values()))
                return False
            if status in (BulkJob.Status.CANCELLING, BulkJob.Status.PAUSED):
                self._abort([f for f in self.flights.values() if f.item_id not in self.cancelled])
            elif status == BulkJob.Status.RUNNING:
                if time.monotonic() < self.deadline:
                    self._claim()
                elif self.job.kind == BulkJob.Kind.EMBED and self.flights:
                    pass  # the next task would embed these again (`BusThread._embed`): they finish here
                elif self.flights or self._pending():
                    # Hand over: the requests in flight go on in the engine, and the next task, given their
                    # items when this runner's row goes, reads their output.
                    if self.results:
                        self._store()
                    return True
            if self.flights or self.results:
                continue
            if status == BulkJob.Status.CANCELLING:
                services.finalize(self.job, BulkJob.Status.CANCELLED)
                return False
            if status == BulkJob.Status.PAUSED:
                return False
            if not self._pending():
                services.finalize(self.job, BulkJob.Status.COMPLETED)
                return False
            time.sleep(POLL)  # pending items are another runner's, backing off, or the engines are full

    def _pending(self) -> bool:
        return self.job.items.filter(status=BulkItem.Status.PENDING).exists()

    # ------------------------------------------------------------------------------------------- bookkeeping

    def _collect(self) -> None:
        """Take the flights that ended; write the results once enough have gathered or waited long enough."""
        for flight, outcome in self.bus.finished(POLL if self.flights else 0):
            self.flights.pop(flight.item_id, None)
            self.cancelled.discard(flight.item_id)
            if not self.results:
                self.first_result = time.monotonic()
            self.results.append((flight, outcome))
        if self.results and (
            len(self.results) >= FLUSH_ITEMS
            or time.monotonic() - self.first_result >= FLUSH_SECONDS
            or not self.flights
        ):
            self._store()

    def _beat(self) -> None:
        """Heartbeat; dismiss dead runners; size what this runner may keep in flight."""
        updated = BulkRunner.objects.filter(pk=self.runner.pk).update(
            heartbeat_at=timezone.now(), in_flight=len(self.flights)
        )
        if not updated:
            raise Reaped
        services.reap_runners()
        self.limit = self._limit()
        self.next_beat = time.monotonic() + self.beat_interval

    def _limit(self) -> int:
        try:
            models = self.bus.call(self.bus.client.list_models())
        except (EngineError, TimeoutError) as exc:
            log.warning("job %s: cannot read the engines' load (%s)", self.job_id, exc)
            return 0
        replicas = next((m.replicas for m in models if m.name == self.engine_model), [])
        per_item = self.observed_tokens / self.observed_items if self.observed_items else None
        target = capacity.bulk_target(replicas, per_item, int(conf.get("MAX_QUEUE")))
        alive_since = timezone.now() - timedelta(seconds=float(conf.get("BULK_RUNNER_TIMEOUT")))
        rows = (
            BulkRunner.objects.filter(
                job__model=self.job.model, job__status=BulkJob.Status.RUNNING, heartbeat_at__gte=alive_since
            )
            .exclude(pk=self.runner.pk)
            .values("job_id")
            .annotate(count=Sum("in_flight"))
        )
        in_flight = {row["job_id"]: row["count"] for row in rows}
        mine_elsewhere = in_flight.get(self.job_id, 0)  # this job's other runners
        in_flight[self.job_id] = mine_elsewhere + len(self.flights)
        return max(0, capacity.job_share(target, self.job_id, in_flight) - mine_elsewhere)

    # ---------------------------------------------------------------------------------------------- claiming

    def _claim(self) -> None:
        # Claims go in batches of at least a quarter of the limit: the batch waiting on the bus (see
        # `capacity`) keeps the engines busy meanwhile, and the database sees a few large claims, not one
        # per item.
        free = self.limit - len(self.flights)
        if free < max(1, self.limit // 4) or time.monotonic() < self.claims_resume:
            return
        now = timezone.now()
        claimable = BulkItem.objects.filter(
            Q(retry_at__isnull=True) | Q(retry_at__lte=now),
            job_id=self.job_id,
            status=BulkItem.Status.PENDING,
            runner__isnull=True,
        )
        rows = list(claimable.order_by("index").values_list("pk", "index", "attempts")[:free])
        ids = self._within_rate_limit(rows)
        if not ids:
            return
        BulkItem.objects.filter(pk__in=ids, status=BulkItem.Status.PENDING, runner__isnull=True).update(
            runner=self.runner, attempts=Greatest(F("attempts"), Value(1)), retry_at=None
        )
        claimed = BulkItem.objects.filter(pk__in=ids, runner=self.runner, status=BulkItem.Status.PENDING)
        for pk, index, attempt, item_input in claimed.values_list("pk", "index", "attempts", "input"):
            request_id = self.job.request_id(index, attempt)
            try:
                request = requests.build(self.job, self.params, item_input)
            except requests.ItemError as exc:
                self.results.append((Flight(pk, index, attempt, request_id, None), exc))
                continue
            flight = Flight(pk, index, attempt, request_id, request)
            self.flights[pk] = flight
            self.bus.start(flight)

    def _within_rate_limit(self, rows: list[tuple[int, int, int]]) -> list[int]:
        """The items of ``rows`` (pk, index, attempts) that the job's API key lets run now. Each request sent
        counts against the key's requests-per-minute limit, as the same request through the REST API would;
        an item whose request an earlier runner already sent (and left running when it handed over) is read,
        not sent again, and counts nothing."""
        key = self.job.owner
        limit = key.effective_rate_limit() if key is not None else 0
        if limit <= 0:
            return [pk for pk, _, _ in rows]

        async def allowed() -> list[int]:
            request_ids = [self.job.request_id(index, max(attempts, 1)) for _, index, attempts in rows]
            on_bus = await asyncio.gather(
                *(self.bus.client.request_known(request_id, started=False) for request_id in request_ids)
            )
            keep, refused = [], False
            for (pk, _, _), sent in zip(rows, on_bus, strict=True):
                if not sent and not refused:
                    retry_after = await ratelimit.ahit(f"key:{key.pk}", limit)
                    if retry_after is not None:
                        self.claims_resume, refused = time.monotonic() + retry_after, True
                if sent or not refused:
                    keep.append(pk)
            return keep

        return self.bus.call(allowed())

    # ----------------------------------------------------------------------------------------------- storing

    def _store(self) -> None:
        """Write the gathered results in one transaction: finished items, the job's counters, and the items to
        try again."""
        now = timezone.now()
        done: list[BulkItem] = []
        failed: list[BulkItem] = []
        retry: dict[float, list[int]] = {0.0: [], BACKOFF: []}
        for flight, outcome in self.results:
            if isinstance(outcome, GenerationResult):
                if any(o.finish_reason == "abort" for o in outcome.outputs):
                    retry[0.0].append(flight.item_id)  # paused, cancelled, or superseded
                    continue
                fields = flight.request.stored(outcome)
                done.append(BulkItem(pk=flight.item_id, status=BulkItem.Status.DONE, **fields))
            elif isinstance(outcome, dict):  # an embeddings answer
                fields = flight.request.stored(outcome)
                done.append(BulkItem(pk=flight.item_id, status=BulkItem.Status.DONE, **fields))
            elif isinstance(outcome, asyncio.CancelledError | RequestAbortedError):
                retry[0.0].append(flight.item_id)  # paused or cancelled, or given up by an earlier runner
            elif isinstance(outcome, TRANSIENT):
                log.warning("job %s item %s: %s; retrying", self.job_id, flight.index, outcome)
                retry[BACKOFF].append(flight.item_id)
                self.claims_resume = time.monotonic() + BACKOFF
            elif isinstance(outcome, (EngineError, requests.ItemError)):
                error = (
                    outcome
                    if isinstance(outcome, requests.ItemError)
                    else requests.engine_item_error(outcome)
                )
                failed.append(
                    BulkItem(pk=flight.item_id, status=BulkItem.Status.FAILED, error=error.as_json())
                )
            else:
                log.error("job %s item %s failed unexpectedly", self.job_id, flight.index, exc_info=outcome)
                retry[BACKOFF].append(flight.item_id)
        for item in done + failed:
            item.runner, item.finished_at = None, now
        with transaction.atomic():
            mine = BulkItem.objects.filter(status=BulkItem.Status.PENDING, runner=self.runner)
            stored = sum(
                mine.bulk_update(rows, fields)
                for rows, fields in ((done, DONE_FIELDS), (failed, FAILED_FIELDS))
                if rows
            )
            if stored < len(done) + len(failed):
                # Some items were no longer ours (we were declared dead, or the job became final): keep the
                # counters to the rows this transaction wrote, which carry its timestamp.
                ours = set(
                    BulkItem.objects.filter(
                        pk__in=[i.pk for i in done + failed], finished_at=now
                    ).values_list("pk", flat=True)
                )
                done = [i for i in done if i.pk in ours]
                failed = [i for i in failed if i.pk in ours]
            if done or failed:
                BulkJob.objects.filter(pk=self.job_id).update(
                    done=F("done") + len(done),
                    failed=F("failed") + len(failed),
                    prompt_tokens=F("prompt_tokens") + sum(i.prompt_tokens for i in done),
                    completion_tokens=F("completion_tokens") + sum(i.completion_tokens for i in done),
                )
            for delay, ids in retry.items():
                if ids:
                    mine.filter(pk__in=ids).update(
                        runner=None,
                        attempts=F("attempts") + 1,
                        retry_at=now + timedelta(seconds=delay) if delay else None,
                    )
        for item in done:
            self.observed_tokens += item.prompt_tokens + item.completion_tokens
            self.observed_items += 1
        self.results.clear()

    def _abort(self, flights: list[Flight]) -> None:
        """Abort these requests in the engine; their items go back to pending when they come back."""
        self.cancelled.update(f.item_id for f in flights)
        self.bus.cancel(flights)
