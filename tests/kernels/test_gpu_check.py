"""The GPU check's own logic on the CPU: each step's status, time limit and result file reach the summary,
the budget is shared out, and a machine without a GPU gets a summary that says so."""

import json
import sys

from benchmarks import gpu_check
from benchmarks.gpu_check import Step


def test_steps_pass_fail_time_out_and_report_results(tmp_path):
    writes = f"import json; json.dump({{'tokens_per_s': 12.5}}, open({str(tmp_path / 'r.json')!r}, 'w'))"
    plan = [
        Step("ok", [sys.executable, "-c", writes], 0.3, result_file="r.json"),
        Step("bad", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 0.3),
        Step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 0.05),
    ]
    summary = gpu_check.check(tmp_path, budget=20, plan=plan)
    by_name = {s["name"]: s for s in summary["steps"]}
    assert by_name["ok"]["status"] == "passed" and by_name["ok"]["result"] == {"tokens_per_s": 12.5}
    assert by_name["bad"]["status"] == "failed" and by_name["bad"]["returncode"] == 3
    assert "boom" in by_name["bad"]["output_tail"]
    assert by_name["slow"]["status"] == "timeout" and by_name["slow"]["seconds"] < 5  # 5 % of 20 s
    assert summary["passed"] is False
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary


def test_a_rerun_takes_only_the_steps_named(tmp_path):
    plan = [Step(name, [sys.executable, "-c", "pass"], 0.5) for name in ("first", "second")]
    summary = gpu_check.check(tmp_path, budget=20, plan=plan, only=["second"])
    assert [s["name"] for s in summary["steps"]] == ["second"] and summary["passed"]


def test_steps_beyond_the_budget_are_skipped(tmp_path):
    plan = [Step("long", [sys.executable, "-c", "import time; time.sleep(3)"], 1.0)] * 2
    summary = gpu_check.check(tmp_path, budget=6, plan=plan)
    assert [s["status"] for s in summary["steps"]] == ["passed", "skipped"]


def test_a_machine_without_a_gpu_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "device_facts", lambda: {"torch": "x", "cuda": False})
    summary = gpu_check.check(tmp_path, budget=60)
    assert summary["steps"] == [] and "no CUDA GPU" in summary["skipped"]


def test_the_plan_covers_the_cuda_path(tmp_path):
    names = [s.name for s in gpu_check.steps(tmp_path, tmp_path / "model")]
    assert names == [
        "triton_kernel_tests",
        "engine_vs_transformers_cuda",
        "gpu_kernels_benchmark",
        "offline_throughput_cuda",
        "step_profile_cuda",
    ]
    assert sum(s.share for s in gpu_check.steps(tmp_path, tmp_path)) <= 1.0
