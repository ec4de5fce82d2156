#!/usr/bin/env bash
# Sets up .venv (if needed) and runs every test: lint, format, the import-layer contracts
# (import-linter), the type check (mypy), then the whole pytest suite.
# The end-to-end test needs Prometheus and Alertmanager: when they are missing, they are
# installed from Debian's packages if this runs as root; otherwise that test is skipped and says why.
# Tests marked `gpu` run only where a real NVIDIA driver answers; elsewhere they are skipped.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

if ! command -v prometheus >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "test.sh: installing prometheus and prometheus-alertmanager (Debian packages)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || true
        apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager \
            >/dev/null || echo "test.sh: could not install them; the end-to-end test will skip"
    else
        echo "test.sh: prometheus/prometheus-alertmanager missing and not root: e2e test will skip"
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
