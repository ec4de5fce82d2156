#!/usr/bin/env bash
# Sets up .venv (if needed) and runs every test: lint, then the whole pytest suite.
# Tests marked `gpu` run only where a real NVIDIA driver answers; elsewhere they are skipped.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
.venv/bin/ruff check exporter tests
.venv/bin/python -m pytest "$@"
