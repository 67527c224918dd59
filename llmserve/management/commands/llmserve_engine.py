"""Run an engine process for a model configuration registered in the admin.

It builds the ``python -m inference_engine serve`` command line from the ModelConfig row and the LLMSERVE
settings (Redis URL, bus prefix, thread count) and replaces this process with it, so signals reach the engine
directly and the engine's own clean shutdown applies.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inference_engine.config import engine_flags
from llmserve import conf
from llmserve.models import ModelConfig


def serve_command(model: ModelConfig, extra: list[str] | None = None) -> list[str]:
    """The engine's command line for `model` (engine flags from the row, bus flags from the settings)."""
    cmd = [
        sys.executable,
        "-m",
        "inference_engine",
        "serve",
        "--served-model-name",
        model.name,
        "--prefix",
        conf.get("BUS_PREFIX"),
    ]
    if conf.get("REDIS_URL"):
        cmd += ["--redis-url", conf.get("REDIS_URL")]
    if model.model_path:
        cmd += ["--model", model.model_path]
    if conf.get("ENGINE_THREADS"):
        cmd += ["--threads", str(conf.get("ENGINE_THREADS"))]
    return cmd + engine_flags(model.engine_args()) + (extra or [])


class Command(BaseCommand):
    help = "Start an engine serving a model configuration from the admin (extra arguments go to the engine)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="served name of a ModelConfig")
        parser.add_argument("--print", action="store_true", help="print the command instead of running it")
        parser.add_argument("engine_flags", nargs="*", help="extra `serve` flags, after --")

    def handle(self, *args: Any, name: str, engine_flags: list[str], **options: Any) -> None:
        try:
            model = ModelConfig.objects.get(name=name)
        except ModelConfig.DoesNotExist:
            raise CommandError(f"No model configuration named {name!r}.") from None
        if not model.enabled:
            raise CommandError(f"Model configuration {name!r} is disabled.")
        cmd = serve_command(model, engine_flags)
        if options["print"]:
            self.stdout.write(" ".join(cmd))
            return
        sys.stdout.flush()
        os.execv(cmd[0], cmd)
