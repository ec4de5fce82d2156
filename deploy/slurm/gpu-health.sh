#!/bin/sh
# What prolog.sh and epilog.sh share, sourced by both after they set $me (the name they log
# under) and $gpus (the GPUs to check: "" for every GPU of the node). Not run on its own.
# shellcheck shell=sh disable=SC2154

# Slurm starts prologs and epilogs without a search path: add the usual one (after whatever PATH
# there is, so that a PATH set by a wrapper wins).
PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export PATH

url="${GPU_EXPORTER_URL:-http://127.0.0.1:9402}"
bin="${GPU_EXPORTER_BIN:-gpu-exporter}"
limit="${GPU_EXPORTER_HEALTH_TIMEOUT:-30}"
job="${SLURM_JOB_ID:-?}"
node="${SLURMD_NODENAME:-}"
#: The longest GPU line a drain reason quotes (sinfo -R shows the start; scontrol show node all).
max_line=160

log() {
    # stderr (slurmd's log, at its debug level) and syslog, where people look for it
    printf '%s: job %s: %s\n' "$me" "$job" "$*" >&2
    if command -v logger >/dev/null 2>&1; then
        logger -p daemon.warning -t "$me" -- "job $job: $*" 2>/dev/null || :
    fi
}

# The GPUs as gpu-exporter health --gpu wants them: comma-separated indices or UUIDs. Slurm
# writes indices ("0,1"); a range ("0-3") is expanded in case a version writes one.
gpu_list() {
    list="" old_ifs=$IFS
    set -f
    IFS=,
    for item in $1; do
        lo=${item%%-*} hi=${item#*-}
        case "$item" in
            "") ;;
            *-*)
                case "$lo$hi" in
                    "" | *[!0-9]*) list="$list,$item" ;; # a UUID: as it is
                    *)
                        i=$lo
                        while [ "$i" -le "$hi" ]; do
                            list="$list,$i"
                            i=$((i + 1))
                        done
                        ;;
                esac
                ;;
            *) list="$list,$item" ;;
        esac
    done
    IFS=$old_ifs
    set +f
    printf '%s' "${list#,}"
}

# gpu-exporter health's output (stdout and stderr) and exit status; 127 without the program,
# 124 (or 137) when it did not answer within $limit seconds.
run_health() {
    if ! command -v "$bin" >/dev/null 2>&1; then
        echo "$bin: not found (PATH=$PATH)"
        return 127
    fi
    if command -v timeout >/dev/null 2>&1; then
        timeout -k 5 "$limit" "$bin" health --from "$url" "$@" 2>&1
    else
        "$bin" health --from "$url" "$@" 2>&1
    fi
}

drain() {
    line=$(printf '%s' "$1" | tr -cd '[:print:]')
    if [ "${#line}" -gt "$max_line" ]; then
        line="$(printf '%s' "$line" | cut -c "1-$((max_line - 3))")..."
    fi
    reason="gpu-exporter: $line$2"
    if [ -z "$node" ]; then
        log "SLURMD_NODENAME is not set, so the node cannot be drained: $reason"
        return
    fi
    if scontrol update nodename="$node" state=drain reason="$reason"; then
        log "drained $node: $reason"
    else
        log "scontrol failed ($?) to drain $node: $reason"
    fi
}

# Exit 2 of gpu-exporter health, and whatever else does not say which GPU failed.
undecided() {
    if [ "${GPU_EXPORTER_DRAIN_ON_UNKNOWN:-0}" = 1 ]; then
        log "could not decide ($1); draining, as GPU_EXPORTER_DRAIN_ON_UNKNOWN=1 asks"
        drain "could not decide: $1" ""
        exit 1
    fi
    log "could not decide ($1); not draining (GPU_EXPORTER_DRAIN_ON_UNKNOWN=1 would)"
    exit 0
}

set --
if [ "${GPU_EXPORTER_STRICT:-0}" = 1 ]; then
    set -- "$@" --strict
fi
gpus=$(gpu_list "$gpus")
if [ -n "$gpus" ]; then
    set -- "$@" --gpu "$gpus"
fi
output=$(run_health "$@")
rc=$?

case $rc in
    0)
        exit 0
        ;;
    1)
        # One line per GPU: "GPU 1 GPU-...: critical: memory_repair: ...; xid: ...".
        failing=$(printf '%s\n' "$output" | grep -E '^GPU [0-9]+ [^:]*: critical(:|$)')
        if [ -z "$failing" ]; then
            failing=$(printf '%s\n' "$output" | grep -E '^GPU [0-9]+ [^:]*: warning(:|$)')
        fi
        if [ -n "$failing" ]; then
            more=$(($(printf '%s\n' "$failing" | wc -l) - 1))
            suffix=""
            if [ "$more" -gt 0 ]; then
                suffix=" (+$more more)"
            fi
            drain "$(printf '%s\n' "$failing" | head -n 1)" "$suffix"
            exit 1
        fi
        # Exit 1 without a failing GPU line: a crash (Python exits 1 on an exception), not a
        # verdict. Not a reason to drain every node it runs on.
        undecided "exit 1 without a failing GPU: $(printf '%s\n' "$output" | tail -n 1)"
        ;;
    124 | 137)
        undecided "no answer within ${limit}s from $bin health --from $url"
        ;;
    *)
        said=$(printf '%s\n' "$output" | sed -n '/^gpu-exporter health: /{p;q;}')
        undecided "exit $rc: ${said:-$(printf '%s\n' "$output" | tail -n 1)}"
        ;;
esac
