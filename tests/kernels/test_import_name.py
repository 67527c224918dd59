"""The kernels' import name is ours, `llmserve_kernels`: a top-level `kernels` is Hugging Face's package
(which transformers imports), and installing llmserve or running from the checkout's folder must not hide
theirs. Nor is a generic `hostproject` installed: the repository's host project runs from the checkout."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source_copy(target: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore), without its build/ folder, where an
    earlier build's packages linger and would go into the wheel."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def test_the_wheel_installs_only_names_of_ours(tmp_path):
    source = _source_copy(tmp_path / "source")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", tmp_path, source], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("llmserve-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {"llmserve", "inference_engine", "llmserve_kernels"} <= tops
    assert not {"kernels", "hostproject"} & tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "llmserve_kernels/cpu/csrc/decoder.c" in names  # compiled on the user's machine


def test_another_kernels_package_wins_from_the_checkouts_folder(tmp_path):
    """Hugging Face's `kernels` (a stand-in package here) imports as itself beside ours, even with the
    checkout's folder first on the path, where our kernels/ folder is."""
    theirs = tmp_path / "site" / "kernels"
    theirs.mkdir(parents=True)
    (theirs / "__init__.py").write_text("HUGGING_FACE = True\n")
    code = "import kernels, inference_engine, llmserve_kernels.cpu; print(kernels.HUGGING_FACE)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_kernels_from_the_checkouts_folder_is_not_ours():
    """`import kernels` from the checkout's folder, with this environment as it is: Hugging Face's package
    where it is installed (transformers 5.25 and later require it), else our kernels/ folder only as a
    namespace without code (it has no __init__.py), which any installed `kernels` outranks."""
    code = "import kernels; print(getattr(kernels, '__file__', None))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    found = out.stdout.strip()
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert found == "None"
    else:
        assert found != "None" and not Path(found).is_relative_to(ROOT / "kernels"), found
