from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class LLMServeConfig(AppConfig):
    name = "llmserve"
    verbose_name = _("LLM serving")
    # Pinned so that a host project's DEFAULT_AUTO_FIELD never asks for a migration of ours.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from llmserve import checks  # noqa: F401  (registers the system checks)
