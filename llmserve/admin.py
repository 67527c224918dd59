"""Admin: model configurations with their live engine state and load / unload actions; their LoRA adapters
(a folder path or an uploaded zip; running engines pick up a change at once); API keys."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.validators import FileExtensionValidator
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from inference_engine.errors import EngineError
from llmserve import bus, conf, lookups, lora_files
from llmserve.engines import EngineState, live_models, sync_adapters
from llmserve.models import SERVED_NAME, APIKey, LoRAAdapter, ModelConfig


@admin.register(ModelConfig)
class ModelConfigAdmin(admin.ModelAdmin):
    list_display = ("name", "source", "enabled", "engine_status", "requests", "kv_usage", "throughput")
    list_filter = ("enabled", "source")
    search_fields = ("name", "path")
    actions = ("load_models", "unload_models", "restart_models")
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
        (_("LoRA adapters"), {"fields": ("max_loras", "max_lora_rank")}),
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

    @admin.action(description=_("Restart selected models' engines with their current settings"))
    def restart_models(self, request: HttpRequest, queryset: QuerySet[ModelConfig]) -> None:
        """Unload, then load: the supervisor handles its messages in order, so the engines drain and start
        again with the entry's engine arguments (e.g. LoRA on, for an engine started without adapters)."""

        def restart(client: Any, model: ModelConfig) -> None:
            supervisor = conf.get("SUPERVISOR")
            client.unload_model(model.name, supervisor=supervisor)
            client.load_model(
                model.name, model.model_path, engine_args=model.engine_args(), supervisor=supervisor
            )

        self._control(request, queryset, restart, _("restart"))

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


class LoRAAdapterForm(forms.ModelForm):
    """The adapter's folder as a path, or uploaded as a zip (checked here, extracted when saved)."""

    archive = forms.FileField(
        label=_("upload (zip)"),
        required=False,
        validators=[FileExtensionValidator(["zip"])],
        help_text=_(
            "The folder peft's save_pretrained wrote (adapter_config.json and adapter_model.safetensors), "
            "zipped; it replaces the path."
        ),
    )

    class Meta:
        model = LoRAAdapter
        fields = ("name", "base_model", "path", "enabled")

    upload: lora_files.AdapterZip | None = None

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        archive = data.get("archive")
        try:
            if archive:
                self.upload = lora_files.AdapterZip(archive)
                info = self.upload.info
                data["path"] = "(uploaded)"  # `save_model` puts the folder it extracts the zip to
            elif data.get("path") and ("path" in self.changed_data or self.instance.rank is None):
                info = lora_files.inspect_folder(data["path"])
            else:
                return data
        except lora_files.AdapterFileError as exc:
            raise forms.ValidationError({"archive" if archive else "path": str(exc)}) from None
        self.instance.rank, self.instance.target_modules = info.rank, info.target_modules
        return data


@admin.register(LoRAAdapter)
class LoRAAdapterAdmin(admin.ModelAdmin):
    form = LoRAAdapterForm
    list_display = ("name", "base_model", "enabled", "rank", "targets", "served", "updated_at")
    list_filter = ("enabled", "base_model")
    list_select_related = ("base_model",)
    search_fields = ("name", "path")
    readonly_fields = ("rank", "targets", "uploaded", "created_at", "updated_at")
    actions = ("enable_adapters", "disable_adapters")
    fieldsets = (
        (None, {"fields": ("name", "base_model", "enabled")}),
        (_("Files"), {"fields": ("path", "archive", "uploaded", "rank", "targets")}),
        (None, {"fields": ("created_at", "updated_at")}),
    )

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None) -> HttpResponse:
        self._live = live_models()  # one bus round trip per page
        return super().changelist_view(request, extra_context)

    @admin.display(description=_("targets"))
    def targets(self, obj: LoRAAdapter) -> str:
        return ", ".join(obj.target_modules) or "-"

    @admin.display(description=_("served"), boolean=True)
    def served(self, obj: LoRAAdapter) -> bool | None:
        info = getattr(self, "_live", {}).get(obj.base_model.name)
        return None if info is None else obj.name in info.adapters

    def save_model(self, request: HttpRequest, obj: LoRAAdapter, form: Any, change: bool) -> None:
        before = (
            LoRAAdapter.objects.select_related("base_model").filter(pk=obj.pk).first() if change else None
        )
        if form.upload is not None:
            obj.path, obj.uploaded = str(form.upload.extract(obj.name)), True
        elif "path" in form.changed_data:
            obj.uploaded = False
        super().save_model(request, obj, form, change)
        if before is not None and before.uploaded and before.path != obj.path:
            transaction.on_commit(lambda: lora_files.remove_upload(before.path))
        reload = before is not None and (before.path != obj.path or before.base_model_id != obj.base_model_id)
        if before is not None and (before.base_model_id != obj.base_model_id or before.name != obj.name):
            self._sync(request, before.base_model, {before.name})
        self._sync(request, obj.base_model, {obj.name}, reload=reload)

    def delete_model(self, request: HttpRequest, obj: LoRAAdapter) -> None:
        self.delete_queryset(request, LoRAAdapter.objects.filter(pk=obj.pk))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[LoRAAdapter]) -> None:
        gone = list(queryset.select_related("base_model"))
        super().delete_queryset(request, queryset)  # post_delete removes uploaded folders
        self._sync_each(request, gone)

    @admin.action(description=_("Enable selected adapters"))
    def enable_adapters(self, request: HttpRequest, queryset: QuerySet[LoRAAdapter]) -> None:
        self._switch(request, queryset, True)

    @admin.action(description=_("Disable selected adapters"))
    def disable_adapters(self, request: HttpRequest, queryset: QuerySet[LoRAAdapter]) -> None:
        self._switch(request, queryset, False)

    def _switch(self, request: HttpRequest, queryset: QuerySet[LoRAAdapter], enabled: bool) -> None:
        switched = []
        for adapter in queryset.select_related("base_model"):
            if enabled and adapter.rank is not None and adapter.rank > adapter.base_model.max_lora_rank:
                self.message_user(
                    request,
                    _("%(name)s not enabled: its rank %(rank)d is above %(base)s's largest LoRA rank.")
                    % {"name": adapter.name, "rank": adapter.rank, "base": adapter.base_model.name},
                    messages.ERROR,
                )
                continue
            adapter.enabled = enabled
            adapter.save(update_fields=["enabled", "updated_at"])
            switched.append(adapter)
        self._sync_each(request, switched)

    def _sync_each(self, request: HttpRequest, adapters: list[LoRAAdapter]) -> None:
        by_base: dict[int, tuple[ModelConfig, set[str]]] = {}
        for adapter in adapters:
            by_base.setdefault(adapter.base_model_id, (adapter.base_model, set()))[1].add(adapter.name)
        for base, names in by_base.values():
            self._sync(request, base, names)

    def _sync(self, request: HttpRequest, base: ModelConfig, names: set[str], reload: bool = False) -> None:
        """Tell the admin user what the running engines of `base` did about the adapters `names`."""
        for level, text in sync_adapters(base, names, reload=reload):
            self.message_user(request, text, level)


class APIKeyForm(forms.ModelForm):
    """`allowed_models` as text: names separated by commas or new lines."""

    allowed_models = forms.CharField(
        label=_("allowed models"),
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text=_(
            "Served names of the models and LoRA adapters this key may use, separated by commas or new "
            "lines; empty = all. Others answer 404 model_not_found and are left out of /v1/models."
        ),
    )

    class Meta:
        model = APIKey
        fields = ("name", "rate_limit", "min_priority", "allowed_models", "revoked")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial["allowed_models"] = "\n".join(self.instance.allowed_models or [])

    def clean_allowed_models(self) -> list[str]:
        names = [n.strip() for n in self.cleaned_data["allowed_models"].replace(",", "\n").splitlines()]
        names = list(dict.fromkeys(n for n in names if n))
        for name in names:
            SERVED_NAME(name)
        return names


@admin.register(APIKey)
class APIKeyAdmin(admin.ModelAdmin):
    form = APIKeyForm
    list_display = ("name", "prefix", "rate_limit", "models", "revoked", "created_at", "last_used_at")
    list_filter = ("revoked",)
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "created_at", "last_used_at")
    actions = ("revoke_keys",)

    def get_fields(self, request: HttpRequest, obj: APIKey | None = None) -> list[str]:
        if obj is None:  # the key itself is generated, never typed in
            return ["name", "rate_limit", "min_priority", "allowed_models"]
        return [
            "name",
            "prefix",
            "rate_limit",
            "min_priority",
            "allowed_models",
            "revoked",
            "created_at",
            "last_used_at",
        ]

    @admin.display(description=_("models"))
    def models(self, obj: APIKey) -> str:
        return ", ".join(obj.allowed_models) or _("all")

    def save_model(self, request: HttpRequest, obj: APIKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        created, raw = APIKey.objects.create_key(
            obj.name,
            rate_limit=obj.rate_limit,
            min_priority=obj.min_priority,
            allowed_models=obj.allowed_models,
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
