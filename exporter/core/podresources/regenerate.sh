#!/bin/sh
# Regenerates api_pb2.py and api_pb2_grpc.py from api.proto (run from anywhere; needs network
# for pip once). The generated modules are committed, not made at build time: building the
# package then needs no protoc, and the code that ships is the code the tests ran.
#
# The generator is grpcio-tools 1.62.3 (protoc 25) on purpose: its code has no runtime version
# check and runs on every protobuf from 4.21.6 to 7.x and every grpcio from 1.59 (the ranges in
# pyproject.toml's `kubernetes` extra; tests/test_kubelet.py checks the committed code against
# api.proto). Newer generators stamp their code with their own version and refuse older runtimes
# (grpcio-tools 1.85's code demands protobuf >= 7.35.1 and grpcio >= 1.85.1).
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
venv="$(mktemp -d)"
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check 'grpcio-tools==1.62.3'
cd "$root"
"$venv/bin/python" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
    exporter/core/podresources/api.proto
echo "regenerated exporter/core/podresources/api_pb2.py and api_pb2_grpc.py"
