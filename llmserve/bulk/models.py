"""Bulk jobs and their items; the OpenAI Batch API's files and batches, which are bulk jobs underneath.

Exactly-once results rest on the database, not on the broker: an item is claimed by setting its ``runner``
(a conditional ``UPDATE ... WHERE runner IS NULL``), and its result is written only ``WHERE status =
'pending' AND runner = <the writer>``, so a second writer (a redelivered task, a runner declared dead) changes
nothing. A runner is a row with a heartbeat: deleting it (its task was redelivered, its process is gone, its
heartbeat went stale) frees its items at once (``runner`` becomes NULL), and the next runner reattaches to
their still-running engine requests rather than generating them again (see `BulkJob.request_id`).
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _


class BulkJob(models.Model):
    """A model, a prompt template and sampling parameters applied to many items.

    A job with an empty ``template`` takes each item's input as a complete OpenAI request body (Batch API);
    otherwise the template is filled with the item's fields and sent as one user message (``chat``), as a
    raw prompt (``completion``), or as the text to embed (``embed``: its output is the vector, base64
    float32, and ``params`` are the embeddings request's ``dimensions`` / ``truncate_prompt_tokens``).
    """

    class Kind(models.TextChoices):
        CHAT = "chat", _("chat")
        COMPLETION = "completion", _("completion")
        EMBED = "embed", _("embeddings")

    class Status(models.TextChoices):
        QUEUED = "queued", _("queued")
        RUNNING = "running", _("running")
        PAUSED = "paused", _("paused")
        CANCELLING = "cancelling", _("cancelling")
        CANCELLED = "cancelled", _("cancelled")
        COMPLETED = "completed", _("completed")
        FAILED = "failed", _("failed")

    ACTIVE = (Status.QUEUED, Status.RUNNING, Status.PAUSED, Status.CANCELLING)

    uid = models.UUIDField(
        default=uuid.uuid4, unique=True, editable=False, help_text=_("Namespaces the job's bus request ids.")
    )
    name = models.CharField(_("name"), max_length=200, blank=True)
    model = models.CharField(_("model"), max_length=100)
    kind = models.CharField(_("kind"), max_length=10, choices=Kind.choices, default=Kind.CHAT)
    template = models.TextField(
        _("prompt template"),
        blank=True,
        help_text=_(
            "Python format string over each item's fields, e.g. \"Summarise the following "
            'document:\\n\\n{document}". Empty: items are request bodies.'
        ),
    )
    params = models.JSONField(_("sampling parameters"), default=dict, blank=True)
    priority = models.SmallIntegerField(
        _("priority"), default=10, help_text=_("Bus priority; lower runs first (interactive = 0).")
    )
    status = models.CharField(
        _("status"), max_length=10, choices=Status.choices, default=Status.QUEUED, db_index=True
    )
    error = models.TextField(_("error"), blank=True)
    owner = models.ForeignKey(
        "llmserve.APIKey",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="bulk_jobs",
        verbose_name=_("API key"),
        help_text=_("The key whose Batch API call created the job; its rate limit paces the job."),
    )
    # Counters kept by the runners in the transaction that stores each batch of results, so that progress is
    # one row read however many items the job has.
    total = models.PositiveIntegerField(_("items"), default=0)
    done = models.PositiveIntegerField(_("done"), default=0)
    failed = models.PositiveIntegerField(_("failed"), default=0)
    prompt_tokens = models.PositiveBigIntegerField(_("prompt tokens"), default=0)
    completion_tokens = models.PositiveBigIntegerField(_("completion tokens"), default=0)
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    started_at = models.DateTimeField(_("started"), null=True, blank=True)
    paused_at = models.DateTimeField(_("paused"), null=True, blank=True)
    paused_seconds = models.FloatField(
        default=0.0, help_text=_("Time spent paused, left out of tokens/s and the ETA.")
    )
    cancelled_at = models.DateTimeField(_("cancelled"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)

    class Meta:
        verbose_name = _("bulk job")
        verbose_name_plural = _("bulk jobs")
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return self.name or f"{self.model} job {self.pk}"

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE

    def request_id(self, index: int, attempt: int) -> str:
        """The bus request id of one attempt at one item. Deterministic, so a canceller can abort it without
        having been told it, and a runner that takes over a dead runner's item finds the request already
        running (the bus keeps each id once) and reads its output instead of generating it again."""
        return f"bulk-{self.uid.hex}-{index}-{attempt}"


class BulkRunner(models.Model):
    """One running task of a job: its heartbeat and how many requests it has on the bus.

    A runner is alive while ``heartbeat_at`` is recent (``BULK_RUNNER_TIMEOUT``). Deleting the row frees its
    items. ``in_flight`` lets the runners of every job on a model share the engines' capacity.
    """

    job = models.ForeignKey(BulkJob, on_delete=models.CASCADE, related_name="runners")
    task_id = models.CharField(max_length=255, db_index=True)
    worker = models.CharField(max_length=255, help_text=_("host:pid of the process running it."))
    started_at = models.DateTimeField(auto_now_add=True)
    heartbeat_at = models.DateTimeField(db_index=True)
    in_flight = models.PositiveIntegerField(default=0)

    class Meta:
        verbose_name = _("bulk runner")
        verbose_name_plural = _("bulk runners")

    def __str__(self) -> str:
        return f"runner {self.pk} of job {self.job_id} on {self.worker}"


class BulkItem(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", _("pending")
        DONE = "done", _("done")
        FAILED = "failed", _("failed")

    job = models.ForeignKey(BulkJob, on_delete=models.CASCADE, related_name="items")
    index = models.PositiveIntegerField(_("index"))
    custom_id = models.CharField(_("custom id"), max_length=256, blank=True)
    input = models.JSONField(_("input"), help_text=_("Template fields, or a whole request body."))
    status = models.CharField(_("status"), max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(
        _("attempts"), default=0, help_text=_("Number of the item's current engine request (0: none yet).")
    )
    runner = models.ForeignKey(
        BulkRunner, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", editable=False
    )
    retry_at = models.DateTimeField(
        null=True, blank=True, help_text=_("Not claimed before this time (a backoff after an engine outage).")
    )
    output = models.TextField(_("output"), blank=True)
    response = models.JSONField(
        _("response"), null=True, blank=True, help_text=_("The OpenAI response body, for Batch API items.")
    )
    error = models.JSONField(_("error"), null=True, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = _("bulk item")
        verbose_name_plural = _("bulk items")
        ordering = ("job", "index")
        constraints = (models.UniqueConstraint(fields=("job", "index"), name="llmserve_bulkitem_unique"),)
        indexes = (
            models.Index(fields=("job", "status"), name="llmserve_bulkitem_job_status"),
            # Claims walk a job's pending items in order, however many are already done.
            models.Index(
                fields=("job", "index"), condition=Q(status="pending"), name="llmserve_bulkitem_pending"
            ),
        )

    def __str__(self) -> str:
        return f"{self.job_id}#{self.index}"


def _file_id() -> str:
    return "file-" + secrets.token_hex(12)


def _batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class BatchFile(models.Model):
    """An uploaded Batch API input file, or a batch's generated output / error file."""

    class Purpose(models.TextChoices):
        BATCH = "batch", "batch"
        BATCH_OUTPUT = "batch_output", "batch_output"

    id = models.CharField(primary_key=True, max_length=40, default=_file_id, editable=False)
    owner = models.ForeignKey(
        "llmserve.APIKey", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    content = models.BinaryField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = _("batch file")
        verbose_name_plural = _("batch files")
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": int(self.created_at.timestamp()),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


class Batch(models.Model):
    """An OpenAI batch: a bulk job over the requests of an input file, plus its output and error files."""

    id = models.CharField(primary_key=True, max_length=40, default=_batch_id, editable=False)
    owner = models.ForeignKey(
        "llmserve.APIKey", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    job = models.OneToOneField(BulkJob, on_delete=models.CASCADE, related_name="batch")
    endpoint = models.CharField(max_length=40)
    input_file = models.ForeignKey(BatchFile, on_delete=models.PROTECT, related_name="+")
    output_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    completion_window = models.CharField(max_length=10, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = _("batch")
        verbose_name_plural = _("batches")
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return self.id
