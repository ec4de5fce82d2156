#!/bin/sh
# Slurm Prolog: keep a job off GPUs that gpu-exporter judges critical.
#
# Runs `gpu-exporter health --from "$GPU_EXPORTER_URL"` for the job's GPUs (SLURM_JOB_GPUS,
# passed as --gpu; every GPU of the node when it is not set) and acts on its exit code:
#   0  no GPU of the job is critical (warnings pass, unless GPU_EXPORTER_STRICT=1): exit 0.
#   1  a GPU is critical: drain the node, the first failing GPU's line as the reason, and exit
#      1, so that Slurm requeues the job elsewhere (deploy/slurm/README.md says what Slurm does).
#   2  could not decide (agent unreachable, no driver); so also a missing gpu-exporter, no
#      answer within GPU_EXPORTER_HEALTH_TIMEOUT, an exit 1 that names no failing GPU (a
#      crash): log it (stderr and syslog) and exit 0, so that a broken agent does not stop
#      every job. GPU_EXPORTER_DRAIN_ON_UNKNOWN=1 drains and fails instead.
#
# Settings, from the environment (Slurm starts prologs with only its own variables: set them in
# a wrapper, README.md):
#   GPU_EXPORTER_URL                 the agent (default http://127.0.0.1:9402)
#   GPU_EXPORTER_BIN                 the program (default gpu-exporter, looked up in PATH)
#   GPU_EXPORTER_STRICT=1            warnings fail too (gpu-exporter health --strict)
#   GPU_EXPORTER_DRAIN_ON_UNKNOWN=1  "could not decide" drains and fails too
#   GPU_EXPORTER_HEALTH_TIMEOUT      seconds to wait for the answer (default 30)
set -u

me=gpu-exporter-slurm-prolog
# The job's GPUs, as Slurm numbers them (with AutoDetect=nvml, or gres.conf listing
# /dev/nvidia0... in order, NVML's indices).
gpus="${SLURM_JOB_GPUS:-}"

# The rest is shared with epilog.sh (gpu-health.sh, installed beside this script).
# shellcheck source=deploy/slurm/gpu-health.sh
. "$(dirname "$0")/gpu-health.sh"
