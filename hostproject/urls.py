from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="llmserve:chat")),
    # settings.LOGIN_URL: the standalone project's users are its admins (run.py creates the first one).
    path("accounts/login/", admin.site.login, name="login"),
    path("admin/", admin.site.urls),
    path("", include("llmserve.urls")),
]
