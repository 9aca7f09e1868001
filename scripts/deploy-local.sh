#!/usr/bin/env bash
# Rehearse a real deployment on this machine: a SuperLink with TLS and
# SuperNode authentication, N SuperNodes (each its own key, port and data
# partition), one `flwr run` of any algorithm through them, then shut down.
#
#   bash scripts/deploy-local.sh [-n N] [-c "RUN CONFIG"] [-d WORK_DIR] [-k]
#
#   -n N           SuperNodes (default 2)
#   -c CONFIG      run config, as for flwr run (default "num-server-rounds=2")
#   -d WORK_DIR    certificates, keys, logs, FLWR_HOME (default .deploy/)
#   -k             keep SuperLink and SuperNodes running (print how to stop)
#
# Results go to WORK_DIR/results/<run-name>/ (the ServerApp runs in the
# SuperLink's process tree, so results-dir is made absolute). Flower commands
# used (flwr 1.41): flower-superlink --enable-supernode-auth, flwr supernode
# register, flower-supernode --auth-supernode-private-key, flwr run . NAME.
set -euo pipefail

nodes=2
run_config="num-server-rounds=2"
work=.deploy
keep=0
while getopts "n:c:d:kh" opt; do
    case $opt in
        n) nodes=$OPTARG ;;
        c) run_config=$OPTARG ;;
        d) work=$OPTARG ;;
        k) keep=1 ;;
        *) sed -n '2,16p' "$0"; exit 2 ;;
    esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work"
work=$(cd "$work" && pwd)
port=${FEDACCEL_SUPERLINK_PORT:-9091}
address="127.0.0.1:$port"
export FLWR_HOME="$work/flwr-home"
export FLWR_DISABLE_UPDATE_CHECK=1
mkdir -p "$FLWR_HOME" "$work/logs" "$work/keys" "$work/results"
pids=()

cleanup() {
    if [ "$keep" = 1 ]; then
        echo "[deploy] left running: pids ${pids[*]} (stop: kill ${pids[*]})"
        return
    fi
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    sleep 2
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    echo "[deploy] stopped SuperLink and ${nodes} SuperNode(s)"
}
trap cleanup EXIT

[ -f "$work/certs/ca.crt" ] || bash "$root/scripts/gen-certs.sh" "$work/certs" >/dev/null

echo "[deploy] starting SuperLink on $address (TLS, SuperNode authentication)"
setsid flower-superlink --host 127.0.0.1 --port "$port" \
    --ssl-ca-certfile "$work/certs/ca.crt" --ssl-certfile "$work/certs/server.pem" \
    --ssl-keyfile "$work/certs/server.key" --enable-supernode-auth \
    --disable-runtime-dependency-installation \
    > "$work/logs/superlink.log" 2>&1 &
pids+=($!)

cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "deployment"

[superlink.deployment]
address = "$address"
root-certificates = "$work/certs/ca.crt"
TOML

for _ in $(seq 1 60); do
    flwr supernode list deployment >/dev/null 2>&1 && break
    sleep 0.5
done
flwr supernode list deployment >/dev/null 2>&1 \
    || { echo "[deploy] SuperLink did not come up; see $work/logs/superlink.log" >&2; exit 1; }

for i in $(seq 0 $((nodes - 1))); do
    key="$work/keys/supernode-$i"
    [ -f "$key" ] || ssh-keygen -q -t ecdsa -b 384 -N "" -f "$key" -C "fedaccel-supernode-$i"
    flwr supernode register "$key.pub" deployment >/dev/null
    setsid flower-supernode --superlink "$address" --root-certificates "$work/certs/ca.crt" \
        --auth-supernode-private-key "$key" \
        --node-config "partition-id=$i num-partitions=$nodes" \
        --port $((9094 + i)) > "$work/logs/supernode-$i.log" 2>&1 &
    pids+=($!)
done
echo "[deploy] started $nodes SuperNode(s) with registered ECDSA keys"

cd "$root"
flwr run . deployment --stream \
    --run-config "$run_config results-dir='$work/results'"
