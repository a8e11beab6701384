# One image for every laswrr service; compose.yaml's `command:` picks the service:
#   docker build -t laswrr .
#   docker run --rm laswrr scheduler --nats-url nats://nats:4222
# The project is installed once into the system site-packages (no editable install, no sources
# left behind); the services run as the unprivileged user `laswrr`; data goes under /data.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 laswrr \
 && useradd --system --uid 10001 --gid laswrr --home-dir /home/laswrr --create-home laswrr \
 && mkdir -p /data /etc/laswrr \
 && chown laswrr:laswrr /data

# Only what `pip install .` needs (pyproject.toml names the packages; README.md is its readme).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY laswrr ./laswrr
COPY schemas ./schemas
COPY scheduler ./scheduler
COPY collectors ./collectors
COPY services ./services
COPY replay ./replay
COPY bench ./bench
RUN pip install . \
 && rm -rf /src

# Health checks and the example nodes file (compose.yaml mounts the real one over it).
WORKDIR /app
COPY deploy/healthcheck.py deploy/nodes.compose.toml ./deploy/
COPY deploy/nodes.compose.toml /etc/laswrr/nodes.toml

# For `docker run laswrr proxy|sim-engine|collector ...`: probes the command's own endpoint (the
# proxy's /readiness, an engine's /health, the collector's /metrics); compose.yaml sets each
# service's check itself.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "/app/deploy/healthcheck.py", "auto"]

USER laswrr
WORKDIR /home/laswrr
ENV NATS_URL=nats://nats:4222
EXPOSE 8000 9100
ENTRYPOINT ["laswrr"]
CMD ["--help"]
