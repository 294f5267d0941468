#!/usr/bin/env bash
# Certificates for mutual TLS between learners and the aggregator, with the openssl tool:
#
#   deploy/make_certs.sh DIR SERVER_SAN [LEARNER_ID ...]
#   deploy/make_certs.sh certs 'DNS:*.diloco-server,DNS:localhost,IP:127.0.0.1' dc1-node0 dc2-node0
#
# Writes into DIR: ca.crt/ca.key (the CA) and server.crt/server.key (for every shard: SERVER_SAN
# must name each address the learners dial), both made once and kept by later calls, so that
# learners can be added; and LEARNER_ID.crt/.key per learner named. Keys are EC P-256, readable only by
# their owner; DAYS (default 365) sets the validity. Give the server tls_cert, tls_key and
# tls_client_ca=ca.crt; each learner tls_ca=ca.crt and its own tls_cert, tls_key. Keep ca.key
# off the servers and learners: whoever holds it can mint a learner certificate.
set -euo pipefail

usage() { echo "usage: $0 DIR SERVER_SAN [LEARNER_ID ...] (e.g. SERVER_SAN 'DNS:localhost,IP:127.0.0.1')" >&2; exit 2; }
[ $# -ge 2 ] || usage
dir=$1 server_san=$2
shift 2
case $server_san in
    DNS:* | IP:*) ;;
    *) echo "$0: SERVER_SAN must be a list of DNS:name or IP:address, got '$server_san'" >&2; exit 2 ;;
esac
for learner in "$@"; do  # each names two files in DIR
    case $learner in
        server | ca | *[!A-Za-z0-9._-]* | .*) echo "$0: bad learner id '$learner'" >&2; exit 2 ;;
    esac
done
command -v openssl >/dev/null || { echo "$0: the openssl command is needed" >&2; exit 2; }
days=${DAYS:-365}
ec_key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
mkdir -p "$dir"
cd "$dir"
umask 077  # the keys: owner only

if [ ! -e ca.key ]; then
    openssl req -x509 "${ec_key[@]}" -keyout ca.key -out ca.crt -days "$days" \
        -subj "/CN=diloco-ca" -addext "basicConstraints=critical,CA:TRUE" 2>/dev/null
    echo "made ca.crt"
fi

# sign NAME SAN USAGE: NAME.key and NAME.crt, signed by the CA.
sign() {
    local name=$1 san=$2 usage=$3 extfile
    extfile=$(mktemp)
    printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$san" "$usage" >"$extfile"
    openssl req "${ec_key[@]}" -keyout "$name.key" -out "$name.csr" -subj "/CN=$name" 2>/dev/null
    openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
        -out "$name.crt" -days "$days" -extfile "$extfile" 2>/dev/null
    rm -f "$name.csr" "$extfile"
    chmod 644 "$name.crt"
    echo "made $name.crt ($san)"
}

chmod 644 ca.crt
if [ -e server.key ]; then  # a running server keeps its certificate: not replaced
    echo "kept server.crt ($(openssl x509 -in server.crt -noout -ext subjectAltName | tail -n +2 | tr -d ' ')); delete server.key to make it again"
else
    sign server "$server_san" serverAuth
fi
for learner in "$@"; do
    sign "$learner" "DNS:$learner" clientAuth
done
