# gpu-exporter image.
#
#   deploy/container/build.sh                        # wheels, then this build (podman or docker)
#   docker run --rm --gpus all --pid=host --read-only -p 9402:9402 gpu-exporter:VERSION
#   docker run --rm --read-only --tmpfs /tmp -p 9402:9402 gpu-exporter:VERSION serve --simulate
#       (no GPU needed; the simulation needs a writable /tmp for its stand-in device nodes)
#
# The build needs no network: it installs the wheels that deploy/container/build.sh puts in
# deploy/container/wheels/ (the project's, and its dependencies' for the base image's Python and
# platform), and nothing from an index. By hand, with the wheels already there:
#
#   docker build --build-arg BASE=python:3.12-slim -t gpu-exporter .
#
# BASE is any glibc-based image with python3 (3.10 or later) that can make a virtual environment
# (`python3 -m venv`, with ensurepip; Debian's python3-venv): the project goes into
# /opt/gpu-exporter, never into the base's own Python (PEP 668). docs/deploy.md says more.
#
# The NVIDIA driver's libnvidia-ml.so is not in the image: the NVIDIA Container Toolkit mounts it
# (and the /dev/nvidia* devices) when the container is started with --gpus (or a CDI device).

ARG BASE=python:3.12-slim

# -- builder: a virtual environment made from the wheels, offline --------------------------------
FROM ${BASE} AS builder
# The project's extras: kubernetes (grpcio and protobuf) reads the kubelet's pod-resources API;
# '' leaves them out, for hosts without a kubelet (build.sh --extras '').
ARG EXTRAS=kubernetes

COPY deploy/container/wheels/ /tmp/wheels/
# --no-index: only the wheels copied in. pip itself (and setuptools, which Python 3.11's venv
# adds) is removed afterwards: the agent needs neither, and the image stays smaller.
RUN python3 -m venv /opt/gpu-exporter \
    && /opt/gpu-exporter/bin/python -m pip install --no-cache-dir --no-index \
        --disable-pip-version-check --find-links /tmp/wheels "gpu-exporter${EXTRAS:+[$EXTRAS]}" \
    && /opt/gpu-exporter/bin/python -m pip uninstall --yes --quiet pip setuptools \
    && /opt/gpu-exporter/bin/gpu-exporter --version \
    && case ",$EXTRAS," in *,kubernetes,*) /opt/gpu-exporter/bin/python -c \
        "import exporter.core.podresources.api_pb2_grpc" ;; esac

# -- final: the base with the virtual environment, nothing else ----------------------------------
FROM ${BASE}

LABEL org.opencontainers.image.title="gpu-exporter" \
      org.opencontainers.image.description="Prometheus exporter for NVIDIA GPUs: one NVML sample per interval, per-process GPU memory, self-health metrics." \
      org.opencontainers.image.source="https://github.com/OWNER/gpu-exporter" \
      org.opencontainers.image.licenses="Apache-2.0"

# The virtual environment's bin comes first: `gpu-exporter` and its `python` (the HEALTHCHECK's).
# The lock directory is named, as the systemd unit and the DaemonSet name it: a missing one is an
# error (exit 2), never a private per-user directory that no launcher uses.
ENV PATH="/opt/gpu-exporter/bin:$PATH" \
    GPU_EXPORTER_LOCK_DIR=/run/gpu-exporter/locks \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

COPY --from=builder /opt/gpu-exporter /opt/gpu-exporter

# The launchers' shared lock directory, root-owned and sticky like /tmp. The agent only reads it
# (which locks are held); shipping it means a --read-only container, where the agent cannot create
# it, still has one. Mount the host's /run/gpu-exporter/locks over it to see the host's launchers.
#
# Bytecode, on purpose: a read-only root cannot cache it, and compiling at every start costs
# each command about 0.2 s. pip compiled the virtual environment; importing every module of the
# agent once (the generated gRPC ones only with the kubernetes extra) compiles the standard
# library's modules it uses, which the official images ship as
# sources only (about 5 MB; a no-op on Debian's python3, compiled at install).
RUN mkdir -p /run/gpu-exporter/locks \
    && chmod 1777 /run/gpu-exporter/locks \
    && PYTHONDONTWRITEBYTECODE='' python -c "import importlib, importlib.util, pkgutil, exporter; \
grpc = importlib.util.find_spec('grpc') is not None; \
[importlib.import_module(m.name) for m in pkgutil.walk_packages(exporter.__path__, 'exporter.') \
 if not m.name.endswith('__main__') and (grpc or '.podresources.' not in m.name)]"

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
