"""Include with ``path("", include("llmserve.urls"))``: the OpenAI API lives under /v1/ as clients expect."""

from django.urls import include, path

from llmserve import views
from llmserve.api import completions, health, metrics, models, tokenize

app_name = "llmserve"

urlpatterns = [
    path("v1/completions", completions.completions, name="completions"),
    path("v1/chat/completions", completions.chat_completions, name="chat-completions"),
    path("v1/models", models.model_list, name="model-list"),
    path("v1/models/<path:model_id>", models.model_detail, name="model-detail"),
    path("health", health.health, name="health"),
    path("metrics", metrics.metrics, name="metrics"),
    path("tokenize", tokenize.tokenize, name="tokenize"),
    path("detokenize", tokenize.detokenize, name="detokenize"),
    path("", include("llmserve.bulk.urls")),  # the Batch API: /v1/files, /v1/batches
    path("chat/", views.chat, name="chat"),
]
