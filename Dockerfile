# gpu-exporter image.
#
#   docker build -t gpu-exporter .
#   docker run --rm --gpus all --pid=host --read-only -p 9402:9402 gpu-exporter
#   docker run --rm --read-only --tmpfs /tmp -p 9402:9402 gpu-exporter serve --simulate
#       (no GPU needed; the simulation needs a writable /tmp for its stand-in device nodes)
#
# The NVIDIA driver's libnvidia-ml.so is not in the image: the NVIDIA Container Toolkit mounts it
# (and the /dev/nvidia* devices) when the container is started with --gpus.

# -- builder: the project and its dependencies as wheels --------------------------------------
FROM python:3.12-slim AS builder

WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# -- final: install the wheels, nothing else ---------------------------------------------------
FROM python:3.12-slim

LABEL org.opencontainers.image.title="gpu-exporter" \
      org.opencontainers.image.description="Prometheus exporter for NVIDIA GPUs: one NVML sample per interval, per-process GPU memory, self-health metrics." \
      org.opencontainers.image.source="https://github.com/OWNER/gpu-exporter" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# The wheels are installed by file name: exactly what the builder resolved, nothing from an index.
COPY --from=builder /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-index /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels

# The launchers' shared lock directory, root-owned and sticky like /tmp. The agent only reads it
# (which locks are held); shipping it means a --read-only container, where the agent cannot create
# it, still has one. Mount the host's /run/gpu-exporter/locks over it to see the host's launchers.
RUN mkdir -p /run/gpu-exporter/locks \
    && chmod 1777 /run/gpu-exporter/locks

# nobody:nogroup. NVML needs no root; reading other users' /proc/PID/{stat,cmdline,cgroup} works
# as any user unless /proc is mounted with hidepid.
USER 65534:65534

EXPOSE 9402

# /healthz is 200 while the last sample is fresh and NVML answers, 503 otherwise. The port follows
# GPU_EXPORTER_LISTEN when it is set; a TLS-only listener needs its own check.
HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('GPU_EXPORTER_LISTEN', ':9402').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4)"]

ENTRYPOINT ["gpu-exporter"]
CMD ["serve"]
