#!/usr/bin/env bash
# Makes a base image for the Dockerfile from Debian's own packages, without a registry: the
# suite's python3 and python3-venv (bookworm: Python 3.11), ca-certificates and what they need,
# installed by mmdebstrap from this machine's apt sources and imported into the engine.
#
#   deploy/container/debian-base.sh [--suite bookworm] [--tag NAME] [--engine podman|docker]
#   deploy/container/build.sh --base NAME
#
# The default NAME is localhost/gpu-exporter-base:SUITE. Needs mmdebstrap (Debian package
# mmdebstrap) and root, or mmdebstrap's unshare mode for other users. Documentation, manual pages
# and translations are left out (copyright files stay); the image is still Debian's apt variant,
# so `apt-get install` works in it. tests/test_container.py builds the image on it.
set -euo pipefail

suite=bookworm
tag=""
engine="${ENGINE:-}"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --suite) suite="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --engine) engine="$2"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "debian-base.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
tag="${tag:-localhost/gpu-exporter-base:$suite}"
if [ -z "$engine" ]; then
    if command -v podman >/dev/null; then engine=podman; else engine=docker; fi
fi

echo "debian-base.sh: $suite with python3 and python3-venv into $tag"
mmdebstrap --quiet --variant=apt --format=tar \
    --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$suite" - |
    "$engine" import --change 'CMD ["python3"]' - "$tag"
