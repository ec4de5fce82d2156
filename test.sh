#!/usr/bin/env bash
# Sets up .venv (if needed) and runs every test: lint, format, the import-layer contracts
# (import-linter), the type check (mypy), then the whole pytest suite.
# The end-to-end test needs Prometheus and Alertmanager, the HTTP benchmark's smoke test wrk and
# nginx, the container test (tests/test_container.py) podman, runc, catatonit (a pod's init)
# and mmdebstrap, the Slurm cluster test (tests/test_slurm_cluster.py) slurmd, slurmctld and
# munge, the status page's browser test (tests/test_page_browser.py) Debian's chromium and
# chromium-driver (selenium drives the system browser, offline): when they are missing, they are
# installed from Debian's packages if this runs as root; otherwise those tests are skipped and
# say why.
# Tests marked `gpu` run only where a real NVIDIA driver answers; elsewhere they are skipped.
# Then the NVML layer's tests run once more on the oldest nvidia-ml-py the project allows.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

missing=()
for tool in prometheus:prometheus prometheus-alertmanager:prometheus-alertmanager wrk:wrk \
    nginx:nginx-light podman:podman runc:runc catatonit:catatonit mmdebstrap:mmdebstrap \
    slurmd:slurmd slurmctld:slurmctld munged:munge chromium:chromium \
    chromedriver:chromium-driver; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "test.sh: installing ${missing[*]} (Debian packages)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || true
        for package in "${missing[@]}"; do  # one by one: a package gone does not stop the rest
            apt-get install -y -qq --no-install-recommends "$package" >/dev/null ||
                echo "test.sh: could not install $package; the tests that need it will skip"
        done
    else
        echo "test.sh: ${missing[*]} missing and not root: the tests that need them will skip"
    fi
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# compat: the checkout goes on sys.path through a plain .pth line; the default editable mode
# installs an import hook whose own imports cost every Python start ~18 ms (and the suite
# starts some hundred agents and launchers)
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]' \
    --config-settings editable_mode=compat
.venv/bin/ruff check .
.venv/bin/ruff format --check --quiet .
.venv/bin/lint-imports --no-cache >/dev/null || .venv/bin/lint-imports --no-cache
.venv/bin/mypy --no-error-summary
.venv/bin/python -m pytest "$@"

# The NVML layer again on the oldest nvidia-ml-py pyproject.toml allows (the run above has the
# newest), beside the project's venv: neither end of the range breaks unseen.
oldest=$(sed -n 's/.*"nvidia-ml-py>=\([0-9.]*\),.*/\1/p' pyproject.toml)
if [ ! -d ".nvml-oldest/nvidia_ml_py-$oldest.dist-info" ]; then
    rm -rf .nvml-oldest
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
        --target .nvml-oldest "nvidia-ml-py==$oldest"
fi
echo "test.sh: the NVML layer on nvidia-ml-py $oldest"
PYTHONPATH=.nvml-oldest .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_nvml.py tests/test_fields.py tests/test_gpm.py tests/test_xid.py tests/test_collect.py \
    tests/test_simulate.py tests/test_metrics.py tests/test_faults.py tests/test_fieldplan.py
