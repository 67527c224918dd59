"""Admin for bulk jobs: create one from an uploaded JSONL or CSV file, watch its progress, cancel it.

Each JSONL line (an object) or CSV row (columns by header) becomes one item whose fields fill the template.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from llmserve import conf
from llmserve.api.errors import APIError
from llmserve.bulk import services
from llmserve.bulk.models import Batch, BatchFile, BulkItem, BulkJob


def read_items(upload: Any) -> list[dict[str, Any]]:
    """The items of an uploaded ``.jsonl`` / ``.csv`` file; `forms.ValidationError` names a bad line."""
    text = upload.read().decode("utf-8-sig")
    if upload.name.lower().endswith(".csv"):
        return [dict(row) for row in csv.DictReader(io.StringIO(text))]
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise forms.ValidationError(_("Line %(n)d is not valid JSON.") % {"n": number}) from None
        if not isinstance(item, dict):
            raise forms.ValidationError(_("Line %(n)d is not a JSON object.") % {"n": number})
        items.append(item)
    return items


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

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        upload = cleaned.get("file")
        if upload is not None:
            cleaned["items"] = read_items(upload)
            if not cleaned["items"]:
                self.add_error("file", _("The file holds no items."))
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
    list_display = ("__str__", "model", "status", "progress", "tokens_per_s", "eta", "created_at")
    list_filter = ("status", "model")
    search_fields = ("name", "model")
    actions = ("cancel_jobs",)

    def get_form(
        self, request: HttpRequest, obj: BulkJob | None = None, **kwargs: Any
    ) -> type[forms.ModelForm]:
        if obj is None:
            kwargs["form"] = BulkJobForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request: HttpRequest, obj: BulkJob | None = None) -> list[str]:
        if obj is None:
            return ["name", "model", "kind", "template", "params", "priority", "file"]
        return [
            "name",
            "model",
            "kind",
            "template",
            "params",
            "priority",
            "status",
            "progress",
            "tokens_per_s",
            "eta",
            "items",
            "error",
            "created_at",
            "started_at",
            "cancelled_at",
            "finished_at",
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: BulkJob | None = None) -> list[str]:
        return [] if obj is None else self.get_fields(request, obj)

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
                data["items"],
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

    def _progress(self, obj: BulkJob) -> services.Progress:
        cache = self.__dict__.setdefault("_progress_cache", {})
        if obj.pk not in cache:
            cache[obj.pk] = services.progress(obj)
        return cache[obj.pk]

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> Any:
        self.__dict__["_progress_cache"] = {}
        return super().changelist_view(request, extra_context)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict | None = None
    ) -> Any:
        self.__dict__["_progress_cache"] = {}
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description=_("done / failed / total"))
    def progress(self, obj: BulkJob) -> str:
        p = self._progress(obj)
        return f"{p.done} / {p.failed} / {p.total}"

    @admin.display(description=_("tokens/s"))
    def tokens_per_s(self, obj: BulkJob) -> str:
        return f"{self._progress(obj).tokens_per_s:.1f}"

    @admin.display(description=_("ETA"))
    def eta(self, obj: BulkJob) -> str:
        eta = self._progress(obj).eta_s
        return "-" if eta is None else f"{int(eta // 60)}m {int(eta % 60):02d}s"

    @admin.display(description=_("items"))
    def items(self, obj: BulkJob) -> str:
        url = reverse("admin:llmserve_bulkitem_changelist") + f"?job__id__exact={obj.pk}"
        return format_html('<a href="{}">{}</a>', url, _("results of each item"))

    @admin.action(description=_("Cancel selected jobs"))
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[BulkJob]) -> None:
        count = sum(services.cancel_job(job) for job in queryset)
        level = messages.SUCCESS if count else messages.WARNING
        self.message_user(request, ngettext("%d job cancelled.", "%d jobs cancelled.", count) % count, level)


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
