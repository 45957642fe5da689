# E31 Batch: one image for every process (api, scheduler, flower, workers, migrations).
# Build: docker compose build   (or: docker build -t e31-batch:local .)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bubblewrap: the sandbox every job runs in; slirp4netns: a job's own network
# (job_network = isolated, the default; docs/security.md). A worker refuses to start without
# them unless told --isolation process (or E31_JOB_NETWORK=host for the network).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap slirp4netns \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer, so code changes do not download it again.
# The development machines install torch==2.13.0 as a CPU wheel from local disk; that wheel
# and its index are not available here, so this is the ordinary PyPI build (on Linux x86_64
# it bundles the CUDA runtime, which the GPU workers need). The bound is the one the
# `worker` extra in pyproject.toml accepts, so the next step does not replace it.
RUN pip install "torch>=2.2,<2.14"

WORKDIR /opt/e31
COPY pyproject.toml README.md ./
COPY platform ./platform
COPY workers ./workers
# worker: torch (already there), numpy, nvidia-ml-py (GPU discovery through NVML);
# postgres: the psycopg driver for E31_DATABASE_URL=postgresql://...; s3: s3fs for an
# s3://bucket/prefix E31_ARTIFACTS_URL (docs/configuration.md, "Object store")
RUN pip install ".[worker,postgres,s3]"

# Run as an ordinary user (the workers alone run as root, to start each job as its tenant's
# own user: docker-compose.yml). /data is where docker-compose.yml mounts the shared volume;
# a new named volume takes this directory's owner.
RUN useradd --create-home --uid 1000 e31 \
    && mkdir -p /data \
    && chown e31:e31 /data
USER e31

# API, Flower
EXPOSE 8031 5555
CMD ["e31", "--help"]
