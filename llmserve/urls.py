"""Include with ``path("", include("llmserve.urls"))``: the OpenAI API lives under /v1/ as clients expect."""

from django.urls import include, path, re_path

from llmserve import views
from llmserve.api import completions, docs, health, metrics, models, responses_api, tokenize

app_name = "llmserve"

urlpatterns = [
    path("v1/completions", completions.completions, name="completions"),
    path("v1/chat/completions", completions.chat_completions, name="chat-completions"),
    path("v1/responses", responses_api.create, name="responses"),
    path("v1/responses/<str:response_id>", responses_api.detail, name="response-detail"),
    path("v1/models", models.model_list, name="model-list"),
    path("v1/models/<path:model_id>", models.model_detail, name="model-detail"),
    path("health", health.health, name="health"),
    path("metrics", metrics.metrics, name="metrics"),
    path("tokenize", tokenize.tokenize, name="tokenize"),
    path("detokenize", tokenize.detokenize, name="detokenize"),
    path("tokenizer_info", tokenize.tokenizer_info, name="tokenizer-info"),
    path("openapi.json", docs.openapi_json, name="openapi"),
    path("docs", docs.page, name="docs"),
    path("", include("llmserve.bulk.urls")),  # the Batch API: /v1/files, /v1/batches
    re_path(r"^v1/", docs.not_found, name="api-not-found"),  # OpenAI's JSON 404, not an HTML page
    path("chat/", views.chat, name="chat"),
]
