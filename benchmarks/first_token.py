"""Where a lone user's first token goes: a streamed 30-token completion through the whole stack, cut into
stages by the bus's own commands.

    .venv/bin/python -m benchmarks.first_token [--requests 40] [--threads 2] [--tokens 30]

One stack as the tests start it (redis-server, an engine process on the bundled model's weights as bf16,
daphne, the tests' database), one client sending streamed `/v1/completions` one after another with a short
pause between them. Redis's ``MONITOR`` timestamps every command on the same clock as the client, so each
request splits into:

1. **web, before the bus**: from the client's send to the rate-limit count (HTTP, Django, the API-key lookup);
2. **web, admission**: to the request's entry on the bus (the rate-limit round trip, parsing the body, the
   model's admin entry, the submission);
3. **engine intake**: to the engine's acknowledgement (reading the entry, tokenizing, queueing);
4. **prefill**: to the first token's entry on the bus (the step that computes it);
5. **relay**: to the first token's bytes at the client (the web process reading it and sending the event).

MONITOR costs Redis a little per command, so the totals run slightly above `benchmarks.latency`'s. Medians and
minima per stage; beside them, a one-line file from Python's http.server after the same pause (what any
request pays a machine whose idle cores wake slowly, before any server does its work). JSON and a PNG under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import gguf
import redis

from benchmarks.gguf_files import rewritten
from benchmarks.latency import (
    SENTENCE,
    first_data_line,
    json_request,
    streamed_first_token,
    trivial_http_server,
)
from inference_engine.engine_loop import on_a_thread_that_ends
from tests.web.stack import Stack

STAGES = ("web, before the bus", "web, admission", "engine intake", "prefill", "relay")


class CommandLog:
    """Every Redis command with its server timestamp, read by ``MONITOR`` on a thread of its own."""

    def __init__(self, url: str) -> None:
        self.entries: list[tuple[float, str]] = []
        self._monitor = redis.Redis.from_url(url, decode_responses=True).monitor()
        self._monitor.__enter__()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for command in self._monitor.listen():
                self.entries.append((command["time"], command["command"]))
        except (redis.ConnectionError, ValueError, OSError):  # closed by `close`
            pass

    def between(self, start: float, end: float) -> list[tuple[float, str]]:
        return [(t, c) for t, c in list(self.entries) if start <= t <= end]

    def close(self) -> None:
        self._monitor.connection.disconnect()


def post(url: str, body: dict, headers: dict) -> dict:
    with urllib.request.urlopen(json_request(url, body, headers), timeout=60) as reply:
        return json.load(reply)


def stages(sent: float, first: float, commands: list[tuple[float, str]]) -> list[float] | None:
    """The five stages' durations (ms) of one request, from the commands issued while it waited."""

    def when(*words: str) -> float | None:
        return next((t for t, c in commands if all(w in c for w in words)), None)

    counted = when("INCR", ":ratelimit:")
    queued = when("EVAL")
    acked = when("XADD", ":out:", '"type":"ack"')
    delta = when("XADD", ":out:", '"type":"delta"')
    marks = [sent, counted, queued, acked, delta, first]
    if any(m is None for m in marks) or sorted(marks) != marks:
        return None
    return [1000 * (b - a) for a, b in itertools.pairwise(marks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=30, help="prompt length")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = on_a_thread_that_ends(lambda: rewritten(gguf.GGMLQuantizationType.BF16))
    flags = ["--model", str(model), "--dtype", "bfloat16", "--threads", str(args.threads)]
    flags += ["--max-num-seqs", "8", "--max-model-len", "2048", "--log-level", "WARNING"]
    stack = Stack(model="bench", engine_flags=flags).start()
    rows, round_trips = [], []
    try:
        headers = {"Authorization": f"Bearer {stack.api_key}"}
        text = {"model": "bench", "prompt": SENTENCE * 8}
        ids = post(f"{stack.base_url}/tokenize", text, headers)["tokens"][: args.tokens]
        prompt = post(f"{stack.base_url}/detokenize", {"model": "bench", "tokens": ids}, headers)["prompt"]
        url = f"{stack.base_url}/v1/completions"
        body = {"model": "bench", "max_tokens": 4, "stream": True, "temperature": 0}
        for i in range(3):  # warm up
            streamed_first_token(url, {**body, "prompt": f"warm-up {i} {prompt}"}, headers)
        log = CommandLog(stack.redis.url)
        time.sleep(0.2)
        with trivial_http_server() as trivial:
            for i in range(args.requests):
                # A prefix of its own: no request finds a block of its prompt in the prefix cache.
                sent, first = streamed_first_token(url, {**body, "prompt": f"{i} {prompt}"}, headers)
                time.sleep(0.2)  # the last commands of the request reach the log
                split = stages(sent, first, log.between(sent, first))
                if split is not None:
                    rows.append([*split, 1000 * (first - sent)])
                sent, first = first_data_line(urllib.request.Request(trivial))  # after the same pause
                round_trips.append(1000 * (first - sent))
                time.sleep(0.2)
        log.close()
    finally:
        stack.stop()
    columns = [*STAGES, "total"]
    result = {
        "threads": args.threads,
        "prompt_tokens": args.tokens,
        "requests": len(rows),
        "median_ms": {c: statistics.median(r[i] for r in rows) for i, c in enumerate(columns)},
        "min_ms": {c: min(r[i] for r in rows) for i, c in enumerate(columns)},
        "trivial_round_trip_ms": {"median": statistics.median(round_trips), "min": min(round_trips)},
    }
    (args.out / "first_token.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "first_token.png")
    print(json.dumps(result, indent=2))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    for row, kind in enumerate(("median_ms", "min_ms")):
        left = 0.0
        for i, stage in enumerate(STAGES):
            width = result[kind][stage]
            ax.barh(row, width, left=left, color=f"C{i}", label=stage if row == 0 else None)
            left += width
    for row, kind in enumerate(("median", "min")):
        ms = result["trivial_round_trip_ms"][kind]
        ax.plot([ms, ms], [row - 0.4, row + 0.4], "k:", label="a trivial HTTP server" if row == 0 else None)
    ax.set_yticks([0, 1], ["median", "minimum"])
    ax.set_xlabel("ms from the client's send to the first token's bytes")
    ax.set_title(f"First token of a {result['prompt_tokens']}-token prompt, {result['requests']} requests")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
