#!/usr/bin/env bash
# Builds the gpu-exporter image so that the build itself needs no network: the wheels are made
# here, outside the build, and the Dockerfile installs only those.
#
#   deploy/container/build.sh [--base IMAGE] [--tag NAME] [--engine podman|docker]
#                             [--target PYTHON GLIBC ARCH] [--no-strip] [--wheels-only]
#                             [--extras LIST]
#                             [-- BUILD-ARGS...]
#
# 1. Asks the base image (default python:3.12-slim) which Python, glibc and machine it has, by
#    running `python3` in it once; --target 3.11 2.36 x86_64 says it instead (an engine that
#    cannot run containers, or a base for another machine).
# 2. Into deploy/container/wheels/ (emptied first; git and the build context keep nothing else
#    from deploy/container/): the project's wheel (`pip wheel --no-deps`) and its dependencies
#    as binary wheels for that Python and platform (`pip download --only-binary=:all:`), resolved
#    from the project wheel's own requirements. Their shared objects lose their debug
#    information (strip_wheels.py; some wheels ship it, uvloop's is 12 MB of it), unless
#    --no-strip.
# 3. `ENGINE build --build-arg BASE=IMAGE --build-arg EXTRAS=LIST -t NAME [BUILD-ARGS...] .` from
#    the repository's root, unless --wheels-only.
#
# --extras: the project's extras the image gets (default kubernetes: grpcio and protobuf, for
# the kubelet's pod-resources API, about 19 MB; --extras '' for an image for hosts without a
# kubelet).
#
# Step 2 is the only one that reads a package index: point pip at a mirror or a wheel folder the
# usual way (PIP_INDEX_URL, PIP_FIND_LINKS with PIP_NO_INDEX=1, pip.conf). PYTHON is the
# interpreter whose pip does it (default: the checkout's .venv, else python3). The engine is
# podman when it is installed, else docker (ENGINE= or --engine chooses); its own settings
# (CONTAINERS_CONF, BUILDAH_ISOLATION, DOCKER_HOST) pass through.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
wheels="$root/deploy/container/wheels"
base="${BASE:-python:3.12-slim}"
engine="${ENGINE:-}"
tag=""
target=()
wheels_only=0
strip=1
extras=kubernetes

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
    exit "$1"
}

while [ "$#" -gt 0 ]; do
    case "$1" in
        --base) base="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --engine) engine="$2"; shift 2 ;;
        --target) target=("$2" "$3" "$4"); shift 4 ;;
        --wheels-only) wheels_only=1; shift ;;
        --no-strip) strip=0; shift ;;
        --extras) extras="$2"; shift 2 ;;
        -h | --help) usage 0 ;;
        --) shift; break ;;
        *) echo "build.sh: unknown argument $1" >&2; usage 2 >&2 ;;
    esac
done

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
if [ -z "$engine" ]; then
    if command -v podman >/dev/null; then engine=podman; else engine=docker; fi
fi
version="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$root/exporter/__init__.py")"
tag="${tag:-gpu-exporter:$version}"

# One build at a time per checkout: the wheel folder is shared.
mkdir -p "$wheels"
if command -v flock >/dev/null; then
    exec 9<"$wheels"
    flock 9
fi

if [ "${#target[@]}" -eq 0 ]; then
    echo "build.sh: asking $base for its Python and platform"
    # shellcheck disable=SC2207  # three words, split on purpose
    target=($("$engine" run --rm --entrypoint python3 "$base" -c \
        'import platform, sys; v = sys.version_info; print(f"{v[0]}.{v[1]}", platform.libc_ver()[1] or "none", platform.machine(), sys.implementation.name)'))
    if [ "${#target[@]}" -ne 4 ] || [ "${target[3]}" != cpython ]; then
        echo "build.sh: $base did not answer as a CPython: ${target[*]:-nothing}" >&2
        exit 1
    fi
fi
python_version="${target[0]}"
glibc="${target[1]}"
arch="${target[2]}"
if ! [[ "$glibc" =~ ^2\.[0-9]+$ ]]; then
    echo "build.sh: $base has no glibc ($glibc): only manylinux wheels are fetched" >&2
    exit 1
fi

# Every manylinux tag that glibc runs (pip does not widen manylinux_2_Y by itself).
platforms=()
for minor in $(seq "${glibc#2.}" -1 5); do
    platforms+=(--platform "manylinux_2_${minor}_$arch")
done
platforms+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch"
    --platform "manylinux1_$arch")

echo "build.sh: wheels for CPython $python_version, glibc $glibc, $arch in ${wheels#"$root/"}/"
rm -f "$wheels"/*.whl
pip=("$PYTHON" -m pip --disable-pip-version-check --quiet)
# From a copy of what the wheel is made of: setuptools' build/ and egg-info stay out of the checkout.
source="$(mktemp -d)"
trap 'rm -rf "$source"' EXIT
cp -R "$root/pyproject.toml" "$root/README.md" "$root/exporter" "$source/"
find "$source" -name __pycache__ -prune -exec rm -rf {} +
"${pip[@]}" wheel --no-deps --wheel-dir "$wheels" "$source"
project_wheel=("$wheels"/gpu_exporter-*.whl)
requirement="${project_wheel[0]}"
if [ -n "$extras" ]; then
    requirement="$requirement[$extras]"
fi
"${pip[@]}" download --dest "$wheels" --only-binary=:all: --implementation cp \
    --python-version "$python_version" "${platforms[@]}" "$requirement"
if [ "$strip" = 1 ]; then
    "$PYTHON" "$root/deploy/container/strip_wheels.py" "$wheels"/*.whl
fi
ls -1 "$wheels"

if [ "$wheels_only" = 1 ]; then
    exit 0
fi
echo "build.sh: $engine build $tag on $base"
cd "$root"
format=()
if [ "$(basename "$engine")" = podman ]; then
    format=(--format docker)  # OCI image configs have no HEALTHCHECK: podman would drop it
fi
"$engine" build "${format[@]}" --build-arg "BASE=$base" --build-arg "EXTRAS=$extras" \
    --tag "$tag" "$@" .
