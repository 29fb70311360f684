# syntax=docker/dockerfile:1
# sitsmesh control plane image.
#
#   docker build -t sitsmesh:0.2.0 --build-arg VERSION=0.2.0 \
#     --build-arg REVISION="$(git rev-parse HEAD)" .
#   docker run --rm -p 50051:50051 -p 9464:9464 \
#     -v sitsmesh-state:/var/lib/sitsmesh --stop-timeout 20 sitsmesh:0.2.0
#
# Shutdown takes up to SITSMESH_DRAIN_SECONDS + SITSMESH_GRACE_SECONDS (5 + 10 by
# default), longer than `docker stop`'s 10 s default, hence --stop-timeout above.
# The HEALTHCHECK probes 127.0.0.1:50051; change it if you move SITSMESH_DATA_ADDR.

# The image's OCI labels. VERSION's default is pyproject's version (tests/unit/
# test_version.py keeps every copy equal); REVISION is the commit the image is built from.
# SOURCE is the repository's URL, left empty rather than guessed: pass it when you publish.
ARG VERSION=0.2.0
ARG REVISION=unknown
ARG SOURCE=""

# The base image, by tag; by digest too when PYTHON_DIGEST is given (both stages, so the
# wheels match the interpreter they run on). Release builds pass the digest the tag
# resolves to at release time (README, "Install"):
#   --build-arg PYTHON_DIGEST="$(docker buildx imagetools inspect \
#       python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}' | tr -d '"')"
# No digest is written here: none could be read offline, and a made-up one cannot pull.
ARG PYTHON_DIGEST=""

# ---- build: wheels for sitsmesh and every runtime dependency -------------------
FROM python:3.11-slim-bookworm${PYTHON_DIGEST:+@}${PYTHON_DIGEST} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
# LICENSE goes into the wheel (pyproject's license-files).
COPY pyproject.toml README.md LICENSE ./
COPY sitsmesh/ sitsmesh/
# Every runtime dep has a CPython 3.11 wheel (manylinux or pure), so no compiler is needed.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# ---- runtime: install from the wheels only ------------------------------------
# Same base as the build stage, so the wheels match this interpreter and platform.
FROM python:3.11-slim-bookworm${PYTHON_DIGEST:+@}${PYTHON_DIGEST} AS runtime

ARG VERSION
ARG REVISION
ARG SOURCE
LABEL org.opencontainers.image.title="sitsmesh" \
      org.opencontainers.image.description="Control plane for Envoy and Istio in front of AI inference pipelines" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# The wheels are bind-mounted, not copied, so they add no layer to this image.
# xds-protos ships an old copy of opentelemetry/proto: opentelemetry-proto goes in last,
# so the OTLP exporter (tracing) finds the modules it needs.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/sitsmesh-*.whl \
    && pip install --no-cache-dir --no-index --force-reinstall --no-deps \
        /wheels/opentelemetry_proto-*.whl

# Fixed UID/GID so Kubernetes runAsUser/fsGroup can match it.
RUN groupadd --system --gid 10001 sitsmesh \
    && useradd --system --no-log-init --uid 10001 --gid 10001 \
        --home-dir /var/lib/sitsmesh --no-create-home --shell /usr/sbin/nologin sitsmesh \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/sitsmesh

# Defaults bind 127.0.0.1; in a container the data plane and /metrics must be reachable.
# The admin API stays on loopback (`docker exec ... sitsmesh status`): on a network its
# token needs TLS (SITSMESH_ADMIN_TLS_CERT_FILE / _KEY_FILE) or mesh mTLS, and `serve`
# refuses a non-loopback admin address without either unless SITSMESH_ADMIN_INSECURE=true.
ENV SITSMESH_DATA_ADDR=0.0.0.0:50051 \
    SITSMESH_ADMIN_ADDR=127.0.0.1:50052 \
    SITSMESH_METRICS_ADDR=0.0.0.0:9464 \
    SITSMESH_STATE_DIR=/var/lib/sitsmesh \
    SITSMESH_LOG_FORMAT=json

WORKDIR /var/lib/sitsmesh
USER 10001:10001

# data-plane gRPC (Envoy-facing + health + reflection), admin gRPC, Prometheus /metrics
EXPOSE 50051 50052 9464

HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["sitsmesh", "health", "--addr", "127.0.0.1:50051"]

# sitsmesh handles SIGTERM itself: health NOT_SERVING, drain, then stop with grace.
STOPSIGNAL SIGTERM
ENTRYPOINT ["sitsmesh", "serve"]
