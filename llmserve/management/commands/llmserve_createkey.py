"""Create an API key from the command line (scripts, first setup). The key is printed once, never stored."""

from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandParser

from llmserve.models import APIKey


class Command(BaseCommand):
    help = "Create an API key and print it (only its hash is stored: copy it now)."
    # Like Django's changepassword: it only writes the database, so the bus's checks must not stop it.
    requires_system_checks: ClassVar[list[str]] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="who or what uses the key")
        parser.add_argument("--rate-limit", type=int, help="requests per minute (default: the setting)")

    def handle(self, *args: Any, name: str, rate_limit: int | None, **options: Any) -> None:
        _, raw = APIKey.objects.create_key(name, rate_limit=rate_limit)
        self.stdout.write(raw)
