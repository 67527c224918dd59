"""llama.cpp's HTTP server as a baseline: built once from the registry's source distribution, then run.

llama-cpp-python's source distribution vendors a complete llama.cpp tree; we CMake its `llama-server`
target for the CPU (native instructions, static, no network features) and keep the binary under
``~/.cache/llmserve/llama.cpp/<version>-<cpu>/``, where ``<cpu>`` names this CPU's instruction-set flags
(a native build may not run on another CPU). Building takes tens of minutes on two cores; it happens
once per machine.

    .venv/bin/python -m benchmarks.llamacpp build      # build (or find) the server, print its path

``LlamaServer`` starts the binary on a free loopback port for one model file and sends it completions.
Callers that cannot get a binary catch ``LlamaCppUnavailable`` and skip their llama.cpp half.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from inference_engine.bus.redis_server import free_port

PACKAGE = "llama-cpp-python"
CACHE = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve")) / "llama.cpp"
BINARY = "llama-server"
# The server and nothing that downloads: no web UI fetched at configure time, no curl/SSL model hub.
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_OPENMP=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
]


class LlamaCppUnavailable(RuntimeError):
    """No llama.cpp server binary could be found or built here (the message says why)."""


def cpu_key() -> str:
    """A short hash of this CPU's instruction-set flags: a native build is only reused on the same set."""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(" ".join(sorted(flags.split(":", 1)[-1].split())).encode()).hexdigest()[:10]


def cached_server() -> Path | None:
    """The newest binary built for this CPU, if any."""
    builds = sorted(CACHE.glob(f"*-{cpu_key()}/{BINARY}"), key=lambda p: p.stat().st_mtime)
    return builds[-1] if builds else None


def build_server(jobs: int | None = None, timeout: float = 3 * 3600, log=print) -> Path:
    """Return a llama-server binary for this CPU, building it from the source distribution if needed."""
    found = cached_server()
    if found is not None:
        return found
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise LlamaCppUnavailable(
            "building llama.cpp needs cmake and a C++ compiler (apt-get install cmake g++)"
        )
    with tempfile.TemporaryDirectory(prefix="llamacpp-") as tmp:
        tmp = Path(tmp)
        log(f"downloading the {PACKAGE} source distribution")
        try:
            pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
            subprocess.run([*pip, "-d", str(tmp), PACKAGE], check=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as exc:
            raise LlamaCppUnavailable(f"could not download {PACKAGE}'s source distribution: {exc}") from exc
        (sdist,) = tmp.glob("*.tar.gz")
        version = sdist.name.removesuffix(".tar.gz").rsplit("-", 1)[-1]
        target = CACHE / f"{version}-{cpu_key()}"
        if (target / BINARY).exists():
            return target / BINARY
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(tmp.glob("*/vendor/llama.cpp"))
        build = tmp / "build"
        jobs = jobs or os.cpu_count() or 1
        log(f"building llama.cpp from {PACKAGE} {version} ({jobs} jobs; this takes a while)")
        started = time.monotonic()
        try:
            for cmd in (
                ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS]
                + (["-G", "Ninja"] if shutil.which("ninja") else []),
                ["cmake", "--build", str(build), "--target", BINARY, "-j", str(jobs)],
            ):
                remaining = timeout - (time.monotonic() - started)
                subprocess.run(cmd, check=True, timeout=max(1.0, remaining), stdout=subprocess.DEVNULL)
        except (subprocess.SubprocessError, OSError) as exc:
            raise LlamaCppUnavailable(f"building llama.cpp failed: {exc}") from exc
        (binary,) = build.glob(f"bin/{BINARY}")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(binary, target / BINARY)
        log(f"built {target / BINARY} in {time.monotonic() - started:.0f} s")
        return target / BINARY


class LlamaServer:
    """One llama-server process serving `model` on loopback; a context manager that stops it on exit.

    `parallel` slots share a context of `parallel * ctx_per_slot` tokens (llama.cpp splits it evenly),
    so that many requests decode together in one batch, as our engine's continuous batching does.
    """

    def __init__(
        self,
        model: Path | str,
        *,
        parallel: int = 1,
        ctx_per_slot: int = 2048,
        threads: int = 2,
        binary: Path | None = None,
    ):
        self.binary = binary or build_server()
        self.model, self.parallel, self.threads = Path(model), parallel, threads
        self.ctx = parallel * ctx_per_slot
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.repack = True  # llama.cpp's weight repacking for its CPU kernels (see `__enter__`)

    def __enter__(self) -> LlamaServer:
        try:
            return self._start()
        except LlamaCppUnavailable as exc:
            if not self.repack or "exited" not in str(exc):
                raise
        # Its repacked Q4 path crashes at load on some CPUs (seen with Q4_1 on an AMX Xeon): start it
        # without repacking, and say so, since that path is slower.
        print("llama-server crashed at load; starting it again with --no-repack", flush=True)
        self.repack = False
        return self._start()

    def _start(self) -> LlamaServer:
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += [
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "-np",
            str(self.parallel),
            "-c",
            str(self.ctx),
        ]
        cmd += ["-b", "2048", "-ub", "512", "--no-webui", "--cont-batching", "--log-disable"]
        cmd += [] if self.repack else ["--no-repack"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaCppUnavailable(f"llama-server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise LlamaCppUnavailable("llama-server did not become healthy within 120 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def complete(self, prompt: str, max_tokens: int, *, ignore_eos: bool = True) -> dict:
        """Greedy completion through /completion; the answer carries llama.cpp's own `timings`."""
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "ignore_eos": ignore_eos,
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": False,
            "stream": False,
        }
        req = urllib.request.Request(
            f"{self.url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=3600) as resp:
            return json.load(resp)


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit(f"usage: python -m benchmarks.llamacpp build\n\n{__doc__}")
    try:
        print(build_server())
    except LlamaCppUnavailable as exc:
        sys.exit(f"llama.cpp unavailable: {exc}")
