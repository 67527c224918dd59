"""Command line: `python -m inference_engine serve|supervise|redis ...`.

    serve      one engine process serving one model on the Redis bus (flags mirror vLLM's)
    worker     the tensor-parallel ranks of a second (third, ...) machine, for a `serve` on the first
    rank       one tensor-parallel rank (rank 0's engine or `worker` starts it, its config on stdin)
    supervise  hot-loads / unloads models (one `serve` child per model) on control messages
    redis      start the project's own redis-server and print its URL (for a zero-setup demo)

Without --redis-url (or $LLMSERVE_REDIS_URL), `serve` and `supervise` start a private redis-server and print
its URL, so the README commands need nothing installed by hand.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from inference_engine.bus import protocol as P
from inference_engine.bus.redis_server import RedisServer, ensure_redis_url
from inference_engine.errors import InvalidRequestError

ENGINE_FLAGS: list[tuple[str, type]] = [
    ("--max-num-seqs", int),
    ("--max-model-len", int),
    ("--block-size", int),
    ("--gpu-memory-utilization", float),
    ("--dtype", str),
    ("--max-num-batched-tokens", int),
    ("--swap-space", float),
    ("--kv-offload-gib", float),
    ("--device", str),
    ("--kv-cache-memory-bytes", int),
    ("--seed", int),
    ("--max-pending-requests", int),
    ("--attention-backend", str),
    ("--quantization", str),
    ("--revision", str),
    ("--tokenizer", str),
    ("--tokenizer-revision", str),
    ("--download-dir", str),
    ("--gguf-file", str),
    ("--tensor-parallel-size", int),
    ("--master-addr", str),
    ("--master-port", int),
    ("--nnodes", int),
    ("--speculative-config", json.loads),  # JSON, as vLLM's flag
    ("--num-scheduler-steps", int),
    ("--tool-call-parser", str),
    ("--reasoning-parser", str),
    ("--runner", str),  # "generate" | "pooling" (embeddings)
    ("--task", str),  # vLLM's older form: "embed" = --runner pooling
    ("--pooler-config", json.loads),  # JSON, as vLLM's flag
    ("--max-loras", int),
    ("--max-lora-rank", int),
    ("--max-cpu-loras", int),
]


def _add_bus_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="default: $LLMSERVE_REDIS_URL, else a private redis-server")
    parser.add_argument("--prefix", default=P.DEFAULT_PREFIX, help="namespace of the bus's Redis keys")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--heartbeat-ttl", type=float, default=5.0)
    parser.add_argument("--log-level", default="INFO")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for flag, kind in ENGINE_FLAGS:
        parser.add_argument(flag, type=kind)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line, by EngineConfig field name."""
    names = [flag[2:].replace("-", "_") for flag, _ in ENGINE_FLAGS] + [
        "enable_prefix_caching",
        "enforce_eager",
        "enable_lora",
    ]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference_engine")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve one model on the Redis bus")
    serve.add_argument(
        "--model", help="GGUF file, model folder or hub id (org/name, org/name:QUANT); default: bundled"
    )
    serve.add_argument("--served-model-name", help="name clients use (default: the engine's model name)")
    _add_engine_flags(serve)
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help='adapters served by name (needs --enable-lora): name=path or {"name": ..., "path": ...}',
    )
    serve.add_argument("--max-inflight", type=int, help="requests taken at once (default: --max-num-seqs)")
    serve.add_argument("--shutdown-grace", type=float, default=10.0)
    serve.add_argument(
        "--standby",
        action="store_true",
        help="load the model, then wait for SIGUSR1 before serving (a spare)",
    )
    _add_bus_flags(serve)

    supervise = commands.add_parser("supervise", help="load / unload models on control messages")
    supervise.add_argument("--name", default="default", help="supervisor name (its control stream)")
    supervise.add_argument("--model", help="a model to load at start (with --served-model-name)")
    supervise.add_argument("--served-model-name")
    supervise.add_argument(
        "--spares", action="store_true", help="keep a loaded standby process per model for instant failover"
    )
    _add_engine_flags(supervise)  # defaults for every engine it starts; a load message's engine_args win
    _add_bus_flags(supervise)

    worker = commands.add_parser(
        "worker", help="the tensor-parallel ranks of another machine (rank 0's machine runs `serve`)"
    )
    worker.add_argument("--model", help="the same model `serve` was given")
    worker.add_argument("--node-rank", type=int, required=True, help="this machine's index, 1 .. nnodes-1")
    worker.add_argument("--log-level", default="INFO")
    _add_engine_flags(worker)

    rank = commands.add_parser(
        "rank", help="one tensor-parallel rank, started by rank 0's engine or `worker`"
    )
    rank.add_argument("rank", type=int)
    rank.add_argument("--parent-pid", type=int, required=True, help="the process it dies with")
    rank.add_argument("--ready-fd", type=int, required=True, help="a pipe on which it says it started")

    redis = commands.add_parser(
        "redis", help="run a private redis-server until interrupted (or until it dies)"
    )
    redis.add_argument("--port", type=int, help="default: a free port")
    return parser


def _run_until_signal(stop: Any, run: Any) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())
    run()


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def serve(args: argparse.Namespace) -> None:
    import torch

    from inference_engine.bus.server import EngineServer, ServeSettings, first_token_pause_for
    from inference_engine.config import EngineConfig
    from inference_engine.distributed import freeze_startup_heap
    from inference_engine.llm_engine import LLMEngine
    from inference_engine.lora.modules import lora_requests, parse_lora_module
    from llmserve_kernels.cpu.team import spread_team

    promoted = threading.Event()
    if args.standby:  # before the model loads: an early SIGUSR1 must not kill us
        signal.signal(signal.SIGUSR1, lambda *_: promoted.set())
    if args.threads:
        torch.set_num_threads(args.threads)
    spread_team()
    try:
        adapters = lora_requests([parse_lora_module(spec) for spec in args.lora_modules])
    except InvalidRequestError as exc:
        raise SystemExit(f"error: {exc}") from None
    if adapters and not args.enable_lora:
        raise SystemExit("error: --lora-modules needs --enable-lora.")
    url, _server = ensure_redis_url(args.redis_url)
    config = EngineConfig(model=args.model, served_model_name=args.served_model_name, **_engine_options(args))
    engine = LLMEngine(config)
    for adapter in adapters.values():  # read and checked now: a bad adapter stops the start, not a request
        try:
            engine.runner.lora.load(adapter)
        except InvalidRequestError as exc:
            engine.shutdown()
            raise SystemExit(f"error: --lora-modules {adapter.lora_name}: {exc}") from None
    if args.standby:
        stopped = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopped.set())
        print("standing by (SIGUSR1 puts this process on the bus)", file=sys.stderr, flush=True)
        while not (promoted.wait(0.2) or stopped.is_set()):
            pass
        if stopped.is_set():
            return
    settings = ServeSettings(
        prefix=args.prefix,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_ttl=args.heartbeat_ttl,
        max_inflight=args.max_inflight,
        shutdown_grace=args.shutdown_grace,
        lora_modules=adapters,
        first_token_pause=first_token_pause_for(torch.get_num_threads(), _usable_cpus())
        if engine.runner.device.type == "cpu"
        else 0.0,
    )
    server = EngineServer(engine, url, args.served_model_name, settings)
    freeze_startup_heap()
    if engine.workers is not None:  # a tensor-parallel rank that dies ends the replica
        engine.workers.on_failure = lambda reason: server.stop()
    print(f"serving {server.model!r} as replica {server.replica_id} on {url}", file=sys.stderr, flush=True)
    try:
        _run_until_signal(server.stop, server.run)
    finally:
        engine.shutdown()


def supervise(args: argparse.Namespace) -> None:
    from inference_engine.bus.supervisor import Supervisor

    url, _server = ensure_redis_url(args.redis_url)
    extra = ["--heartbeat-interval", str(args.heartbeat_interval), "--heartbeat-ttl", str(args.heartbeat_ttl)]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    supervisor = Supervisor(
        url, args.name, args.prefix, extra, args.heartbeat_interval, _engine_options(args), args.spares
    )
    if args.model or args.served_model_name:
        supervisor.load(args.served_model_name or "default", args.model, {})
    print(f"supervisor {args.name!r} on {url}", file=sys.stderr, flush=True)
    _run_until_signal(supervisor.stop, supervisor.run)


def worker(args: argparse.Namespace) -> None:
    """Runs this machine's ranks until they end (rank 0's engine stops them, or one dies)."""
    from inference_engine.config import EngineConfig
    from inference_engine.tp_workers import start_node_workers

    try:
        config = EngineConfig(model=args.model, **_engine_options(args))
    except InvalidRequestError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not 0 < args.node_rank < config.nnodes:
        raise SystemExit(f"--node-rank must be in 1 .. {config.nnodes - 1} (--nnodes {config.nnodes}).")
    processes = start_node_workers(config, args.node_rank)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5) and all(p.poll() is None for p in processes):
        pass
    for process in processes:
        process.kill()
        process.wait()
    sys.exit(0 if stop.is_set() or all(p.returncode == 0 for p in processes) else 1)


def rank(args: argparse.Namespace) -> None:
    from inference_engine.tp_workers import rank_main

    rank_main(args.rank, args.parent_pid, args.ready_fd)


def redis_only(port: int | None) -> int:
    """Prints the URL, then waits; exits (non-zero) as soon as redis-server dies, reaping it, so that whoever
    started this command sees the death and can restart it on the same port."""
    server = RedisServer(port=port).start()
    print(server.url, flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        while not done.wait(0.2):
            if server.process is None or server.process.poll() is not None:
                code = server.process.returncode if server.process else None
                print(f"redis-server exited with {code}", file=sys.stderr, flush=True)
                return 1
    finally:
        server.stop()
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "redis":
        sys.exit(redis_only(args.port))
    if args.command == "rank":
        rank(args)  # its own log format, with the rank
        return
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    {"serve": serve, "supervise": supervise, "worker": worker}[args.command](args)


if __name__ == "__main__":
    main()
