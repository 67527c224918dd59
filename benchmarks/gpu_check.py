"""The GPU check: everything about the CUDA path that a machine with a GPU can confirm, in one run of under
8 minutes, summarised in one JSON file.

    python3 -m benchmarks.gpu_check [--out DIR] [--budget SECONDS] [--only STEP ...]
                                                            (or benchmarks/gpu_check.sh)

Steps, each with its share of the budget: the Triton kernel tests run natively (not interpreted, bf16
`tl.dot` included), the engine against transformers on CUDA (`tests/engine/test_cuda_engine.py`), the
kernel benchmark (`benchmarks.gpu_kernels`: decode bandwidth against the device's copy bandwidth, the
unified attention grid, fused layers, quantized matmul), the mixed-workload throughput on CUDA and where a
decode step's time goes (`benchmarks.step_profile`), the last two with a random model of the bundled
model's shapes (the bundled model's file is too large to carry to a lent machine; its shapes, not its
weights, set the speed). Missing Python packages are installed from wheels in `.whl/` when there are any
(lent machines have no registry). Without a GPU it writes a summary that says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 480.0  # seconds: the whole check must fit a lent machine's call with room to rerun


@dataclass
class Step:
    name: str
    command: list[str]
    share: float  # of the budget
    env: dict[str, str] = field(default_factory=dict)
    result_file: str | None = None  # JSON the step writes, folded into the summary


@dataclass
class StepResult:
    name: str
    status: str  # "passed" | "failed" | "timeout" | "skipped"
    seconds: float
    returncode: int | None
    output_tail: str
    result: dict | None = None


def steps(out: Path, model_dir: Path) -> list[Step]:
    python = sys.executable
    no_interpreter = {"TRITON_INTERPRET": "0"}
    # Compiling each kernel variant takes longer than running it: compile on several cores where pytest-xdist
    # is installed (a lent GPU machine's image has it).
    workers = ["-n", "8"] if _importable("xdist") else []
    return [
        Step(
            "triton_kernel_tests",
            [
                python,
                "-m",
                "pytest",
                "-q",
                *workers,
                "tests/kernels",
                "-k",
                "triton",
                "-p",
                "no:cacheprovider",
            ],
            0.15,
            no_interpreter,
        ),
        Step(
            "engine_vs_transformers_cuda",
            [
                python,
                "-m",
                "pytest",
                "-q",
                "tests/engine/test_cuda_engine.py",
                "tests/engine/test_kv_offload.py::test_cuda_engine_restores_from_pinned_memory",
                "-p",
                "no:cacheprovider",
            ],
            0.20,
            no_interpreter,
        ),
        Step(
            "gpu_kernels_benchmark",
            [
                python,
                "-m",
                "benchmarks.gpu_kernels",
                "--out",
                str(out / "gpu_kernels.json"),
                "--skip-throughput",  # the next step runs it, on a model this machine has
            ],
            0.25,
            no_interpreter,
            "gpu_kernels.json",
        ),
        Step(
            "offline_throughput_cuda",
            [
                python,
                "-m",
                "benchmarks.offline_throughput",
                "--device",
                "cuda",
                "--model",
                str(model_dir),
                "--repeats",
                "2",
                "--out",
                str(out),
            ],
            0.25,
            no_interpreter,
            "offline_throughput.json",
        ),
        Step(
            "step_profile_cuda",
            [
                python,
                "-m",
                "benchmarks.step_profile",
                "--device",
                "cuda",
                "--model",
                str(model_dir),
                "--out",
                str(out),
            ],
            0.15,
            no_interpreter,
            "step_profile.json",
        ),
    ]


def run_step(step: Step, timeout: float, out: Path) -> StepResult:
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    try:
        done = subprocess.run(
            step.command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        status = "passed" if done.returncode == 0 else "failed"
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status, code = "timeout", None
        output = _text(exc.stdout) + _text(exc.stderr) + f"\n[stopped after {timeout:.0f} s]"
    result = None
    if step.result_file and (out / step.result_file).exists():
        result = json.loads((out / step.result_file).read_text())
    return StepResult(step.name, status, round(time.monotonic() - start, 1), code, output[-3000:], result)


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def install_wheels(folder: Path) -> list[str]:
    """Installs what the project needs from carried wheels when the import fails; returns what it did."""
    needed = ("gguf", "tokenizers", "safetensors", "jinja2", "llguidance")
    missing = [name for name in needed if not _importable(name)]
    if not missing or not folder.is_dir():
        return missing and [f"missing, no wheels to install: {', '.join(missing)}"]
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(folder),
        *missing,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    return [f"pip install {' '.join(missing)}: exit {done.returncode} {done.stderr[-300:]}"]


def _importable(name: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode == 0


def device_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if facts["cuda"]:
        facts["device"] = torch.cuda.get_device_name(0)
        facts["cuda_version"] = torch.version.cuda
    return facts


def check(out: Path, budget: float, plan: list[Step] | None = None, only: list[str] | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary: dict = {"device": device_facts(), "setup": install_wheels(ROOT / ".whl"), "steps": []}
    if not summary["device"]["cuda"] and plan is None:
        summary["skipped"] = "no CUDA GPU here: nothing of the CUDA path can be checked"
    else:
        if plan is None:
            plan = steps(out, _random_model(Path(tempfile.mkdtemp(prefix="gpu-check-model-"))))
        if only:  # a rerun: the steps named share the whole budget
            plan = [step for step in plan if step.name in only]
            total = sum(step.share for step in plan)
            plan = [replace(step, share=step.share / total) for step in plan]
        for step in plan:
            left = budget - (time.monotonic() - started)
            if left < 5:
                summary["steps"].append(asdict(StepResult(step.name, "skipped", 0.0, None, "no time left")))
                continue
            result = run_step(step, min(step.share * budget, left), out)
            summary["steps"].append(asdict(result))
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["passed"] = bool(summary["steps"]) and all(s["status"] == "passed" for s in summary["steps"])
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    return summary


def _random_model(folder: Path) -> Path:
    from benchmarks.random_llama import byte_level_tokenizer, write_random_llama

    return write_random_llama(folder, heads=9, kv_heads=3, layers=30, tokenizer=byte_level_tokenizer())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole check")
    parser.add_argument("--only", nargs="+", metavar="STEP", help="run these steps alone (a rerun)")
    args = parser.parse_args()
    summary = check(args.out, args.budget, only=args.only)
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=2))
    for step in summary["steps"]:
        print(f"{step['name']}: {step['status']} in {step['seconds']} s")
    sys.exit(0 if summary.get("passed") or "skipped" in summary else 1)


if __name__ == "__main__":
    main()
