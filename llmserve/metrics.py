"""Prometheus metrics with the meanings of vLLM's, under ``llmserve_`` names, labelled by model.

Two sources: latencies (time to first token, inter-token latency, end-to-end latency, queue time) and request
counts are observed by this web process as it streams answers; engine state (running / waiting requests, KV
usage, token counters, preemptions) comes from the replicas' heartbeats when /metrics is scraped. Written
out by hand in the text exposition format: a few dozen lines, no extra dependency.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterable

from inference_engine.bus.protocol import ModelInfo

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = defaultdict(lambda: [0] * (len(buckets) + 1))
        self._sums: dict[str, float] = defaultdict(float)

    def observe(self, model: str, value: float) -> None:
        with self._lock:
            self._counts[model][bisect.bisect_left(self.buckets, value)] += 1
            self._sums[model] += value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        with self._lock:
            for model, counts in sorted(self._counts.items()):
                total = 0
                for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                    total += count
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    yield f"{self.name}_bucket{_labels(model_name=model, le=le)} {total}"
                yield f"{self.name}_sum{_labels(model_name=model)} {self._sums[model]}"
                yield f"{self.name}_count{_labels(model_name=model)} {total}"


class Counter:
    def __init__(self, name: str, help_text: str, label: str | None = None) -> None:
        self.name, self.help, self.label = name, help_text, label
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], float] = defaultdict(float)

    def inc(self, model: str, amount: float = 1.0, label_value: str = "") -> None:
        with self._lock:
            self._values[(model, label_value)] += amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        with self._lock:
            for (model, extra), value in sorted(self._values.items()):
                labels = {"model_name": model, **({self.label: extra} if self.label else {})}
                yield f"{self.name}{_labels(**labels)} {value}"


TIME_TO_FIRST_TOKEN = Histogram(
    "llmserve_time_to_first_token_seconds", "Time from receiving a request to its first generated token."
)
INTER_TOKEN_LATENCY = Histogram(
    "llmserve_inter_token_latency_seconds", "Time between consecutive generated tokens of a request."
)
E2E_LATENCY = Histogram(
    "llmserve_e2e_request_latency_seconds", "Time from receiving a request to its last token."
)
QUEUE_TIME = Histogram(
    "llmserve_request_queue_time_seconds", "Time a request waited on the bus before an engine accepted it."
)
REQUESTS = Counter(
    "llmserve_request_success_total", "Finished requests, by finish reason.", "finished_reason"
)
PROMPT_TOKENS_SERVED = Counter(
    "llmserve_request_prompt_tokens_total", "Prompt tokens of requests served here."
)
GENERATION_TOKENS_SERVED = Counter(
    "llmserve_request_generation_tokens_total", "Generated tokens of requests served here."
)
WEB_METRICS = (
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_LATENCY,
    QUEUE_TIME,
    REQUESTS,
    PROMPT_TOKENS_SERVED,
    GENERATION_TOKENS_SERVED,
)

# Engine metrics from heartbeats: (name, type, help, heartbeat stat, aggregate over replicas).
_ENGINE_METRICS = (
    (
        "llmserve_num_requests_running",
        "gauge",
        "Requests in the engines' running batches.",
        "num_running",
        sum,
    ),
    (
        "llmserve_num_requests_waiting",
        "gauge",
        "Requests waiting in the engines' schedulers.",
        "num_waiting",
        sum,
    ),
    (
        "llmserve_kv_cache_usage_perc",
        "gauge",
        "Fraction of KV-cache blocks in use (mean over replicas).",
        "kv_usage",
        lambda values: sum(values) / len(values),
    ),
    (
        "llmserve_prompt_tokens_total",
        "counter",
        "Prompt tokens processed by the engines.",
        "prompt_tokens_total",
        sum,
    ),
    (
        "llmserve_generation_tokens_total",
        "counter",
        "Tokens generated by the engines.",
        "generation_tokens_total",
        sum,
    ),
    (
        "llmserve_num_preemptions_total",
        "counter",
        "Requests preempted by the engines' schedulers.",
        "num_preemptions",
        sum,
    ),
)


def render(models: list[ModelInfo]) -> str:
    lines: list[str] = []
    for name, kind, help_text, stat, aggregate in _ENGINE_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for model in models:
            values = [r.data.get("stats", {}).get(stat, 0) for r in model.replicas]
            lines.append(f"{name}{_labels(model_name=model.name)} {aggregate(values)}")
    lines.append("# HELP llmserve_engine_replicas Live engine replicas.")
    lines.append("# TYPE llmserve_engine_replicas gauge")
    lines += [f"llmserve_engine_replicas{_labels(model_name=m.name)} {len(m.replicas)}" for m in models]
    for metric in WEB_METRICS:
        lines += metric.render()
    return "\n".join(lines) + "\n"
