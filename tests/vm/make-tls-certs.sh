#!/bin/sh
# Makes throwaway X.509 certificates for the TLS tests of nbds:// devices, in DIR:
#   DIR/server/  ca-cert.pem server-cert.pem server-key.pem   (nbdkit --tls-certificates=)
#   DIR/client/  ca-cert.pem client-cert.pem client-key.pem   (ublkd's tls-certificates=)
#   DIR/other/   ca-cert.pem of an unrelated authority        (a client that must refuse)
# The server's certificate names localhost and 127.0.0.1; all expire in two days.
# Usage: make-tls-certs.sh DIR
set -eu
[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
dir=$1
mkdir -p "$dir/server" "$dir/client" "$dir/other"
cd "$dir"
curve="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"

# An authority: self-signed, allowed to sign certificates only.
authority() { # NAME OUT-DIR
  # shellcheck disable=SC2086  # $curve is several arguments
  openssl req -x509 $curve -days 2 -subj "/CN=$1" -keyout "$2/ca-key.pem" \
    -out "$2/ca-cert.pem" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

# A leaf certificate signed by the authority in server/: NAME OUT-PREFIX EXTENSIONS.
leaf() {
  printf '%s\n' "$3" >"$2.ext"
  # shellcheck disable=SC2086
  openssl req $curve -subj "/CN=$1" -keyout "$2-key.pem" -out "$2.csr" 2>/dev/null
  openssl x509 -req -in "$2.csr" -CA server/ca-cert.pem -CAkey server/ca-key.pem \
    -CAcreateserial -days 2 -extfile "$2.ext" -out "$2-cert.pem" 2>/dev/null
  rm -f "$2.csr" "$2.ext"
}

authority "ublkd test CA" server
authority "some other CA" other
cp server/ca-cert.pem client/ca-cert.pem
leaf localhost server/server "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,IP:127.0.0.1"
leaf "ublkd client" client/client "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
rm -f server/ca-key.pem other/ca-key.pem server/ca-cert.srl ca-cert.srl
chmod 600 server/server-key.pem client/client-key.pem
