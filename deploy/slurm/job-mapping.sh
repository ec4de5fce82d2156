#!/bin/sh
# Slurm Prolog and Epilog: the job-mapping directory gpu-exporter reads (paths.slurm_job_dir),
# so that gpu_allocation_info names the job of each of its GPUs, also before the job has a
# process on them.
#
#   job-mapping.sh prolog   write one file per GPU of the job, named by the GPU's UUID,
#                           holding "<jobid> <uid>" (Princeton jobstats' format)
#   job-mapping.sh epilog   remove the files of this job (and only those)
#
# Slurm numbers a job's GPUs (SLURM_JOB_GPUS) as gres.conf lists them: with File=/dev/nvidia[0-3]
# that is the device's minor number, which is NOT always NVML's index (nvidia-smi's, PCI bus
# order). Files named by index would then name the wrong GPU; so the script names them by UUID,
# matching SLURM_JOB_GPUS to nvidia-smi's minor numbers (GPU_EXPORTER_GPU_NUMBERS=index: to
# NVML's indices, for gres.conf with AutoDetect=nvml).
#
# It never fails a job: every problem is logged (stderr and syslog) and it exits 0.
# Settings, from the environment (set them in a wrapper, deploy/slurm/README.md):
#   GPU_EXPORTER_SLURM_JOB_DIR   the directory (default /run/gpu-exporter/slurm-jobs)
#   GPU_EXPORTER_GPU_NUMBERS     minor (default) or index: what SLURM_JOB_GPUS numbers
#   NVIDIA_SMI                   the program (default nvidia-smi, looked up in PATH)
set -u
# Slurm starts prologs and epilogs without a search path (as deploy/slurm/gpu-health.sh says):
# the usual one, after whatever PATH a wrapper set.
PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export PATH

me=gpu-exporter-job-mapping
dir="${GPU_EXPORTER_SLURM_JOB_DIR:-/run/gpu-exporter/slurm-jobs}"
job="${SLURM_JOB_ID:-}"

say() {
    echo "$me: $*" >&2
    logger -t "$me" -- "$*" 2>/dev/null || true
}

case "$job" in
'' | *[!0-9_]*)
    say "no usable SLURM_JOB_ID ('$job'): nothing done"
    exit 0
    ;;
esac

prolog() {
    numbers="${GPU_EXPORTER_GPU_NUMBERS:-minor}"
    case "$numbers" in
    minor) field=minor_number ;;
    index) field=index ;;
    *)
        say "GPU_EXPORTER_GPU_NUMBERS must be minor or index, not '$numbers'"
        return
        ;;
    esac
    if ! mkdir -p "$dir" 2>/dev/null; then
        say "cannot make $dir"
        return
    fi
    listing=$("${NVIDIA_SMI:-nvidia-smi}" --query-gpu="$field,uuid" --format=csv,noheader 2>&1) || {
        say "nvidia-smi failed: $listing"
        return
    }
    for gpu in $(echo "${SLURM_JOB_GPUS:-}" | tr ',' ' '); do
        uuid=$(echo "$listing" | awk -F', *' -v n="$gpu" '$1 == n { print $2; exit }')
        if [ -z "$uuid" ]; then
            say "job $job: GPU $gpu ($numbers number) not found by nvidia-smi"
            continue
        fi
        # written aside, then renamed: the agent never reads half a file
        tmp="$dir/.$uuid.$job"
        if printf '%s %s\n' "$job" "${SLURM_JOB_UID:-}" >"$tmp" && mv -f "$tmp" "$dir/$uuid"; then
            :
        else
            say "job $job: cannot write $dir/$uuid"
            rm -f "$tmp"
        fi
    done
}

epilog() {
    for file in "$dir"/GPU-* "$dir"/MIG-*; do
        [ -f "$file" ] || continue
        read -r owner _ <"$file" 2>/dev/null || continue
        [ "$owner" = "$job" ] && rm -f "$file"
    done
}

case "${1:-}" in
prolog) prolog ;;
epilog) epilog ;;
*) say "usage: job-mapping.sh prolog|epilog" ;;
esac
exit 0
