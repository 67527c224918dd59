"""Include with ``path("", include("llmserve.urls"))``: the OpenAI API lives under /v1/ as clients expect."""

app_name = "llmserve"

urlpatterns: list = []
