"""The fault table: each service of the stack that ``scripts/run`` starts (the launcher: private Redis, engine
supervisor with a standby spare, two daphne workers, a Celery worker) killed while clients stream, and what
came of it.

For each fault, 4 streamed chat completions (SSE) and 2 WebSocket chats are in flight (all past their first
token) when the process is killed; a Batch API job runs too for the Redis and Celery kills. Measured:

- what the clients saw: ``complete``, an in-band ``error:<code>`` (SSE: an error event then ``[DONE]``;
  WebSocket: an ``error`` message, ``+close:<code>`` when a close frame follows), ``cut`` (the connection
  closed without either), or ``hung`` (nothing within `STREAM_LIMIT` seconds); the web worker killed is the
  one holding the most streams;
- seconds from the kill to the first complete answer to a new request;
- the services the launcher had to start again (a process that died of the fault, not only the one killed);
- KV blocks leaked: the serving engine's free blocks once it is idle again, against before the fault;
- the job: whether every line completed (nothing lost, nothing failed), and when.

Then SIGTERM of the launcher itself: the same clients (2 of the SSE streams short enough to finish within the
drain grace), the seconds until it exited, the processes it left behind, and the seconds until a new launcher
on the same port and database serves again.

Writes ``benchmarks/results/fault_table.json`` and ``fault_table.png``.

    .venv/bin/python -m benchmarks.fault_table
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `python benchmarks/fault_table.py` works without an install
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproject.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "benchmark-only-secret")

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"  # the bundled model, as tests/faults/stack.py serves it
STREAM = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
SSE_CLIENTS, WS_CLIENTS = 4, 2
STREAM_LIMIT = 150.0  # seconds a client waits for its answer to end
JOB_LINES, JOB_TOKENS = 40, 24

FAULTS = [
    ("SIGKILL redis-server", r"redis-server ", True),
    ("SIGKILL the engine", r"inference_engine serve (?!.*--standby)", False),
    ("SIGKILL the supervisor", r"inference_engine supervise", False),
    ("SIGKILL a daphne worker", r"hostproject\.server", False),
    ("SIGKILL the Celery worker", r"celery -A hostproject worker", True),
]


# ------------------------------------------------------------------------------------------------- clients


async def sse_client(stack: Any, started: asyncio.Event, **params: Any) -> str:
    from tests.faults.load import chat

    outcome = await chat(
        stack.port, stack.api_key, MODEL, first_token=started, timeout=STREAM_LIMIT, **{**STREAM, **params}
    )
    if outcome.complete:
        return "complete"
    if outcome.timed_out:
        return "hung"
    if outcome.error is not None:
        return f"error:{outcome.error.get('code')}" + ("" if outcome.done else "+cut")
    return "cut"


async def ws_client(stack: Any, started: asyncio.Event) -> str:
    from tests.chat.wsclient import ChatSocket

    base = f"http://127.0.0.1:{stack.port}"
    ws = await ChatSocket.open(
        base.replace("http", "ws") + "/ws/chat/",
        origin=base,
        protocols=["llmserve.chat", f"llmserve.key.{stack.api_key}"],
    )
    try:
        assert (await ws.receive())["type"] == "ready"
        messages = [{"role": "user", "content": "Say something about the sea."}]
        ws.send({"type": "chat", "id": 1, "model": MODEL, "messages": messages, "params": STREAM})
        deadline = time.monotonic() + STREAM_LIMIT
        while True:
            message = await ws.receive(max(0.1, deadline - time.monotonic()))
            if message is None:
                return f"close:{ws.close_code}"
            if message["type"] == "delta":
                started.set()
            elif message["type"] == "end":
                return (
                    "complete"
                    if message.get("finish_reason") == "length"
                    else f"end:{message['finish_reason']}"
                )
            elif message["type"] == "error":  # and a close frame, when the server is going away
                seen = f"error:{message.get('code')}"
                try:
                    return seen if await ws.receive(2) is not None else f"{seen}+close:{ws.close_code}"
                except TimeoutError:
                    return seen
    except TimeoutError:
        return "hung"
    except (asyncio.IncompleteReadError, ConnectionError):
        return "cut"
    finally:
        ws.writer.close()


async def start_clients(stack: Any, sse_params: list[dict] | None = None) -> dict[str, list[asyncio.Task]]:
    """The clients, once every one has had its first token."""
    sse_params = sse_params or [{}] * SSE_CLIENTS
    events = [asyncio.Event() for _ in range(len(sse_params) + WS_CLIENTS)]
    tasks = {
        "sse": [
            asyncio.create_task(sse_client(stack, e, **p)) for e, p in zip(events, sse_params, strict=False)
        ],
        "websocket": [asyncio.create_task(ws_client(stack, e)) for e in events[len(sse_params) :]],
    }
    deadline = time.monotonic() + 120
    while not all(e.is_set() for e in events):
        ended = [t.result() for t in tasks["sse"] + tasks["websocket"] if t.done()]
        if ended or time.monotonic() > deadline:
            raise RuntimeError(f"the clients did not all start: {ended}")
        await asyncio.sleep(0.05)
    return tasks


async def outcomes(tasks: dict[str, list[asyncio.Task]]) -> dict[str, list[str]]:
    return {kind: list(await asyncio.gather(*group)) for kind, group in tasks.items()}


async def serve_again(stack: Any, since: float, limit: float = 300) -> float:
    """Seconds from `since` to the first complete answer to a new request."""
    from tests.faults.load import chat

    while True:
        probe = await chat(stack.port, stack.api_key, MODEL, "Hi", stream=False, timeout=30, max_tokens=2)
        if probe.complete:
            return time.monotonic() - since
        if time.monotonic() - since > limit:
            raise RuntimeError(f"not serving {limit:g}s after the fault: {probe}")
        await asyncio.sleep(0.1)


async def settled(stack: Any, in_a_row: int = 6) -> None:
    """Until `in_a_row` short answers complete one after another (both web workers answer)."""
    from tests.faults.load import chat

    deadline, good = time.monotonic() + 120, 0
    while good < in_a_row:
        if time.monotonic() > deadline:
            raise RuntimeError("the stack did not settle within 120 s")
        probe = await chat(stack.port, stack.api_key, MODEL, "Hi", stream=False, timeout=10, max_tokens=1)
        good = good + 1 if probe.complete else 0


# -------------------------------------------------------------------------------------------------- engine


def engine_state(stack: Any) -> dict[str, Any] | None:
    """The freshest heartbeat of the model's serving replica, or None (Redis or the engine away)."""
    from inference_engine.bus.client import EngineClient
    from inference_engine.errors import EngineError

    bus = EngineClient(stack.redis_url)
    try:
        models = [m for m in bus.list_models() if m.name == MODEL]
    except EngineError:
        return None
    finally:
        bus.close()
    replicas = [r.data for m in models for r in m.replicas]
    return max(replicas, key=lambda d: d["time"]) if replicas else None


def idle_blocks(stack: Any, timeout: float = 60) -> dict[str, Any]:
    """Free and total KV blocks of the serving engine once it has nothing in flight (a fresh heartbeat)."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(stack)
        if state is not None and state["inflight"] == 0 and state["time"] > time.time() - 2:
            stats = state["stats"]
            return {
                "free": stats["num_free_blocks"],
                "total": stats["num_blocks"],
                "replica": state["replica"],
            }
        if time.monotonic() > deadline:
            inflight = state and state["inflight"]
            return {"free": None, "total": None, "replica": None, "inflight_at_timeout": inflight}
        time.sleep(0.25)


def wait_spare(stack: Any, timeout: float = 300) -> None:
    """Until the supervisor's standby spare has loaded the model since the last take-over."""
    deadline = time.monotonic() + timeout
    while True:
        log = stack.log("engine")
        if len(stack.pids(r"inference_engine serve")) == 2 and log.rfind("standing by") > log.rfind(
            "takes over"
        ):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(log[-3000:])
        time.sleep(0.5)


# ----------------------------------------------------------------------------------------------------- job


def openai_client(stack: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=stack.api_key, max_retries=5)


def start_job(stack: Any) -> str:
    """A Batch API job of `JOB_LINES` chat lines, once it runs (some lines done, more to do)."""
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Name a colour (#{i})."}],
                "max_tokens": JOB_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(JOB_LINES)
    ]
    client = openai_client(stack)
    content = "\n".join(json.dumps(line) for line in lines).encode()
    uploaded = client.files.create(file=("lines.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180
    while (counts := client.batches.retrieve(batch.id).request_counts).completed == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the job did not start: {counts}")
        time.sleep(0.2)
    return batch.id


def job_outcome(stack: Any, batch_id: str, since: float, timeout: float = 300) -> dict[str, Any]:
    """How the job ended (or where it stood after `timeout` seconds), and whether every line's answer is in
    its output file once."""
    client = openai_client(stack)
    deadline = time.monotonic() + timeout
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
        except Exception as exc:  # the web tier restarting
            batch, error = None, exc
        if batch is not None and batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        if time.monotonic() > deadline:
            return {
                "status": batch.status if batch else f"unreadable: {error}",
                "counts": batch.request_counts.model_dump() if batch else None,
                "ended_after_s": None,
                "lost": None,
            }
        time.sleep(0.5)
    ended = time.monotonic() - since
    ids = []
    if batch.output_file_id:
        ids = [
            json.loads(line)["custom_id"]
            for line in client.files.content(batch.output_file_id).text.splitlines()
        ]
    return {
        "status": batch.status,
        "counts": batch.request_counts.model_dump(),
        "ended_after_s": round(ended, 1),
        "answered_lines": len(set(ids)),
        "duplicate_lines": len(ids) - len(set(ids)),
        "lost": JOB_LINES - len(set(ids)),
    }


# ------------------------------------------------------------------------------------------------- faults


async def sigkill(stack: Any, name: str, pattern: str, with_job: bool) -> dict[str, Any]:
    await settled(stack)
    before = await asyncio.to_thread(idle_blocks, stack)
    batch_id = await asyncio.to_thread(start_job, stack) if with_job else None
    tasks = await start_clients(stack)
    pids = stack.pids(pattern)
    if "celery" in pattern:
        victim = pids[0]  # the worker's main process, not a pool child
    elif "server" in pattern:
        from tests.faults.stack import established

        victim = max(pids, key=lambda pid: established(pid, stack.port))  # the web worker with most streams
    else:
        victim = pids[-1]
    starts = service_starts(stack)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    recovery = await serve_again(stack, killed)
    seen = await outcomes(tasks)
    after = await asyncio.to_thread(idle_blocks, stack)
    job = await asyncio.to_thread(job_outcome, stack, batch_id, killed) if batch_id else None
    if with_job:  # the job ran meanwhile: the engine is idle again only now
        after = await asyncio.to_thread(idle_blocks, stack)
    leaked = None if after["free"] is None else before["free"] - after["free"]
    row = {
        "fault": name,
        "clients": seen,
        "serve_again_s": round(recovery, 2),
        "restarted": restarted(stack, starts),
        "blocks": {"free_before": before["free"], "free_after": after["free"], "total": after["total"]},
        "blocks_leaked": leaked,
        "engine_replaced": before["replica"] != after["replica"],
        "job": job,
    }
    print(json.dumps(row), flush=True)
    return row


async def sigterm_launcher(stack: Any) -> dict[str, Any]:
    """SIGTERM of the launcher: two SSE streams short enough to finish within the drain grace, two that are
    not, and the WebSocket chats; then a new launcher on the same port and database."""
    from tests.faults.stack import SHUTDOWN_GRACE

    await settled(stack)
    tasks = await start_clients(stack, [{"max_tokens": 24}] * 2 + [{}] * (SSE_CLIENTS - 2))
    processes = set(stack.pids("."))
    os.kill(stack.launcher.pid, signal.SIGTERM)
    signalled = time.monotonic()
    seen = await outcomes(tasks)
    await asyncio.to_thread(stack.launcher.wait, 120)
    exited = time.monotonic() - signalled
    await asyncio.sleep(1)
    left = sorted(pid for pid in processes if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid))
    stack.output.clear()
    stack.redis_url = ""
    await asyncio.to_thread(stack.start)
    recovery = await serve_again(stack, signalled)
    blocks = await asyncio.to_thread(idle_blocks, stack)
    row = {
        "fault": "SIGTERM the launcher",
        "clients": seen,
        "drain_grace_s": SHUTDOWN_GRACE,
        "restarted": None,
        "launcher_exited_s": round(exited, 1),
        "processes_left": len(left),
        "serve_again_s": round(recovery, 2),
        "blocks": {"free_before": None, "free_after": blocks["free"], "total": blocks["total"]},
        "blocks_leaked": None,  # a new engine
        "job": None,
    }
    print(json.dumps(row), flush=True)
    return row


def service_starts(stack: Any) -> dict[str, int]:
    """How many times the launcher has started each service (its log's start lines)."""
    return {
        path.stem: path.read_text(errors="replace").count(" starting: ")
        for path in stack.log_dir.glob("*.log")
    }


def restarted(stack: Any, before: dict[str, int]) -> list[str]:
    """The services the launcher started again since `before`."""
    return sorted(name for name, count in service_starts(stack).items() if count > before.get(name, 0))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


# -------------------------------------------------------------------------------------------------- output


def summary_cell(clients: dict[str, list[str]]) -> str:
    parts = []
    for kind, seen in clients.items():
        counted = Counter(seen)
        parts.append(f"{kind}: " + ", ".join(f"{n}x {what}" for what, n in sorted(counted.items())))
    return "; ".join(parts)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, table) = plt.subplots(2, 1, figsize=(13, 8.5), gridspec_kw={"height_ratios": [1, 1.4]})
    names = [row["fault"].replace("SIGKILL ", "KILL ").replace("the ", "") for row in rows]
    values = [row.get("serve_again_s", 0.0) for row in rows]
    bars.bar(names, values, color="tab:blue")
    for x, value in enumerate(values):
        bars.annotate(f"{value:.1f}s", (x, value), ha="center", va="bottom")
    bars.set_ylabel("seconds to serve again")
    bars.set_title("The launcher's stack under faults (4 SSE + 2 WebSocket clients streaming at each)")
    table.axis("off")
    cells = [
        [row["fault"], f"FAILED: {row['failed'][:80]}", "-", "-", "-"]
        if "failed" in row
        else [
            row["fault"],
            summary_cell(row["clients"]),
            ", ".join(row.get("restarted") or []) or "-",
            "-" if row["blocks_leaked"] is None else str(row["blocks_leaked"]),
            "-" if not row["job"] else f"{row['job']['status']}, lost {row['job']['lost']}",
        ]
        for row in rows
    ]
    drawn = table.table(
        cellText=cells,
        colLabels=["fault", "what clients saw", "restarted by the launcher", "blocks leaked", "Batch job"],
        loc="center",
    )
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(7.5)
    drawn.auto_set_column_width([0, 1, 2, 3, 4])
    drawn.scale(1, 2.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "fault_table.json")
    args = parser.parse_args(argv)
    import django

    django.setup()  # tests.database and the stack read the settings
    from tests.faults.stack import LauncherStack

    stack = LauncherStack(web_workers=2)
    rows: list[dict[str, Any]] = []
    try:
        stack.start()
        wait_spare(stack)
        for name, pattern, with_job in FAULTS:
            try:
                if "engine" in name or "supervisor" in name:
                    wait_spare(stack)
                rows.append(asyncio.run(sigkill(stack, name, pattern, with_job)))
            except RuntimeError as exc:  # recorded: the next faults still run
                rows.append({"fault": name, "failed": str(exc)[-2000:]})
        try:
            rows.append(asyncio.run(sigterm_launcher(stack)))
        except RuntimeError as exc:
            rows.append({"fault": "SIGTERM the launcher", "failed": str(exc)[-2000:]})
    finally:
        stack.stop(keep_logs=True)
    result = {"machine_load": [round(x, 2) for x in os.getloadavg()], "faults": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()
