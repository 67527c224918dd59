from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.urls import include, path
from django.views import defaults
from django.views.generic import RedirectView

from llmserve.api import errors

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="llmserve:chat")),
    # The chat's sign-in (settings.LOGIN_URL); the standalone project's users are made in the admin.
    path("accounts/login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("", include("llmserve.urls")),
]

# Errors raised before a view runs (a Host outside ALLOWED_HOSTS, an unknown URL): API clients get the
# OpenAI-shaped JSON error they can parse, people the usual pages.
API_PATHS = (
    "/v1/",
    "/v2/",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/version",
    "/ping",
    "/score",
    "/rerank",
    "/openapi.json",
)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if request.path.startswith(API_PATHS):
        return errors.BadRequest("The request was refused (bad Host header or malformed request).").response()
    return defaults.bad_request(request, exception)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if request.path.startswith(API_PATHS):
        return errors.NotFound(f"No such endpoint: {request.path}").response()
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if request.path.startswith(API_PATHS):
        return errors.InternalError("The server failed to handle the request.").response()
    return defaults.server_error(request)


handler400, handler404, handler500 = bad_request, page_not_found, server_error
