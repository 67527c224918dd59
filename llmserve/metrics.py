"""Prometheus metrics with the meanings of vLLM's, under ``llmserve_`` names and vLLM's own ``vllm:`` names
(so dashboards made for vLLM work), labelled by ``model_name``.

Two sources. The web processes observe each engine request as they stream it (`RequestTimer`): latencies,
finished requests by finish reason, and prompt / generated token counts per request. These live in
prometheus_client's multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` names a directory (the host
project's settings set one, and its run command empties it at start), so that several web workers add up;
without it, in this process. Engine state (running / waiting requests, KV usage, token totals, preemptions,
step time and the part of it in mixture-of-experts kernels, speculative decoding's drafts and accepted tokens,
requests per LoRA adapter as vLLM's ``lora_requests_info``) comes from the replicas' heartbeats when /metrics
is scraped; a model has a sample of each such metric where its replicas report it (speculative decoding's
only where it is configured, as vLLM registers them; the experts' time only where the model has experts on
the CPU).

The two agree: one engine request is one ``request_success`` (per sample, as vLLM counts the n samples of a
request), one time-to-first-token observation per sample that produced a token, and the sums of
``request_prompt_tokens`` / ``request_generation_tokens`` equal the engines' ``prompt_tokens`` /
``generation_tokens`` totals when every request came through the API and ran to its end.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from inference_engine.bus import routing
from inference_engine.bus.protocol import ModelInfo, RequestDelta

PREFIX, VLLM_PREFIX = "llmserve_", "vllm:"
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
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# vLLM names some of these differently across versions: each also goes out under these names.
_EXTRA_VLLM_NAMES = {
    "inter_token_latency_seconds": "time_per_output_token_seconds",
    "kv_cache_usage_perc": "gpu_cache_usage_perc",
}

# The web-side metrics: registered in prometheus_client's default registry, whose multiprocess values (files)
# `render` collects from every process.
TIME_TO_FIRST_TOKEN = Histogram(
    "llmserve_time_to_first_token_seconds",
    "Time from receiving a request to its first generated token.",
    ["model_name"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "llmserve_inter_token_latency_seconds",
    "Time between consecutive generated tokens of a request.",
    ["model_name"],
    buckets=LATENCY_BUCKETS,
)
E2E_LATENCY = Histogram(
    "llmserve_e2e_request_latency_seconds",
    "Time from receiving a request to its last token.",
    ["model_name"],
    buckets=LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "llmserve_request_queue_time_seconds",
    "Time a request waited on the bus before an engine accepted it.",
    ["model_name"],
    buckets=LATENCY_BUCKETS,
)
REQUEST_SUCCESS = Counter(
    "llmserve_request_success", "Finished requests, by finish reason.", ["model_name", "finished_reason"]
)
REQUEST_PROMPT_TOKENS = Histogram(
    "llmserve_request_prompt_tokens",
    "Prompt tokens of each finished request.",
    ["model_name"],
    buckets=TOKEN_BUCKETS,
)
REQUEST_GENERATION_TOKENS = Histogram(
    "llmserve_request_generation_tokens",
    "Generated tokens of each finished request (all its samples).",
    ["model_name"],
    buckets=TOKEN_BUCKETS,
)

# Where the bus client queued each interactive request (`inference_engine.bus.routing`): prefix,
# least_loaded or shared.
ROUTING_DECISIONS = Counter(
    "llmserve_routing_decisions",
    "Interactive requests by the policy that placed them.",
    ["model_name", "policy"],
)
routing.on_route(lambda model, policy: ROUTING_DECISIONS.labels(model, policy).inc())


class RequestTimer:
    """Observes one engine request into the metrics as its deltas arrive."""

    def __init__(self, model: str, received: float) -> None:
        self.model, self.received = model, received
        self.submitted = time.monotonic()
        self.prompt_tokens: int | None = None  # set once an engine accepted the request
        self.last_token: dict[int, float] = {}  # sample index -> when its latest token arrived
        self.tokens = 0
        self.done = False

    def accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        QUEUE_TIME.labels(self.model).observe(time.monotonic() - self.submitted)

    def delta(self, delta: RequestDelta) -> None:
        now = time.monotonic()
        for output in delta.outputs:
            if output.token_ids:
                self.tokens += len(output.token_ids)
                last = self.last_token.get(output.index)
                if last is None:
                    TIME_TO_FIRST_TOKEN.labels(self.model).observe(now - self.received)
                else:  # tokens that arrived together share the wait
                    for _ in output.token_ids:
                        INTER_TOKEN_LATENCY.labels(self.model).observe((now - last) / len(output.token_ids))
                self.last_token[output.index] = now
        if delta.finished:
            usage = delta.usage
            self._finish(
                [o.finish_reason or "unknown" for o in delta.outputs],
                usage.completion_tokens if usage else None,
            )

    def aborted(self) -> None:
        """The client went away or stopped the answer: count it as vLLM counts an abort."""
        if self.prompt_tokens is not None and not self.done:
            self._finish(["abort"] * max(1, len(self.last_token)), None)

    def _finish(self, reasons: list[str], generated: int | None) -> None:
        self.done = True
        e2e = time.monotonic() - self.received
        for reason in reasons:
            REQUEST_SUCCESS.labels(self.model, reason).inc()
            E2E_LATENCY.labels(self.model).observe(e2e)
        REQUEST_PROMPT_TOKENS.labels(self.model).observe(self.prompt_tokens or 0)
        REQUEST_GENERATION_TOKENS.labels(self.model).observe(self.tokens if generated is None else generated)


# Engine metrics from heartbeats: (name, type, help, heartbeat stat, aggregate over replicas).
_ENGINE_METRICS = (
    ("num_requests_running", "gauge", "Requests in the engines' running batches.", "num_running", sum),
    ("num_requests_waiting", "gauge", "Requests waiting in the engines' schedulers.", "num_waiting", sum),
    (
        "kv_cache_usage_perc",
        "gauge",
        "Fraction of KV-cache blocks in use (mean over replicas).",
        "kv_usage",
        lambda values: sum(values) / len(values),
    ),
    ("prompt_tokens", "counter", "Prompt tokens processed by the engines.", "prompt_tokens_total", sum),
    ("generation_tokens", "counter", "Tokens generated by the engines.", "generation_tokens_total", sum),
    ("num_preemptions", "counter", "Requests preempted by the engines' schedulers.", "num_preemptions", sum),
    (
        "prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the engines' prefix caches.",
        "prefix_cache_query_tokens",
        sum,
    ),
    (
        "prefix_cache_hits",
        "counter",
        "Prompt tokens found in the engines' prefix caches.",
        "prefix_cache_hit_tokens",
        sum,
    ),
    (
        "external_prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache's host-memory tier (--kv-offload-gib) past device hits.",
        "kv_offload_query_tokens",
        sum,
    ),
    (
        "external_prefix_cache_hits",
        "counter",
        "Prompt tokens restored from the prefix cache's host-memory tier instead of prefilled.",
        "kv_offload_hit_tokens",
        sum,
    ),
    (
        "kv_offload_stored_blocks",
        "counter",
        "KV blocks copied into the host-memory tier as the device evicted them.",
        "kv_offload_stored_blocks",
        sum,
    ),
    (
        "kv_offload_restore_seconds",
        "counter",
        "Seconds spent copying KV blocks back from the host-memory tier.",
        "kv_offload_restore_seconds",
        sum,
    ),
    (
        "step_seconds",
        "counter",
        "Seconds the engines spent in steps that ran a batch.",
        "step_seconds_total",
        sum,
    ),
    (
        "moe_seconds",
        "counter",
        "Seconds the engines' mixture-of-experts layers spent in their fused CPU kernel (over step_seconds: "
        "the experts' share of step time).",
        "moe_seconds_total",
        sum,
    ),
    (
        "spec_decode_num_drafts",
        "counter",
        "Verifications of a sequence's speculative proposals.",
        "spec_decode_num_drafts",
        sum,
    ),
    (
        "spec_decode_num_draft_tokens",
        "counter",
        "Speculative tokens proposed and verified.",
        "spec_decode_num_draft_tokens",
        sum,
    ),
    (
        "spec_decode_num_accepted_tokens",
        "counter",
        "Speculative tokens the model agreed with.",
        "spec_decode_num_accepted_tokens",
        sum,
    ),
)


class _EngineCollector:
    """The engines' state as of their last heartbeats."""

    def __init__(self, models: list[ModelInfo]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        for name, kind, help_text, stat, aggregate in _ENGINE_METRICS:
            family_class = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_class(PREFIX + name, help_text, labels=["model_name"])
            for model in self.models:
                stats = [r.data.get("stats", {}) for r in model.replicas]
                if any(stat in s for s in stats):
                    family.add_metric([model.name], aggregate([s.get(stat, 0) for s in stats]))
            yield family
        yield self._accepted_per_position()
        yield from self._lora()
        replicas = GaugeMetricFamily(
            PREFIX + "engine_replicas", "Live engine replicas.", labels=["model_name"]
        )
        for model in self.models:
            replicas.add_metric([model.name], len(model.replicas))
        yield replicas

    def _accepted_per_position(self) -> Metric:
        """How often the token at each position of a proposal was accepted, summed over replicas (models
        without speculation have no samples)."""
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted speculative tokens by their position in the proposal.",
            labels=["model_name", "position"],
        )
        for model in self.models:
            totals: collections.Counter[int] = collections.Counter()
            for replica in model.replicas:
                counts = replica.data.get("stats", {}).get("spec_decode_num_accepted_tokens_per_pos", [])
                totals.update(dict(enumerate(counts)))
            for position in sorted(totals):
                family.add_metric([model.name, str(position)], totals[position])
        return family

    def _lora(self) -> Iterator[Metric]:
        """vLLM's `lora_requests_info` (the adapters with running / waiting requests as comma-separated
        labels, the slots as `max_lora`, the value the time of the newest heartbeat), and the requests per
        adapter, summed over replicas; only for models whose engines serve adapters."""
        info = GaugeMetricFamily(
            PREFIX + "lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        counts = {
            state: GaugeMetricFamily(
                f"{PREFIX}lora_num_requests_{state}",
                f"Requests {state} per LoRA adapter.",
                labels=["model_name", "lora_name"],
            )
            for state in ("running", "waiting")
        }
        for model in self.models:
            stats = [r.data.get("stats", {}) for r in model.replicas]
            if not any("max_lora" in s for s in stats):
                continue
            totals: dict[str, collections.Counter[str]] = {}
            for state in counts:
                totals[state] = collections.Counter()
                for s in stats:
                    totals[state].update(s.get(f"lora_{state}", {}))
                for name in sorted(totals[state]):
                    counts[state].add_metric([model.name, name], totals[state][name])
            labels = [",".join(sorted(totals[state])) for state in ("running", "waiting")]
            max_lora = str(max(s.get("max_lora", 0) for s in stats))
            newest = max(r.data.get("time", 0.0) for r in model.replicas)
            info.add_metric([model.name, *labels, max_lora], newest)
        yield info
        yield from counts.values()


class _Aliased:
    """Every ``llmserve_`` family of `collectors`, and the same again under vLLM's names."""

    def __init__(self, *collectors: object) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self.collectors:
            for family in collector.collect():
                yield family
                if family.name.startswith(PREFIX):
                    short = family.name.removeprefix(PREFIX)
                    for alias in (short, _EXTRA_VLLM_NAMES.get(short)):
                        if alias:
                            yield _renamed(family, VLLM_PREFIX + alias)


def _renamed(family: Metric, name: str) -> Metric:
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=name + s.name.removeprefix(family.name)) for s in family.samples]
    return copy


def _web_collector() -> Iterable[object]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry
    from prometheus_client import REGISTRY

    return REGISTRY


def render(models: list[ModelInfo]) -> bytes:
    """The Prometheus text exposition of the engines' `models` and every web process's observations."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Aliased(_EngineCollector(models), _web_collector()))
    return generate_latest(registry)
