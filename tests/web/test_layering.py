"""The web tier must run without torch: importing the app's modules (with Django set up) must not load it."""

from __future__ import annotations

import os
import subprocess
import sys

from .stack import ROOT

SCRIPT = """
import sys
import django
django.setup()
import hostproject.asgi, hostproject.urls
import llmserve.admin, llmserve.models, llmserve.urls, llmserve.bus, llmserve.metrics, llmserve.checks
import llmserve.api.completions, llmserve.api.models, llmserve.api.health, llmserve.api.tokenize
import llmserve.api.metrics
import llmserve.management.commands.llmserve_engine, llmserve.management.commands.llmserve_createkey
heavy = sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules)
assert not heavy, heavy
print("ok")
"""


def test_web_tier_does_not_import_torch() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "hostproject.settings", "DJANGO_SECRET_KEY": "x"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
