#!/usr/bin/env bash
# Certificates for mutual TLS between learners and the aggregator, with the openssl tool:
#
#   deploy/make_certs.sh DIR SERVER_SAN [LEARNER_ID ...]
#   deploy/make_certs.sh certs DNS:diloco-server-0.diloco-server,DNS:localhost dc1-node0 dc2-node0
#
# Writes into DIR: ca.crt/ca.key (the CA), server.crt/server.key (one pair for every shard:
# SERVER_SAN must name each address the learners dial) and LEARNER_ID.crt/.key per learner.
# Whatever DIR already holds is kept, so running it again with new ids adds learners (give the
# same SERVER_SAN). Each pair appears whole or not at all; keys are EC P-256, readable only by
# their owner; DAYS (default 365) sets the validity. Give the server tls_cert, tls_key and
# tls_client_ca=ca.crt; each learner tls_ca=ca.crt and its own tls_cert, tls_key. Keep ca.key
# off the servers and learners (whoever holds it can mint a learner certificate), and put it
# back in DIR to add learners. Works with OpenSSL 1.1.1 and 3.
set -euo pipefail

fail() {
    echo "make_certs.sh: $*" >&2
    exit 2
}
[ $# -ge 2 ] || fail "usage: make_certs.sh DIR SERVER_SAN [LEARNER_ID ...], e.g. SERVER_SAN 'DNS:localhost,IP:127.0.0.1'"
dir=$1 server_san=$2
shift 2
[[ $server_san =~ ^(DNS|IP):[^,]+(,(DNS|IP):[^,]+)*$ ]] ||
    fail "SERVER_SAN must be DNS:name or IP:address, comma separated, got '$server_san'"
days=${DAYS:-365}
[[ $days =~ ^[1-9][0-9]{0,4}$ ]] || fail "DAYS must be a whole number of days, got '$days'"
seen=" "
for learner in "$@"; do # each names two files in DIR
    [[ $learner =~ ^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$ && $learner != server && $learner != ca ]] ||
        fail "bad learner id '$learner' (1-64 of letters, digits, . _ -; not ca or server)"
    [[ $seen != *" $learner "* ]] || fail "learner id '$learner' is given twice"
    seen+="$learner "
done
command -v openssl >/dev/null || fail "the openssl command is needed"

umask 077 # the keys: owner only
mkdir -p "$dir"
cd "$dir"
work=$(mktemp -d .make_certs.XXXXXX) # pairs are made here, then moved in whole
trap 'rm -rf "$work"' EXIT
# A config of our own: neither the system's openssl.cnf nor -addext (1.1.1 duplicates it).
cat >"$work/openssl.cnf" <<'EOF'
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
EOF
ec_key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)

# ssl WHAT ARGS...: run openssl; on failure, one line with its error.
ssl() {
    local what=$1 out
    shift
    if ! out=$(openssl "$@" 2>&1); then
        out=$(printf '%s\n' "$out" | grep -i error | tail -n 1 || true)
        fail "openssl could not make $what: ${out:-no reason given}"
    fi
}

# present NAME: whether the pair NAME.key/NAME.crt is there (half a pair is refused).
present() {
    if [ -e "$1.key" ] && [ -e "$1.crt" ]; then return 0; fi
    if [ -e "$1.key" ] || [ -e "$1.crt" ]; then
        fail "$dir has only one of $1.key and $1.crt: put the other back, or remove both"
    fi
    return 1
}

# sign NAME SAN USAGE: NAME.key and NAME.crt in $work, signed by the CA.
sign() {
    local name=$1 san=$2 usage=$3
    printf 'subjectAltName = %s\nextendedKeyUsage = %s\nbasicConstraints = CA:FALSE\n' \
        "$san" "$usage" >"$work/$name.ext"
    ssl "$name.key" req -new -config "$work/openssl.cnf" "${ec_key[@]}" -subj "/CN=$name" \
        -keyout "$work/$name.key" -out "$work/$name.csr"
    ssl "$name.crt" x509 -req -in "$work/$name.csr" -CA "$ca/ca.crt" -CAkey "$ca/ca.key" \
        -CAserial "$work/serial" -CAcreateserial -days "$days" -extfile "$work/$name.ext" \
        -out "$work/$name.crt"
    made+=("$name")
    echo "made $name.crt ($san)"
}

# Everything is made in $work first and moved in at the end: a failure changes nothing in DIR.
made=() ca=.
if present ca; then
    echo "kept ca.crt"
else
    ca=$work
    ssl ca.key req -x509 -config "$work/openssl.cnf" -extensions ca "${ec_key[@]}" \
        -subj "/CN=diloco-ca" -days "$days" -keyout "$work/ca.key" -out "$work/ca.crt"
    made+=(ca)
    echo "made ca.crt"
fi

if present server; then # a running server keeps its certificate: not replaced
    made_for=$(cat server.san 2>/dev/null || echo unknown)
    [ "$made_for" = "$server_san" ] ||
        fail "server.crt was made for SERVER_SAN '$made_for', not '$server_san': give that, or remove server.* to make it again"
    echo "kept server.crt ($server_san)"
else
    sign server "$server_san" serverAuth
    echo "$server_san" >"$work/server.san"
fi

for learner in "$@"; do
    if present "$learner"; then
        echo "kept $learner.crt"
    else
        sign "$learner" "DNS:$learner" clientAuth
    fi
done

for name in "${made[@]}"; do
    chmod 644 "$work/$name.crt"
    if [ "$name" = server ]; then mv "$work/server.san" server.san; fi
    mv "$work/$name.key" "$name.key"
    mv "$work/$name.crt" "$name.crt"
done
