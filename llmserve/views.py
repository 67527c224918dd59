"""The browser chat page. The conversation itself runs over the WebSocket (`llmserve.consumers`)."""

from __future__ import annotations

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from llmserve import conf
from llmserve.routing import CHAT_PATH


@require_GET
def chat(request: HttpRequest) -> HttpResponse:
    """The page; when chat needs a login, send visitors to the project's login page first (the socket would
    refuse them anyway, and a login form explains it better than an error)."""
    if conf.get("CHAT_LOGIN_REQUIRED") and not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    return render(request, "llmserve/chat.html", {"chat_config": {"socket_path": "/" + CHAT_PATH}})
