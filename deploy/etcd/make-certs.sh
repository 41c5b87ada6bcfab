#!/usr/bin/env bash
# The etcd cluster's own CA, one certificate per member (server and peer: the member's
# address and 127.0.0.1) and one client certificate for the coordinators.
# Usage: make-certs.sh OUT_DIR [MEMBER_ADDRESS ...]   (default 10.0.0.11 10.0.0.12 10.0.0.13)
# Keep this CA apart from the federation's: an agent's certificate must not open etcd.
set -euo pipefail
out=$1
shift
[ $# -gt 0 ] || set -- 10.0.0.11 10.0.0.12 10.0.0.13
members=("$@")
days=825
mkdir -p "$out"
cd "$out"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=federation etcd CA" -keyout ca-key.pem -out ca.pem 2>/dev/null

issue() {  # name, extended key usages, subjectAltName
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
        -keyout "$1-key.pem" -out "$1.csr" 2>/dev/null
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days "$days" \
        -out "$1.pem" -extfile <(printf 'extendedKeyUsage=%s\nsubjectAltName=%s\n' "$2" "$3") \
        2>/dev/null
    rm "$1.csr"
}

i=1
for address in "${members[@]}"; do
    issue "etcd-$i" serverAuth,clientAuth "IP:$address,IP:127.0.0.1,DNS:localhost"
    i=$((i + 1))
done
issue client clientAuth "DNS:federation-coordinator"
chmod 0644 ca.pem
echo "made in $out: ca.pem, etcd-N.pem/etcd-N-key.pem per member, client.pem/client-key.pem"
