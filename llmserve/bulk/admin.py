"""Admin for bulk jobs: create one from an uploaded JSONL or CSV file, watch its progress live, pause, resume
or cancel it, download its results as JSONL or CSV; and the Batch API's token usage per API key.

Each JSONL line (an object) or CSV row (columns by header) becomes one item whose fields fill the template.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, QuerySet, Sum
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
    StreamingHttpResponse,
)
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.views.decorators.http import require_POST

from llmserve import conf
from llmserve.api.errors import APIError
from llmserve.bulk import services, uploads
from llmserve.bulk.models import Batch, BatchFile, BulkItem, BulkJob
from llmserve.models import KeyUsage


class BulkJobForm(forms.ModelForm):
    file = forms.FileField(
        label=_("items"),
        help_text=_(
            "A .jsonl file (one object per line) or a .csv file with a header row; fields fill the template."
        ),
    )

    class Meta:
        model = BulkJob
        fields = ("name", "model", "kind", "template", "params", "priority")

    def clean_file(self) -> Any:
        upload = self.cleaned_data["file"]
        limit = conf.get("BULK_MAX_FILE_BYTES")
        if upload.size > limit:
            raise forms.ValidationError(_("The file exceeds %(limit)d bytes.") % {"limit": limit})
        try:
            count = uploads.count_items(upload)
        except uploads.UploadError as exc:
            raise forms.ValidationError(str(exc)) from None
        if not count:
            raise forms.ValidationError(_("The file holds no items."))
        return upload

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if not cleaned.get("template"):
            self.add_error("template", _("A template is required."))
        return cleaned


@admin.register(BulkItem)
class BulkItemAdmin(admin.ModelAdmin):
    """Read-only: items are a job's results, browsed per job (the job page links here)."""

    list_display = ("job", "index", "custom_id", "status", "attempts", "completion_tokens", "finished_at")
    list_filter = ("status",)
    search_fields = ("custom_id",)
    list_select_related = ("job",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: BulkItem | None = None) -> bool:
        return False


@admin.register(BulkJob)
class BulkJobAdmin(admin.ModelAdmin):
    list_display = ("__str__", "model", "status", "progress", "tokens_per_s", "eta", "owner", "created_at")
    list_filter = ("status", "model")
    search_fields = ("name", "model")
    list_select_related = ("owner",)
    actions = ("pause_jobs", "resume_jobs", "cancel_jobs")
    change_form_template = "llmserve/admin/bulkjob_change_form.html"
    detail_fields = (
        "name",
        "model",
        "kind",
        "template",
        "params",
        "priority",
        "owner",
        "status",
        "progress",
        "tokens",
        "tokens_per_s",
        "eta",
        "items",
        "error",
        "created_at",
        "started_at",
        "cancelled_at",
        "finished_at",
    )

    def get_form(
        self, request: HttpRequest, obj: BulkJob | None = None, **kwargs: Any
    ) -> type[forms.ModelForm]:
        if obj is None:
            kwargs["form"] = BulkJobForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request: HttpRequest, obj: BulkJob | None = None) -> list[str]:
        if obj is None:
            return ["name", "model", "kind", "template", "params", "priority", "file"]
        return list(self.detail_fields)

    def get_readonly_fields(self, request: HttpRequest, obj: BulkJob | None = None) -> list[str]:
        return [] if obj is None else list(self.detail_fields)

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        return {
            "priority": conf.get("BULK_PRIORITY"),
            "template": "Summarise the following document:\n\n{document}",
            "params": {"temperature": 0, "max_tokens": 128},
        }

    def save_model(self, request: HttpRequest, obj: BulkJob, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        data = form.cleaned_data
        try:
            created = services.create_job(
                data["model"],
                data["template"],
                uploads.iter_items(data["file"]),
                data["params"],
                data["priority"],
                kind=data["kind"],
                name=data["name"],
            )
        except APIError as exc:
            raise forms.ValidationError(exc.message) from None
        obj.pk, obj._state.adding = created.pk, False

    def response_add(
        self, request: HttpRequest, obj: BulkJob, post_url_continue: str | None = None
    ) -> HttpResponseRedirect:
        self.message_user(request, _("Job %(job)s queued.") % {"job": obj.pk})
        return HttpResponseRedirect(reverse("admin:llmserve_bulkjob_change", args=[obj.pk]))

    # ----------------------------------------------------------------------------------------- progress

    @admin.display(description=_("done / failed / total"))
    def progress(self, obj: BulkJob) -> str:
        return f"{obj.done} / {obj.failed} / {obj.total}"

    @admin.display(description=_("tokens (prompt / completion)"))
    def tokens(self, obj: BulkJob) -> str:
        return f"{obj.prompt_tokens} / {obj.completion_tokens}"

    @admin.display(description=_("tokens/s"))
    def tokens_per_s(self, obj: BulkJob) -> str:
        return f"{services.progress(obj).tokens_per_s:.1f}"

    @admin.display(description=_("ETA"))
    def eta(self, obj: BulkJob) -> str:
        return format_eta(services.progress(obj).eta_s)

    @admin.display(description=_("items"))
    def items(self, obj: BulkJob) -> str:
        url = reverse("admin:llmserve_bulkitem_changelist") + f"?job__id__exact={obj.pk}"
        return format_html('<a href="{}">{}</a>', url, _("results of each item"))

    def render_change_form(self, request: HttpRequest, context: dict, *args: Any, **kwargs: Any) -> Any:
        obj = context.get("original")
        if obj is not None:
            context["progress"] = services.progress(obj)
            context["progress_eta"] = format_eta(context["progress"].eta_s)
            context["can_control"] = self.has_change_permission(request, obj)
        return super().render_change_form(request, context, *args, **kwargs)

    # ------------------------------------------------------------------- live progress, controls, results

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/progress/", view(self.progress_view), name="llmserve_bulkjob_progress"),
            path(
                "<path:object_id>/control/<str:action>/",
                view(require_POST(self.control_view)),
                name="llmserve_bulkjob_control",
            ),
            path(
                "<path:object_id>/results.<str:fmt>",
                view(self.results_view),
                name="llmserve_bulkjob_results",
            ),
            *super().get_urls(),
        ]

    def _job(self, request: HttpRequest, object_id: str, change: bool = False) -> BulkJob:
        # The admin's own lookup: an id that is no job's ("abc", out of the column's range) is a 404.
        job = self.get_object(request, object_id)
        if job is None:
            raise Http404
        allowed = (
            self.has_change_permission(request, job) if change else self.has_view_permission(request, job)
        )
        if not allowed:
            raise PermissionDenied
        return job

    def progress_view(self, request: HttpRequest, object_id: str) -> JsonResponse:
        """What the job page polls while the job runs."""
        job = self._job(request, object_id)
        p = services.progress(job)
        return JsonResponse(
            {
                "status": job.status,
                "status_display": job.get_status_display(),
                "total": p.total,
                "done": p.done,
                "failed": p.failed,
                "pending": p.pending,
                "prompt_tokens": p.prompt_tokens,
                "completion_tokens": p.completion_tokens,
                "tokens_per_s": round(p.tokens_per_s, 1),
                "eta_s": p.eta_s,
                "eta": format_eta(p.eta_s),
                "active": job.is_active,
            }
        )

    def control_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponseRedirect:
        if action not in CONTROLS:
            raise Http404
        job = self._job(request, object_id, change=True)
        apply, done = CONTROLS[action]
        if apply(job):
            self.message_user(request, done)
        else:
            self.message_user(
                request, _("The job is %(status)s.") % {"status": job.get_status_display()}, messages.WARNING
            )
        return HttpResponseRedirect(reverse("admin:llmserve_bulkjob_change", args=[job.pk]))

    def results_view(self, request: HttpRequest, object_id: str, fmt: str) -> HttpResponse:
        """Every item's result, streamed from the database in chunks."""
        if fmt not in ("jsonl", "csv"):
            raise Http404
        job = self._job(request, object_id)
        lines = uploads.jsonl_lines if fmt == "jsonl" else uploads.csv_lines
        content_type = "application/jsonl" if fmt == "jsonl" else "text/csv"
        response = StreamingHttpResponse(lines(services.iter_results(job)), content_type=content_type)
        response["Content-Disposition"] = f'attachment; filename="bulk-job-{job.pk}.{fmt}"'
        return response

    # ----------------------------------------------------------------------------------------- actions

    def _act(self, request: HttpRequest, queryset: QuerySet[BulkJob], apply: Any, message: str) -> None:
        count = sum(bool(apply(job)) for job in queryset)
        level = messages.SUCCESS if count else messages.WARNING
        self.message_user(request, message % count, level)

    @admin.action(description=_("Pause selected jobs"), permissions=["change"])
    def pause_jobs(self, request: HttpRequest, queryset: QuerySet[BulkJob]) -> None:
        self._act(request, queryset, services.pause_job, _("%d job(s) paused."))

    @admin.action(description=_("Resume selected jobs"), permissions=["change"])
    def resume_jobs(self, request: HttpRequest, queryset: QuerySet[BulkJob]) -> None:
        self._act(request, queryset, services.resume_job, _("%d job(s) resumed."))

    @admin.action(description=_("Cancel selected jobs"), permissions=["change"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[BulkJob]) -> None:
        self._act(request, queryset, services.cancel_job, _("%d job(s) cancelled."))


CONTROLS = {
    "pause": (services.pause_job, _("Job paused.")),
    "resume": (services.resume_job, _("Job resumed.")),
    "cancel": (services.cancel_job, _("Job cancelled.")),
}


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h {rest // 60:02d}m" if hours else f"{rest // 60}m {rest % 60:02d}s"


@admin.register(KeyUsage)
class KeyUsageAdmin(admin.ModelAdmin):
    """Per-key accounting of Batch API jobs: what each key's batches used. Read-only."""

    list_display = ("name", "prefix", "jobs", "prompt_tokens", "completion_tokens", "revoked")
    search_fields = ("name", "prefix")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return (
            super()
            .get_queryset(request)
            .annotate(
                job_count=Count("bulk_jobs"),
                prompt_sum=Sum("bulk_jobs__prompt_tokens", default=0),
                completion_sum=Sum("bulk_jobs__completion_tokens", default=0),
            )
        )

    @admin.display(description=_("bulk jobs"), ordering="job_count")
    def jobs(self, obj: KeyUsage) -> int:
        return obj.job_count

    @admin.display(description=_("prompt tokens"), ordering="prompt_sum")
    def prompt_tokens(self, obj: KeyUsage) -> int:
        return obj.prompt_sum

    @admin.display(description=_("completion tokens"), ordering="completion_sum")
    def completion_tokens(self, obj: KeyUsage) -> int:
        return obj.completion_sum

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: KeyUsage | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: KeyUsage | None = None) -> bool:
        return False


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ("id", "endpoint", "job", "owner", "created_at")
    readonly_fields = (
        "id",
        "owner",
        "job",
        "endpoint",
        "input_file",
        "output_file",
        "error_file",
        "completion_window",
        "metadata",
        "created_at",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(BatchFile)
class BatchFileAdmin(admin.ModelAdmin):
    list_display = ("id", "filename", "purpose", "owner", "created_at")
    fields = ("id", "filename", "purpose", "owner", "created_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
