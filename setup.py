"""The import names: llmserve and inference_engine as their folders, the kernels/ folder as
`llmserve_kernels` (a top-level `kernels` is Hugging Face's package, which transformers imports). kernels/
has no __init__.py of its own, so from the checkout's folder `import kernels` still finds theirs. The
repository's own host project (hostproject/) is not installed: it runs from the checkout's folder, and a
generic top-level name is not ours to put on a user's path."""

from setuptools import find_namespace_packages, find_packages, setup

kernels = [
    "llmserve_kernels" + name.removeprefix("kernels")
    for name in find_namespace_packages(include=["kernels*"])
]
setup(
    packages=find_packages(include=["llmserve*", "inference_engine*"]) + kernels,
    package_dir={"llmserve_kernels": "kernels"},
)
