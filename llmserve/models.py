"""Admin-managed state: the model configurations engines serve, and the API keys clients use."""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any

from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models, transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

KEY_PREFIX = "sk-llm-"
# What the engine resolves on the hub (inference_engine.model_loader.hub, which needs huggingface_hub).
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[A-Za-z0-9][\w.-]*)?$")
# What clients pass as `model`: a served model's or a LoRA adapter's name.
SERVED_NAME = RegexValidator(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$", _("Letters, digits and . _ : / - only."))


class ModelConfig(models.Model):
    """A model the deployment serves under ``name``, and how to start its engine.

    The fields mirror the engine's flags (``python -m inference_engine serve --help``); `engine_args()`
    turns them into the load message / command line an engine understands.
    """

    class Source(models.TextChoices):
        BUNDLED = "bundled", _("bundled default (SmolLM2-135M-Instruct)")
        HF_FOLDER = "hf", _("Hugging Face folder")
        GGUF = "gguf", _("GGUF file")
        HUB = "hub", _("Hugging Face hub id")

    class Quantization(models.TextChoices):
        DECLARED = "", _("as the checkpoint declares")
        AWQ = "awq", "AWQ"
        GPTQ = "gptq", "GPTQ"
        GGUF = "gguf", "GGUF"
        INT8 = "int8", _("int8 (quantized on load)")
        NONE = "none", _("none (dequantize to dtype)")

    class Runner(models.TextChoices):
        GENERATE = "generate", _("generate (chat and completions)")
        POOLING = "pooling", _("pooling (embeddings)")

    class DType(models.TextChoices):
        AUTO = "auto", "auto"
        FLOAT32 = "float32", "float32"
        BFLOAT16 = "bfloat16", "bfloat16"
        FLOAT16 = "float16", "float16"

    name = models.CharField(
        _("served name"),
        max_length=100,
        unique=True,
        validators=[SERVED_NAME],
        help_text=_("The name clients pass as `model`."),
    )
    source = models.CharField(_("source"), max_length=10, choices=Source.choices, default=Source.BUNDLED)
    path = models.CharField(
        _("path"),
        max_length=500,
        blank=True,
        help_text=_(
            "Folder or .gguf file on the engine host, or a hub id: org/name, or org/name:QUANT for a GGUF "
            "file in the repo (e.g. :Q4_K_M); empty for the bundled model."
        ),
    )
    revision = models.CharField(
        _("revision"), max_length=100, blank=True, help_text=_("Branch, tag or commit of a hub model.")
    )
    runner = models.CharField(
        _("runner"),
        max_length=10,
        choices=Runner.choices,
        default=Runner.GENERATE,
        help_text=_("vLLM's --runner: a pooling engine answers /v1/embeddings and refuses generation."),
    )
    quantization = models.CharField(
        _("quantization"), max_length=10, choices=Quantization.choices, default="", blank=True
    )
    tensor_parallel_size = models.PositiveSmallIntegerField(
        _("tensor parallel size"),
        default=1,
        validators=[MinValueValidator(1)],
        help_text=_("Ranks (GPUs, or groups of CPU cores) the model is split across."),
    )
    speculative_config = models.JSONField(
        _("speculative decoding"),
        null=True,
        blank=True,
        help_text=_(
            'vLLM\'s speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4}; empty = off.'
        ),
    )
    num_scheduler_steps = models.PositiveSmallIntegerField(
        _("decode steps per call"),
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text=_(
            "vLLM's num_scheduler_steps: while no other request waits, this many decode steps run in one "
            "native call (CPU), and tokens stream in bursts of as many; 1 = off."
        ),
    )
    dtype = models.CharField(_("dtype"), max_length=10, choices=DType.choices, default=DType.AUTO)
    max_model_len = models.PositiveIntegerField(
        _("max model length"), null=True, blank=True, help_text=_("Context length; empty = the model's own.")
    )
    block_size = models.PositiveSmallIntegerField(
        _("KV block size"), choices=[(8, 8), (16, 16), (32, 32)], default=16
    )
    max_num_seqs = models.PositiveIntegerField(
        _("max concurrent sequences"), default=256, validators=[MinValueValidator(1)]
    )
    kv_cache_memory_bytes = models.PositiveBigIntegerField(
        _("KV cache memory (bytes)"),
        null=True,
        blank=True,
        help_text=_("Explicit KV budget; empty = the engine's default (GPU share, or 1 GiB on CPU)."),
    )
    gpu_memory_utilization = models.FloatField(_("GPU memory utilization"), default=0.9)
    enable_prefix_caching = models.BooleanField(_("prefix caching"), default=True)
    max_loras = models.PositiveSmallIntegerField(
        _("LoRA slots"),
        default=4,
        validators=[MinValueValidator(1)],
        help_text=_(
            "vLLM's --max-loras: adapters in one batch at once (requests for others wait for a slot). "
            "Used when the model has enabled LoRA adapters."
        ),
    )
    max_lora_rank = models.PositiveSmallIntegerField(
        _("largest LoRA rank"),
        default=16,
        validators=[MinValueValidator(1)],
        help_text=_("vLLM's --max-lora-rank: adapters of a higher rank are refused."),
    )
    enabled = models.BooleanField(
        _("enabled"),
        default=True,
        help_text=_("Disabled models are refused by the API even if an engine serves them."),
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = _("model configuration")
        verbose_name_plural = _("model configurations")
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name

    @property
    def model_path(self) -> str | None:
        """What the engine's ``--model`` gets: ``None`` selects the bundled default."""
        return None if self.source == self.Source.BUNDLED else self.path

    def enabled_adapters(self) -> list[LoRAAdapter]:
        return [] if self.pk is None else list(self.adapters.filter(enabled=True).order_by("name"))

    def engine_args(self) -> dict[str, Any]:
        """Engine options by EngineConfig name (the supervisor's load message and `serve` flags use these),
        and `serve`'s ``lora_modules``: the enabled LoRA adapters, which the engine loads when it starts. A
        model with adapters starts with LoRA on even when none is enabled, so that enabling one needs no
        restart."""
        args: dict[str, Any] = {
            "runner": self.runner,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
        }
        if self.max_model_len:
            args["max_model_len"] = self.max_model_len
        if self.kv_cache_memory_bytes:
            args["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.revision:
            args["revision"] = self.revision
        if self.quantization:
            args["quantization"] = self.quantization
        if self.tensor_parallel_size != 1:
            args["tensor_parallel_size"] = self.tensor_parallel_size
        if self.speculative_config:
            args["speculative_config"] = self.speculative_config
        if self.num_scheduler_steps != 1:
            args["num_scheduler_steps"] = self.num_scheduler_steps
        if self.pk is not None and self.adapters.exists():  # disabled ones too: enabling one loads it live
            args["enable_lora"] = True
            args["max_loras"] = self.max_loras
            args["max_lora_rank"] = self.max_lora_rank
            args["lora_modules"] = [adapter.module_spec() for adapter in self.enabled_adapters()]
        return args

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        if self.source != self.Source.BUNDLED and not self.path:
            raise ValidationError({"path": _("A path is required for this source.")})
        if self.source == self.Source.HUB and not HUB_ID.match(self.path):
            raise ValidationError({"path": _("A hub id is org/name, or org/name:QUANT for a GGUF file.")})
        if self.revision and self.source != self.Source.HUB:
            raise ValidationError({"revision": _("Only hub models have revisions.")})
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValidationError({"gpu_memory_utilization": _("Must be in (0, 1].")})
        if self.speculative_config is not None and not isinstance(self.speculative_config, dict):
            raise ValidationError({"speculative_config": _('A JSON object, e.g. {"method": "ngram"}.')})
        if LoRAAdapter.objects.filter(name=self.name).exists():
            raise ValidationError({"name": _("A LoRA adapter already has this name.")})
        if self.pk is not None:
            too_big = self.adapters.filter(enabled=True, rank__gt=self.max_lora_rank).first()
            if too_big is not None:
                raise ValidationError(
                    {
                        "max_lora_rank": _("The enabled adapter %(name)s has rank %(rank)d.")
                        % {"name": too_big.name, "rank": too_big.rank}
                    }
                )


class LoRAAdapter(models.Model):
    """A LoRA adapter (a PEFT checkpoint folder) served beside its base model under its own ``name``.

    The engines of ``base_model`` load the enabled adapters when they start (`ModelConfig.engine_args`), and
    the admin has running engines pick up a change (`llmserve.engines.sync_adapters`). ``path`` is a folder
    that the engines' host can read: typed in, or the folder an uploaded zip was extracted to
    (`llmserve.lora_files`).
    """

    name = models.CharField(
        _("served name"),
        max_length=100,
        unique=True,
        validators=[SERVED_NAME],
        help_text=_("The name clients pass as `model` to use this adapter."),
    )
    base_model = models.ForeignKey(
        ModelConfig,
        on_delete=models.CASCADE,
        related_name="adapters",
        verbose_name=_("base model"),
        limit_choices_to={"runner": ModelConfig.Runner.GENERATE},
    )
    path = models.CharField(
        _("path"),
        max_length=500,
        blank=True,
        help_text=_(
            "Folder holding adapter_config.json and adapter_model.safetensors, readable at this path on "
            "the engines' host; or leave empty and upload the folder as a zip."
        ),
    )
    uploaded = models.BooleanField(
        _("uploaded"), default=False, editable=False, help_text=_("`path` is where an upload was extracted.")
    )
    rank = models.PositiveSmallIntegerField(_("rank"), null=True, editable=False)
    target_modules = models.JSONField(_("target modules"), default=list, editable=False)
    enabled = models.BooleanField(
        _("enabled"), default=True, help_text=_("Engines of the base model serve enabled adapters only.")
    )
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated"), auto_now=True)

    class Meta:
        verbose_name = _("LoRA adapter")
        verbose_name_plural = _("LoRA adapters")
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name

    def module_spec(self) -> str:
        """This adapter as a `serve --lora-modules` value."""
        return f"{self.name}={self.path}"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        if ModelConfig.objects.filter(name=self.name).exists():
            raise ValidationError({"name": _("A model configuration already has this name.")})
        if not self.path:
            raise ValidationError({"path": _("Give the adapter's folder, or upload it as a zip.")})
        base = ModelConfig.objects.filter(pk=self.base_model_id).first()
        if base is None:
            return
        if base.runner != ModelConfig.Runner.GENERATE:
            raise ValidationError({"base_model": _("Adapters need a model that generates.")})
        if self.rank is not None and self.rank > base.max_lora_rank:
            raise ValidationError(
                _(
                    "The adapter's rank %(rank)d is above its base model's largest LoRA rank "
                    "(%(limit)d): raise that limit on %(base)s first."
                )
                % {"rank": self.rank, "limit": base.max_lora_rank, "base": base.name}
            )


def hash_key(raw_key: str) -> str:
    """SHA-256 of a key. Keys are 256-bit random tokens, so a fast hash is enough (no dictionary to guess
    from) and lets the lookup be a single indexed query."""
    return hashlib.sha256(raw_key.encode()).hexdigest()


class APIKeyManager(models.Manager["APIKey"]):
    def create_key(self, name: str, **fields: Any) -> tuple[APIKey, str]:
        """Create a key; returns the row and the raw key, which is stored nowhere and cannot be shown
        again."""
        raw = KEY_PREFIX + secrets.token_urlsafe(32)
        key = self.create(name=name, prefix=raw[: len(KEY_PREFIX) + 6], hashed_key=hash_key(raw), **fields)
        return key, raw

    def get_usable(self, raw_key: str) -> APIKey | None:
        return self.filter(hashed_key=hash_key(raw_key), revoked=False).first()


class APIKey(models.Model):
    """A client's API key. Only its hash is stored; ``prefix`` (the first characters) identifies it in the
    admin and in logs without revealing it."""

    name = models.CharField(_("name"), max_length=100, help_text=_("Who or what uses this key."))
    prefix = models.CharField(_("prefix"), max_length=20, editable=False, db_index=True)
    hashed_key = models.CharField(max_length=64, unique=True, editable=False)
    rate_limit = models.PositiveIntegerField(
        _("rate limit (requests/minute)"),
        null=True,
        blank=True,
        help_text=_("Empty = the LLMSERVE['DEFAULT_RATE_LIMIT'] setting; 0 = unlimited."),
    )
    min_priority = models.IntegerField(
        _("most urgent priority"),
        null=True,
        blank=True,
        help_text=_(
            "The lowest request `priority` this key may ask for (lower runs earlier; requests that give "
            "none run at 0). Empty = the LLMSERVE['MIN_PRIORITY'] setting."
        ),
    )
    allowed_models = models.JSONField(
        _("allowed models"),
        default=list,
        blank=True,
        help_text=_(
            "The models and LoRA adapters this key may use, by served name; empty = all of them. Others "
            "answer as if they did not exist."
        ),
    )
    revoked = models.BooleanField(_("revoked"), default=False)
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    last_used_at = models.DateTimeField(_("last used"), null=True, blank=True, editable=False)

    objects = APIKeyManager()

    class Meta:
        verbose_name = _("API key")
        verbose_name_plural = _("API keys")
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def effective_rate_limit(self) -> int:
        from llmserve import conf

        return conf.get("DEFAULT_RATE_LIMIT") if self.rate_limit is None else self.rate_limit

    def effective_min_priority(self) -> int:
        from llmserve import conf

        return conf.get("MIN_PRIORITY") if self.min_priority is None else self.min_priority

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models

    def revoke(self) -> None:
        self.revoked = True
        self.save(update_fields=["revoked"])

    def needs_touch(self) -> bool:
        """Whether ``last_used_at`` is stale enough to be worth a write (at most one write a minute)."""
        return self.last_used_at is None or (timezone.now() - self.last_used_at).total_seconds() > 60


class KeyUsage(APIKey):
    """An API key as the bulk admin shows it: the tokens of the Batch API jobs it created."""

    class Meta:
        proxy = True
        verbose_name = _("bulk usage of an API key")
        verbose_name_plural = _("bulk usage per API key")


@receiver(post_delete, sender=LoRAAdapter)
def _remove_uploaded_files(instance: LoRAAdapter, **kwargs: Any) -> None:
    """An uploaded adapter's extracted folder goes with it (deleted in the admin, or with its base model),
    once the deletion is committed."""
    if instance.uploaded:
        from llmserve import lora_files

        transaction.on_commit(lambda: lora_files.remove_upload(instance.path))


# Bulk jobs and the Batch API keep their models in their own module; importing them here registers them.
from llmserve.bulk.models import Batch, BatchFile, BulkItem, BulkJob  # noqa: E402, F401


class StoredResponse(models.Model):
    """A response of the Responses API (``/v1/responses``), kept so that clients can retrieve it and continue
    the conversation with ``previous_response_id``."""

    id = models.CharField(primary_key=True, max_length=64)
    owner = models.ForeignKey(
        APIKey, null=True, blank=True, on_delete=models.CASCADE, help_text=_("Only this key may read it.")
    )
    model = models.CharField(_("model"), max_length=100)
    # The conversation this response continues and answered, as chat messages without the instructions
    # (OpenAI does not carry instructions over to the next response).
    conversation = models.JSONField(default=list)
    body = models.JSONField(help_text=_("The response object as returned."))
    created_at = models.DateTimeField(_("created"), default=timezone.now, db_index=True)

    class Meta:
        verbose_name = _("stored response")
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return self.id
