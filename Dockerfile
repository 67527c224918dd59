# One image for every service of the stack: web (daphne), engine (supervisor + engine processes), Celery worker.
# It runs the README's two commands too: `scripts/run` (the whole stack in one container, the default command)
# and `scripts/test`. Untested: no Docker engine runs where this project is developed (compose.yaml is checked
# statically with `docker compose config`).
#
#   docker build -t llmserve .                                       # CPU (TORCH_SPEC, PIP_EXTRA_INDEX_URL: below)
#   docker build -t llmserve:cuda --build-arg TORCH_SPEC=torch==2.13.0 .   # the CUDA build, as PyPI serves it
FROM python:3.11-slim-bookworm

# A C compiler: the engine builds its CPU kernels on first use (kernels/cpu/csrc/).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# scripts/setup installs torch first from TORCH_SPEC. PyPI's Linux wheel of torch is the CUDA build; for a
# smaller CPU-only image pass TORCH_SPEC=torch==2.13.0+cpu and PyTorch's CPU wheel index in
# PIP_EXTRA_INDEX_URL.
ARG TORCH_SPEC=torch==2.13.0
ARG PIP_EXTRA_INDEX_URL=
ENV TORCH_SPEC=${TORCH_SPEC} \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

RUN useradd --create-home --uid 1000 llmserve
WORKDIR /app
COPY --chown=llmserve:llmserve . .
USER llmserve
# The same installer as on a developer's machine: .venv, every package, the bundled model.
RUN scripts/setup && mkdir -p var

EXPOSE 8000
# The whole stack in one container (private Redis, SQLite unless DATABASE_URL is set); compose.yaml runs the
# services one per container instead.
CMD ["scripts/run", "--host", "0.0.0.0", "--port", "8000"]
