#!/bin/sh
# Slurm Epilog: after a job, drain the node when gpu-exporter judges one of its GPUs critical,
# so that no further job starts on it.
#
# Runs `gpu-exporter health --from "$GPU_EXPORTER_URL"` for every GPU of the node (a job can
# leave a GPU broken, and the next job on any GPU of the node is better placed elsewhere than
# next to it) and acts on its exit code:
#   0  no GPU is critical (warnings pass, unless GPU_EXPORTER_STRICT=1): exit 0.
#   1  a GPU is critical: drain the node, the first failing GPU's line as the reason, and exit
#      1 (Slurm drains a node whose epilog fails as well; deploy/slurm/README.md).
#   2  could not decide (agent unreachable, no driver); so also a missing gpu-exporter, no
#      answer within GPU_EXPORTER_HEALTH_TIMEOUT, an exit 1 that names no failing GPU (a
#      crash): log it (stderr and syslog) and exit 0. GPU_EXPORTER_DRAIN_ON_UNKNOWN=1 drains
#      and fails instead.
#
# Settings, from the environment (Slurm starts epilogs with only its own variables: set them in
# a wrapper, README.md):
#   GPU_EXPORTER_URL                 the agent (default http://127.0.0.1:9402)
#   GPU_EXPORTER_BIN                 the program (default gpu-exporter, looked up in PATH)
#   GPU_EXPORTER_STRICT=1            warnings fail too (gpu-exporter health --strict)
#   GPU_EXPORTER_DRAIN_ON_UNKNOWN=1  "could not decide" drains and fails too
#   GPU_EXPORTER_HEALTH_TIMEOUT      seconds to wait for the answer (default 30)
set -u

me=gpu-exporter-slurm-epilog
# Every GPU of the node.
gpus=""

# The rest is shared with prolog.sh (gpu-health.sh, installed beside this script).
# shellcheck source=deploy/slurm/gpu-health.sh
. "$(dirname "$0")/gpu-health.sh"
