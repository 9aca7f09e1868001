#!/usr/bin/env bash
# Private CA and a SuperLink server certificate for local/test deployments.
#
#   bash scripts/gen-certs.sh [OUT_DIR] [HOST_IP] [HOST_NAME]
#
# Writes OUT_DIR/ca.crt, ca.key, server.pem, server.key (default OUT_DIR:
# certificates/, HOST_IP 127.0.0.1, HOST_NAME localhost). The server
# certificate carries subjectAltName IP:HOST_IP,DNS:HOST_NAME, which gRPC
# checks. For a real deployment use your organisation's CA instead.
set -euo pipefail
out=${1:-certificates}
ip=${2:-127.0.0.1}
name=${3:-localhost}
mkdir -p "$out"
cd "$out"
openssl req -x509 -newkey rsa:4096 -sha256 -days 365 -nodes \
    -keyout ca.key -out ca.crt -subj "/CN=fedaccel-local-ca" 2>/dev/null
openssl req -newkey rsa:4096 -sha256 -nodes -keyout server.key -out server.csr \
    -subj "/CN=$name" 2>/dev/null
printf "subjectAltName=IP:%s,DNS:%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" \
    "$ip" "$name" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out server.pem -days 365 -sha256 -extfile server.ext 2>/dev/null
rm -f server.csr server.ext ca.srl
chmod 600 ca.key server.key
echo "[gen-certs] wrote $(pwd)/{ca.crt,ca.key,server.pem,server.key} for $ip / $name"
