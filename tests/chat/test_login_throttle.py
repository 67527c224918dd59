"""Login throttling (django-axes) on the admin's and the chat's sign-in: after the configured number of wrong
passwords from one address, even the right password is refused (429) until the cool-off; another address is
not locked out, and a success before the limit starts the count over."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import Client

pytestmark = pytest.mark.django_db

PASSWORD = "right-password-123"


@pytest.fixture
def admin_user(django_user_model):
    return django_user_model.objects.create_superuser("boss", "", PASSWORD)


def _sign_in(client: Client, path: str, password: str, address: str = "10.0.0.1"):
    return client.post(path, {"username": "boss", "password": password}, REMOTE_ADDR=address)


@pytest.mark.parametrize("path", ["/admin/login/", "/accounts/login/"])
def test_wrong_passwords_lock_the_sign_in_out(admin_user, path) -> None:
    client = Client()
    limit = settings.AXES_FAILURE_LIMIT
    for _ in range(limit - 1):
        assert _sign_in(client, path, "wrong").status_code == 200  # the form again, with its error
    assert _sign_in(client, path, "wrong").status_code == 429  # the limit-th failure locks out
    locked = _sign_in(client, path, PASSWORD)
    assert locked.status_code == 429 and "_auth_user_id" not in client.session
    # Another address signs in: a stranger cannot lock the admin out everywhere.
    assert _sign_in(Client(), path, PASSWORD, address="10.0.0.2").status_code == 302


def test_a_success_starts_the_count_over(admin_user) -> None:
    limit = settings.AXES_FAILURE_LIMIT
    for _ in range(limit - 1):
        _sign_in(Client(), "/admin/login/", "wrong")
    assert _sign_in(Client(), "/admin/login/", PASSWORD).status_code == 302
    for _ in range(limit - 1):
        assert _sign_in(Client(), "/admin/login/", "wrong").status_code == 200
    assert _sign_in(Client(), "/admin/login/", PASSWORD).status_code == 302
