# syntax=docker/dockerfile:1
#
# correlation-worker container image.
#
#   docker build -t correlation-worker:local .
#   docker run --rm -e CORRELATION_DATABASE__URL=postgresql+psycopg://... correlation-worker:local migrate
#   docker run --rm -p 9464:9464 -e CORRELATION_DATABASE__URL=... correlation-worker:local
#
# Two stages: the builder turns the project into a wheel and installs it, with its dependencies, into a
# virtualenv at /opt/venv; the runtime stage copies only that virtualenv onto the same slim base. Both stages
# use the same base image, so the venv's interpreter symlink stays valid.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv

WORKDIR /src
COPY pyproject.toml README.md ./
COPY schema ./schema
COPY worker ./worker

# Optional extras installed with the package: camunda8 (Camunda's SDK, for the camunda8 correlator) by default;
# build with --build-arg EXTRAS= for the bare worker.
ARG EXTRAS=camunda8

# Every dependency ships binary wheels (psycopg[binary] bundles libpq), so no compiler is needed. pip and
# setuptools are removed from the venv afterwards: the runtime never installs anything.
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
    && wheel="$(ls /wheels/*.whl)" \
    && /opt/venv/bin/pip install "${wheel}${EXTRAS:+[$EXTRAS]}" \
    && /opt/venv/bin/pip uninstall -y pip setuptools


FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="correlation-worker" \
      org.opencontainers.image.description="Clustered, PostgreSQL-backed message correlation worker" \
      org.opencontainers.image.licenses="Apache-2.0"

# UID/GID 10001 is part of the deployment contract: the Helm chart's securityContext runs as the same ids.
RUN groupadd --system --gid 10001 correlation \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /var/lib/correlation-worker --shell /usr/sbin/nologin correlation \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/correlation-worker

COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CORRELATION_METRICS__PORT=9464

# The working directory is writable by the worker user so that the embedded SQLite default
# (sqlite:///correlation.db, relative to it) works in a plain `docker run`. With PostgreSQL the process
# writes nothing to disk and the root filesystem can be read-only.
WORKDIR /var/lib/correlation-worker

# Numeric UID:GID so that Kubernetes' runAsNonRoot can verify the user without reading /etc/passwd.
USER 10001:10001

EXPOSE 9464

# Liveness for plain Docker / Compose; Kubernetes uses its own probes on /healthz and /readyz.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CORRELATION_METRICS__PORT', '9464'), timeout=4)"]

ENTRYPOINT ["correlation-worker"]
CMD ["run"]
