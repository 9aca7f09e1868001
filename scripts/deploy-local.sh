#!/usr/bin/env bash
# Rehearse a real deployment on this machine: a SuperLink with TLS and
# SuperNode authentication, N SuperNodes (each its own ECDSA key, port and
# data partition), one `flwr run` of any algorithm through them, then stop
# every process it started.
#
#   bash scripts/deploy-local.sh [-n N] [-c "RUN CONFIG"] [-d WORK_DIR] [-p PORT]
#
#   -n N           SuperNodes (default 2)
#   -c CONFIG      run config, as for flwr run (default "num-server-rounds=2")
#   -d WORK_DIR    certificates, keys, logs, FLWR_HOME, results (default .deploy/)
#   -p PORT        SuperLink port (default 9091)
#
# The recipe lives in fedaccel/deployment.py (also used by the tests); see
# docs/deployment.md for running the same on real devices.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m fedaccel.deployment "$@"
