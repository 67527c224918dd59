"""Timed choices kept on disk: a plan timed once per machine is read back by later engine starts.

The file lies beside the built kernels, whose name changes with their sources, compiler flags and CPU, so a
plan is never read on a machine or a build it was not timed on. Delete the file to time again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve_kernels.cpu._build import library_path


@dataclass(frozen=True)
class Plan:
    """Up to how many rows the native routine runs, and whether the other one is kept for more."""

    native_rows: float
    keep_other: bool


def remembered(key: str, time_it: Callable[[], Plan]) -> Plan:
    """The plan stored under `key` for this build and torch version, else `time_it()`'s, stored for the next
    start (where the cache is writable)."""
    path = library_path().with_suffix(".plans.json")
    key = f"{key} torch {torch.__version__}"
    plans = _read_plans(path)
    if key in plans:
        return Plan(*plans[key])
    plan = time_it()
    plans = _read_plans(path)  # again: another engine may have added plans meanwhile
    plans[key] = [plan.native_rows, plan.keep_other]
    try:
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(plans))
        scratch.replace(path)
    except OSError:  # no writable cache: the plan serves this process only
        pass
    return plan


def _read_plans(path: Path) -> dict:
    """The plans file's contents; empty where it is missing or damaged (its plans are then timed again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
