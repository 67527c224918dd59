"""Admin: model configurations with their live engine state and load / unload actions; API keys."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from inference_engine.errors import EngineError
from llmserve import bus, conf, lookups
from llmserve.engines import EngineState, live_models
from llmserve.models import APIKey, ModelConfig


@admin.register(ModelConfig)
class ModelConfigAdmin(admin.ModelAdmin):
    list_display = ("name", "source", "enabled", "engine_status", "requests", "kv_usage", "throughput")
    list_filter = ("enabled", "source")
    search_fields = ("name", "path")
    actions = ("load_models", "unload_models")
    fieldsets = (
        (None, {"fields": ("name", "enabled", "source", "path", "revision")}),
        (
            _("Engine"),
            {
                "fields": (
                    "runner",
                    "dtype",
                    "quantization",
                    "tensor_parallel_size",
                    "speculative_config",
                    "num_scheduler_steps",
                    "max_model_len",
                    "block_size",
                    "max_num_seqs",
                    "kv_cache_memory_bytes",
                    "gpu_memory_utilization",
                    "enable_prefix_caching",
                )
            },
        ),
    )

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        # One bus round trip per page, not one per row and column.
        self._live = live_models()
        return super().changelist_view(request, extra_context)

    def _state(self, obj: ModelConfig) -> EngineState:
        return EngineState.of(getattr(self, "_live", {}).get(obj.name))

    @admin.display(description=_("engine"))
    def engine_status(self, obj: ModelConfig) -> str:
        state = self._state(obj)
        return (
            ngettext("up (%(n)d replica)", "up (%(n)d replicas)", state.replicas) % {"n": state.replicas}
            if state.up
            else _("down")
        )

    @admin.display(description=_("running / waiting"))
    def requests(self, obj: ModelConfig) -> str:
        state = self._state(obj)
        return f"{state.running} / {state.waiting}" if state.up else "-"

    @admin.display(description=_("KV usage"))
    def kv_usage(self, obj: ModelConfig) -> str:
        state = self._state(obj)
        return f"{100 * state.kv_usage:.1f}%" if state.up else "-"

    @admin.display(description=_("tokens/s"))
    def throughput(self, obj: ModelConfig) -> str:
        state = self._state(obj)
        return f"{state.tokens_per_s:.1f}" if state.up else "-"

    @admin.action(description=_("Load selected models on the engine supervisor"))
    def load_models(self, request: HttpRequest, queryset: QuerySet[ModelConfig]) -> None:
        self._control(
            request,
            queryset,
            lambda c, m: c.load_model(
                m.name, m.model_path, engine_args=m.engine_args(), supervisor=conf.get("SUPERVISOR")
            ),
            _("load"),
        )

    @admin.action(description=_("Unload selected models"))
    def unload_models(self, request: HttpRequest, queryset: QuerySet[ModelConfig]) -> None:
        self._control(
            request,
            queryset,
            lambda c, m: c.unload_model(m.name, supervisor=conf.get("SUPERVISOR")),
            _("unload"),
        )

    def _control(self, request: HttpRequest, queryset: QuerySet[ModelConfig], send: Any, verb: str) -> None:
        client = bus.client()
        for model in queryset:
            try:
                send(client, model)
            except EngineError as exc:
                self.message_user(request, f"{model.name}: {exc}", messages.ERROR)
            else:
                self.message_user(
                    request, _("%(verb)s requested for %(name)s.") % {"verb": verb, "name": model.name}
                )


@admin.register(APIKey)
class APIKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "rate_limit", "revoked", "created_at", "last_used_at")
    list_filter = ("revoked",)
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "created_at", "last_used_at")
    actions = ("revoke_keys",)

    def get_fields(self, request: HttpRequest, obj: APIKey | None = None) -> list[str]:
        if obj is None:  # the key itself is generated, never typed in
            return ["name", "rate_limit", "min_priority"]
        return ["name", "prefix", "rate_limit", "min_priority", "revoked", "created_at", "last_used_at"]

    def save_model(self, request: HttpRequest, obj: APIKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created, raw = APIKey.objects.create_key(
            obj.name, rate_limit=obj.rate_limit, min_priority=obj.min_priority
        )
        obj.pk, obj.prefix, obj.hashed_key, obj.created_at = (
            created.pk,
            created.prefix,
            created.hashed_key,
            created.created_at,
        )
        obj._state.adding = False
        request._llmserve_raw_key = raw  # shown once by response_add, stored nowhere

    def response_add(
        self, request: HttpRequest, obj: APIKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        raw = getattr(request, "_llmserve_raw_key", None)
        if raw is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "key": obj,
            "raw_key": raw,
            "title": _("API key created"),
        }
        response = TemplateResponse(request, "llmserve/admin/apikey_created.html", context)
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description=_("Revoke selected keys"))
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[APIKey]) -> None:
        count = queryset.update(revoked=True)
        lookups.forget()  # update() sends no post_save
        self.message_user(request, ngettext("%d key revoked.", "%d keys revoked.", count) % count)


from llmserve.bulk import admin as bulk_admin  # noqa: E402, F401  (registers the bulk job admin)
