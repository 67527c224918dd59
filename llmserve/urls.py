"""Include with ``path("", include("llmserve.urls"))``: the OpenAI API lives under /v1/ as clients expect."""

from django.urls import include, path, re_path

from llmserve import views
from llmserve.api import (
    completions,
    docs,
    embeddings,
    files,
    health,
    lora,
    metrics,
    models,
    responses_api,
    tokenize,
    version,
)

app_name = "llmserve"

urlpatterns = [
    path("v1/completions", completions.completions, name="completions"),
    path("v1/chat/completions", completions.chat_completions, name="chat-completions"),
    path("v1/embeddings", embeddings.embeddings, name="embeddings"),
    path("v1/responses", responses_api.create, name="responses"),
    path("v1/responses/<str:response_id>", responses_api.detail, name="response-detail"),
    path(
        "v1/responses/<str:response_id>/input_items", responses_api.input_items, name="response-input-items"
    ),
    path("v1/models", models.model_list, name="model-list"),
    path("v1/models/<path:model_id>", models.model_detail, name="model-detail"),
    path("v1/load_lora_adapter", lora.load_lora_adapter, name="load-lora-adapter"),
    path("v1/unload_lora_adapter", lora.unload_lora_adapter, name="unload-lora-adapter"),
    path("health", health.health, name="health"),
    path("ping", version.ping, name="ping"),
    path("version", version.version, name="version"),
    path("metrics", metrics.metrics, name="metrics"),
    path("tokenize", tokenize.tokenize, name="tokenize"),
    path("detokenize", tokenize.detokenize, name="detokenize"),
    path("tokenizer_info", tokenize.tokenizer_info, name="tokenizer-info"),
    path("openapi.json", docs.openapi_json, name="openapi"),
    path("docs", docs.page, name="docs"),
    # The Files API: listing and deletion here, upload and retrieval in the Batch API's views.
    path("v1/files", files.collection, name="file-collection"),
    path("v1/files/<str:file_id>", files.item, name="file-item"),
    path("", include("llmserve.bulk.urls")),  # the Batch API: /v1/files/{id}/content, /v1/batches
    # OpenAI's JSON 404, not an HTML page, under /v1/ and on the paths vLLM serves that llmserve does not.
    re_path(r"^v1/", docs.not_found, name="api-not-found"),
    re_path(
        r"^(?:v2/.*|score|rerank|pooling|classify|embeddings|invocations|server_info|is_sleeping|sleep|wake_up"
        r"|reset_prefix_cache|get_tokenizer_info|start_profile|stop_profile|load_lora_adapter"
        r"|unload_lora_adapter)/?$",
        docs.not_found,
        name="vllm-not-served",
    ),
    path("chat/", views.chat, name="chat"),
]
