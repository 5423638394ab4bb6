#!/bin/sh
# Prints the three Secrets the manifests expect, with fresh tokens:
#   kvbroker-registry     token (the shared admin token; the replicas forward with it),
#                         credentials (the registry's --credentials file: digests only)
#   kvbroker-router       token (role router)
#   kvbroker-node-tokens  one token per node id, holder node:NODE_ID:ROLE (the role it
#                         may register as: prefill or decode)
# Node ids are the engine pods' names: kvbroker-prefill-0.. and kvbroker-decode-0...
# Issue as many as the StatefulSets may ever scale to: a node without a credential cannot
# register, and the registry reads its credentials file when it starts.
#
# Usage: make-secrets.sh PREFILL_NODES DECODE_NODES [NAMESPACE] | kubectl apply -f -
# Needs `kvbroker` (pip install kvbroker) and `kubectl` on the PATH.
set -eu
prefill=${1:?number of prefill nodes}
decode=${2:?number of decode nodes}
namespace=${3:-}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/nodes"

# issue WHO FILE: a fresh token for WHO into FILE, its digest line into the credentials.
issue() {
    out=$(kvbroker registry credential "$1")
    printf '%s\n' "$out" | sed -n 's/^token: //p' | tr -d '\n' > "$2"
    printf '%s\n' "$out" | sed -n 's/^line: *//p' >> "$dir/credentials"
}

: > "$dir/credentials"
issue admin "$dir/admin"
issue router "$dir/router"
i=0
while [ "$i" -lt "$prefill" ]; do
    issue "node:kvbroker-prefill-$i:prefill" "$dir/nodes/kvbroker-prefill-$i"
    i=$((i + 1))
done
i=0
while [ "$i" -lt "$decode" ]; do
    issue "node:kvbroker-decode-$i:decode" "$dir/nodes/kvbroker-decode-$i"
    i=$((i + 1))
done

secret() {
    kubectl create secret generic "$@" ${namespace:+--namespace "$namespace"} \
        --dry-run=client -o yaml
}
secret kvbroker-registry --from-file=token="$dir/admin" \
    --from-file=credentials="$dir/credentials"
echo ---
secret kvbroker-router --from-file=token="$dir/router"
echo ---
secret kvbroker-node-tokens --from-file="$dir/nodes"
