#!/usr/bin/env bash
# Collectives between two "hosts": two network namespaces joined by a veth pair, UCX on TCP.
#
#   sudo scripts/netns_collectives.sh [BUILD_DIR] [weightlift bench collectives options...]
#   scripts/netns_collectives.sh build/release --ops allreduce --max-bytes 64M --factor 4
#
# Rank 0 runs in namespace wlns0 (10.77.0.1), rank 1 in wlns1 (10.77.0.2). Each sees only its
# end of the veth pair (and its own loopback), so every byte between the ranks goes through
# the kernel's TCP stack and the veth link, as between two machines: UCX_TLS=tcp, the
# rendezvous store bound to rank 0's veth address (MASTER_ADDR), and the ring algorithms
# (shared memory is not offered on TCP, so kAuto falls back to the message-passing paths).
# Needs root (ip netns) and iproute2. The namespaces and the veth pair are removed on exit,
# also on Ctrl-C or failure. Prints rank 0's table (or JSON with --json); exits with the
# first failing rank's code.
set -euo pipefail

BUILD=${1:-build/release}
[[ $# -gt 0 ]] && shift
BIN="$BUILD/apps/weightlift"
[[ -x "$BIN" ]] || { echo "no $BIN; build the weightlift target first" >&2; exit 2; }
BIN=$(realpath "$BIN")

NS0=wlns0_$$ NS1=wlns1_$$
V0=wlv0_$$ V1=wlv1_$$
ADDR0=10.77.0.1 ADDR1=10.77.0.2
PORT=29517
TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
OUT=$(mktemp -d)

cleanup() {
  local pids
  pids=$(jobs -p) && [[ -n "$pids" ]] && kill $pids 2>/dev/null || true
  ip netns del "$NS0" 2>/dev/null || true
  ip netns del "$NS1" 2>/dev/null || true  # deleting a namespace removes its veth end too
  rm -rf "$OUT"
}
trap cleanup EXIT INT TERM

ip netns add "$NS0"
ip netns add "$NS1"
ip link add "$V0" type veth peer name "$V1"
ip link set "$V0" netns "$NS0"
ip link set "$V1" netns "$NS1"
ip -n "$NS0" addr add "$ADDR0/24" dev "$V0"
ip -n "$NS1" addr add "$ADDR1/24" dev "$V1"
for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
ip -n "$NS0" link set "$V0" up
ip -n "$NS1" link set "$V1" up

run_rank() {  # rank namespace device
  ip netns exec "$2" env RANK="$1" WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR="$ADDR0" \
    MASTER_PORT="$PORT" WEIGHTLIFT_JOB_TOKEN="$TOKEN" UCX_TLS=tcp UCX_NET_DEVICES="$3" \
    timeout 600 "$BIN" bench collectives --bind-address "$ADDR0" "${@:4}"
}

echo "# netns: rank 0 in $NS0 ($ADDR0, $V0), rank 1 in $NS1 ($ADDR1, $V1), UCX_TLS=tcp"
run_rank 0 "$NS0" "$V0" "$@" >"$OUT/rank0" 2>&1 &
P0=$!
run_rank 1 "$NS1" "$V1" "$@" >"$OUT/rank1" 2>&1 &
P1=$!
rc0=0 rc1=0
wait "$P0" || rc0=$?
wait "$P1" || rc1=$?
cat "$OUT/rank0"
if [[ -s "$OUT/rank1" ]]; then sed 's/^/[rank 1] /' "$OUT/rank1" >&2; fi
if (( rc0 != 0 )); then exit "$rc0"; fi
exit "$rc1"
