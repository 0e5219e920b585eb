#!/usr/bin/env bash
# A testbed of hosts on one machine: network namespaces on a bridge, each host with its own NIC
# (a veth pair to the bridge) whose rate tc holds in both directions, so that the network, not
# the machine's memory or cores, bounds what crosses between hosts.
#
#   scripts/testbed.sh run --hosts N [--ranks-per-host R] [--rate RATE] [--host-rate H=RATE]...
#                      [--loss PERCENT] [--port P] [--bin WEIGHTLIFT] -- COMMAND [ARGS...]
#       builds the testbed, runs COMMAND as R ranks on every host through
#       `weightlift launch --nnodes N --node-rank H --master-addr <host 0> -n R`, one launcher
#       per host, and removes everything when they end (also on Ctrl-C or failure). Each
#       host's output is prefixed with "[host H]"; the exit code is the first failing host's.
#   scripts/testbed.sh up --hosts N [--rate RATE] [--host-rate H=RATE]... [--loss PERCENT]
#                     [--name NAME] [--owner PID]
#       builds one and leaves it up for a test to drive (prints its name, hosts and
#       addresses as shell assignments). With --owner it belongs to process PID (a test), and
#       once that process is gone the next up, run or clean removes it; without, it stays until
#       `down NAME`.
#   scripts/testbed.sh exec NAME HOST -- COMMAND [ARGS...]   COMMAND inside host HOST
#   scripts/testbed.sh down NAME                             removes testbed NAME
#   scripts/testbed.sh clean                                 removes every stale testbed
#
# Faults, on a testbed that is up (a test's, or a run's by its --name):
#   scripts/testbed.sh loss NAME HOST PERCENT   drops PERCENT% (0-100, to 0.1) of what host HOST
#                                               sends and, apart, of what it receives, at random
#                                               (nftables' numgen); 0 drops nothing again
#   scripts/testbed.sh drops NAME HOST          packets dropped so far: "SENT RECEIVED"
#   scripts/testbed.sh rate NAME HOST RATE      host HOST's NIC to RATE both ways, from now on
#   scripts/testbed.sh link NAME HOST down|up   cuts host HOST's link at its switch port, or
#                                               restores it
#
# Layout of testbed NAME: namespaces wltb-NAME-h0 .. h<N-1> (the hosts) and wltb-NAME-sw (the
# switch: a bridge br0 and one port p<H> per host). Host H is 10.79.<k>.<H+1>/24 on its eth0,
# k chosen per testbed so that several can stand side by side; loopback is up in every host.
# Addresses exist only inside these namespaces. A rate (tc syntax: 100mbit, 1gbit, 2.5gbit) is
# an htb class on the host's eth0 (what it sends) and on its switch port (what it receives),
# with a bucket of 4 ms of the rate (at least one 64 KiB GSO packet): with tc's default of a
# few KB, a 1 Gbit/s link carried 45-53% of its rate on a kernel of HZ 250 (one TCP stream; 4 ms
# gave 88%, 8 ms 96%; MTU-sized packets instead, gso_max_segs 1, are CPU-bound at 49 MB/s
# there). The price: after an idle moment a link passes up to its bucket at the veth's speed,
# so a message smaller than that is timed on the veth path, not at the rate.
# There is no netem on these machines: latency is what the veth path gives (measure it), loss is
# a random-drop rule of nftables in the host (`loss`), and a cut is its switch port down (`link`).
#
# A host is more than a network namespace: held by one sleeping process, it also has its own
# host name (tb-h<H>), System V IPC, /dev/shm and boot id (a file bound over
# /proc/sys/kernel/random/boot_id). UCX takes the boot id for the machine's identity and offers
# shared memory only between processes that share it, and weightlift's liveness checks key on
# boot id and host name: so the ranks of one host talk through shared memory, as on a real
# machine, and ranks of two hosts only through their NICs, as between machines. Everything run
# on a host (run's launchers, exec's commands) enters those namespaces with nsenter.
#
# Needs root, iproute2 (ip, tc) and util-linux (unshare, nsenter, mount); `loss` needs nftables.
set -euo pipefail

readonly PREFIX=wltb
readonly STATE_DIR=/run/weightlift-testbed
readonly MAX_HOSTS=32          # each host is a namespace, two veth ends and an htb tree
readonly MAX_RANKS_TOTAL=128   # processes of one job on a 2-core machine: already too many

die() {
  echo "testbed: $*" >&2
  exit 2
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# "100mbit" -> "100mbit"; refuses 0, negatives, and what tc would not read as a rate.
check_rate() {
  local flag=$1 rate=$2
  [[ $rate =~ ^([0-9]+([.][0-9]+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$ ]] ||
    die "$flag '$rate': expected a rate as tc writes one, such as 100mbit or 1gbit"
  awk -v v="${BASH_REMATCH[1]}" 'BEGIN { exit !(v > 0) }' ||
    die "$flag '$rate': a rate must be above 0 (a cut link is made with ip link set down)"
}

ns_host() { echo "$PREFIX-$1-h$2"; }
ns_switch() { echo "$PREFIX-$1-sw"; }

# A process as its pid and start time ("1234@5678"), so that a pid the kernel hands out again
# is not taken for the process that had it.
process_identity() {
  local start
  # Field 22 of stat, counted after the command name's ")" (the name may hold spaces).
  start=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}') || return 1
  [[ -n $start ]] && echo "$1@$start"
}

# Whether the owner recorded as `identity` is gone: "none" never is (`up` without --owner).
owner_gone() {
  local identity=$1
  [[ $identity == none ]] && return 1
  [[ $identity =~ ^([0-9]+)@ ]] || return 0
  gone "${BASH_REMATCH[1]}" && return 0
  [[ $(process_identity "${BASH_REMATCH[1]}") != "$identity" ]]
}

# The testbeds whose owner is gone: their state file names a process that has ended, or
# their namespaces outlived their state file.
stale_names() {
  local f name owner
  if [[ -d $STATE_DIR ]]; then
    for f in "$STATE_DIR"/*.env; do
      [[ -e $f ]] || continue
      name=$(basename "$f" .env)
      owner=$(sed -n 's/^TESTBED_OWNER=//p' "$f")
      if owner_gone "$owner"; then echo "$name"; fi
    done
  fi
  ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^$PREFIX-\(.*\)-sw\$/\1/p" |
    while read -r name; do [[ -e $STATE_DIR/$name.env ]] || echo "$name"; done
}

# Whether process `pid` is gone (a zombie counts: it holds no namespace).
gone() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 0
  [[ -z $state || $state == Z ]]
}

# Waits until process `pid` is gone, 5 s at most.
wait_gone() {
  local i
  for ((i = 0; i < 50; ++i)); do
    gone "$1" && return 0
    sleep 0.1
  done
}

down() {
  local name=$1 ns pid i
  local -a pids=()
  rm -f "$STATE_DIR/$name".h*.boot_id
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-$name-(h[0-9]+|sw)\$"); do
    # What runs inside (the hosts' holders, ranks of a killed run) goes first: it would keep
    # the namespace's devices alive, and outlive it. Again until none is left, since a
    # launcher killed while starting a rank may have forked it a moment before (5 s at most).
    for ((i = 0; i < 50; ++i)); do
      local inside
      inside=$(ip netns pids "$ns" 2>/dev/null || true)
      [[ -n $inside ]] || break
      for pid in $inside; do
        kill -9 "$pid" 2>/dev/null || true
        pids+=("$pid")
      done
      sleep 0.1
    done
    ip netns del "$ns" 2>/dev/null || true  # removes its veth ends, and their peers with them
  done
  for pid in "${pids[@]}"; do wait_gone "$pid"; done
  rm -f "$STATE_DIR/$name.env"
}

clean() {
  local name
  for name in $(stale_names | sort -u); do
    echo "testbed: removing stale testbed $name" >&2
    down "$name"
  done
}

# The third octet of a new testbed's subnet: one no other testbed here uses.
free_subnet() {
  local used k
  used=$(cat "$STATE_DIR"/*.env 2>/dev/null | sed -n 's/^TESTBED_SUBNET=//p' || true)
  for k in $(seq 1 250); do
    grep -qx "$k" <<<"$used" || { echo "$k"; return; }
  done
  die "every testbed subnet of 10.79.0.0/16 is in use"
}

# The htb class parameters of a link of `rate` (see the top for the bucket).
htb_class() {
  local rate=$1 bucket
  bucket=$(awk -v r="$rate" 'BEGIN {
    match(r, /^[0-9.]+/); v = substr(r, 1, RLENGTH); u = substr(r, RLENGTH + 1)
    m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
    m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9; m["tbps"] = 8e12
    b = v * m[u] / 8 * 0.004; if (b < 65536) b = 65536; printf "%d", b }')
  echo "htb rate $rate ceil $rate burst $bucket cburst $bucket"
}

# htb holding `dev` in namespace `ns` to `rate` (every packet in one class).
limit() {
  local ns=$1 dev=$2 rate=$3
  tc -n "$ns" qdisc add dev "$dev" root handle 1: htb default 1 r2q 1000
  # shellcheck disable=SC2046  # htb_class's words are tc's arguments
  tc -n "$ns" class add dev "$dev" parent 1: classid 1:1 $(htb_class "$rate")
}

# claim NAME OWNER: makes testbed NAME's state file, with its owner, or stops if a testbed has
# the name (noclobber: two starts with one name cannot both get it). Before any trap that would
# remove NAME.
claim() {
  mkdir -p "$STATE_DIR"
  (set -o noclobber && echo "TESTBED_OWNER=$2" >"$STATE_DIR/$1.env") 2>/dev/null ||
    die "a testbed named $1 is up already (scripts/testbed.sh down $1 removes it)"
}

# up NAME HOSTS OWNER RATE_OF... : builds the claimed testbed NAME (RATE_OF[h] empty: unlimited).
up() {
  local name=$1 hosts=$2
  shift 3
  local -a rate_of=("$@")
  local subnet sw h ns
  subnet=$(free_subnet)
  # The state file (claimed) first: a testbed cut short while being built is found by it and
  # removed.
  {
    echo "TESTBED_NAME=$name"
    echo "TESTBED_SUBNET=$subnet"
  } >>"$STATE_DIR/$name.env"
  sw=$(ns_switch "$name")
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  local addrs="" namespaces="" holders=""
  for ((h = 0; h < hosts; ++h)); do
    ns=$(ns_host "$name" "$h")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "p$h" netns "$sw"
    ip -n "$ns" addr add "10.79.$subnet.$((h + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$sw" link set "p$h" master br0
    ip -n "$sw" link set "p$h" up
    if [[ -n ${rate_of[h]:-} ]]; then
      limit "$ns" eth0 "${rate_of[h]}"
      limit "$sw" "p$h" "${rate_of[h]}"
    fi
    holders+="${holders:+ }$(hold_host "$name" "$h")"
    addrs+="${addrs:+ }10.79.$subnet.$((h + 1))"
    namespaces+="${namespaces:+ }$ns"
  done
  {
    echo "TESTBED_HOSTS=\"$namespaces\""
    echo "TESTBED_ADDRS=\"$addrs\""
    echo "TESTBED_RATES=\"${rate_of[*]:-}\""
    echo "TESTBED_HOLDERS=\"$holders\""
  } >>"$STATE_DIR/$name.env"
}

# Starts the process that holds host h's namespaces (network, host name, IPC, mounts with
# their own /dev/shm and boot id) and prints its pid once they are in place.
hold_host() {
  local name=$1 h=$2 boot
  boot=$STATE_DIR/$name.h$h.boot_id
  cat /proc/sys/kernel/random/uuid >"$boot"
  setsid ip netns exec "$(ns_host "$name" "$h")" unshare --uts --ipc --mount --propagation private \
    sh -c 'hostname "$0" && mount -t tmpfs tmpfs /dev/shm &&
           mount --bind "$1" /proc/sys/kernel/random/boot_id && exec sleep infinity' \
    "tb-h$h" "$boot" </dev/null >/dev/null 2>&1 &
  local pid=$! i
  for ((i = 0; i < 100; ++i)); do  # until its boot id is the host's (10 s at most)
    if [[ $(nsenter -t "$pid" --mount cat /proc/sys/kernel/random/boot_id 2>/dev/null) == \
          "$(cat "$boot")" ]]; then
      echo "$pid"
      return
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  die "host $h of testbed $name did not come up"
}

# Becomes COMMAND inside host h of testbed NAME (exec: call it in a subshell to come back).
host_exec() {
  local name=$1 h=$2 holder
  shift 2
  holder=$(sed -n 's/^TESTBED_HOLDERS="\(.*\)"$/\1/p' "$STATE_DIR/$name.env" | cut -d' ' -f$((h + 1)))
  [[ -n $holder ]] || die "testbed $name has no host $h"
  exec nsenter -t "$holder" --net --uts --ipc --mount --wd="$PWD" -- "$@"
}

# Options shared by up and run.
HOSTS=0 RANKS=1 RATE="" LOSS=0 PORT=29600 NAME="" OWNER="" BIN=""
declare -A HOST_RATE=()
parse_options() {
  while (($#)); do
    case $1 in
      --hosts) HOSTS=${2:?}; shift 2 ;;
      --ranks-per-host) RANKS=${2:?}; shift 2 ;;
      --rate) check_rate --rate "${2:?}"; RATE=$2; shift 2 ;;
      --host-rate)
        [[ ${2:-} =~ ^([0-9]+)=(.+)$ ]] || die "--host-rate '${2:-}': expected HOST=RATE, such as 1=100mbit"
        local host=$((10#${BASH_REMATCH[1]})) rate=${BASH_REMATCH[2]}
        check_rate --host-rate "$rate"
        HOST_RATE[$host]=$rate
        shift 2 ;;
      --loss) LOSS=$(permille_of --loss "${2:?}"); shift 2 ;;
      --port) PORT=${2:?}; shift 2 ;;
      --name) NAME=${2:?}; shift 2 ;;
      --owner) OWNER=${2:?}; shift 2 ;;
      --bin) BIN=${2:?}; shift 2 ;;
      --) shift; COMMAND=("$@"); return ;;
      -h | --help) usage ;;
      *) die "unknown option '$1' (see scripts/testbed.sh --help)" ;;
    esac
  done
  COMMAND=()
}

check_options() {
  [[ $HOSTS =~ ^[0-9]+$ ]] && ((HOSTS >= 2)) || die "--hosts '$HOSTS': a testbed has at least 2 hosts"
  ((HOSTS <= MAX_HOSTS)) ||
    die "--hosts $HOSTS: this machine holds at most $MAX_HOSTS hosts (namespaces with a shaped NIC each)"
  [[ $RANKS =~ ^[0-9]+$ ]] && ((RANKS >= 1)) || die "--ranks-per-host '$RANKS': expected at least 1"
  ((HOSTS * RANKS <= MAX_RANKS_TOTAL)) ||
    die "--hosts $HOSTS x --ranks-per-host $RANKS: $((HOSTS * RANKS)) processes, more than the $MAX_RANKS_TOTAL this machine can run"
  [[ $PORT =~ ^[0-9]+$ ]] && ((PORT >= 1024 && PORT <= 65535)) || die "--port '$PORT': expected 1024-65535"
  local h
  for h in "${!HOST_RATE[@]}"; do
    ((h < HOSTS)) || die "--host-rate $h=${HOST_RATE[$h]}: there is no host $h of $HOSTS"
  done
  [[ -z $NAME || $NAME =~ ^[a-z0-9]{1,12}$ ]] || die "--name '$NAME': expected 1-12 lowercase letters or digits"
  [[ -z $OWNER || $OWNER =~ ^[0-9]+$ ]] || die "--owner '$OWNER': expected a process id"
  ((LOSS == 0)) || command -v nft >/dev/null ||
    die "--loss needs nftables (nft); scripts/setup.sh installs it"
}

need_root() {
  ((EUID == 0)) || die "needs root (ip netns, tc)"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
  command -v unshare >/dev/null && command -v nsenter >/dev/null ||
    die "needs util-linux (unshare, nsenter)"
}

rates() {
  local h
  for ((h = 0; h < HOSTS; ++h)); do echo "${HOST_RATE[$h]:-$RATE}"; done
}

# --loss: every host's NIC drops that share of what it sends and of what it receives.
every_host_loses() {
  local h
  ((LOSS > 0)) || return 0
  for ((h = 0; h < HOSTS; ++h)); do set_loss "$1" "$h" "$LOSS"; done
}

cmd_up() {
  parse_options "$@"
  check_options
  need_root
  clean
  NAME=${NAME:-$$}
  local owner=none
  if [[ -n $OWNER ]]; then
    owner=$(process_identity "$OWNER") || die "--owner $OWNER: no such process"
  fi
  mapfile -t rate_of < <(rates)
  claim "$NAME" "$owner"
  # Whatever step fails ends the script (set -e), and the trap removes what was built.
  # shellcheck disable=SC2064  # the name is fixed now
  trap "down '$NAME'" EXIT
  up "$NAME" "$HOSTS" "$owner" "${rate_of[@]}"
  every_host_loses "$NAME"
  trap - EXIT
  cat "$STATE_DIR/$NAME.env"
}

# The launchers of `run`, asked to stop, then waited for.
LAUNCHERS=()
stop_launchers() {
  local pid
  for pid in "${LAUNCHERS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${LAUNCHERS[@]}"; do wait_gone "$pid"; done
}

cmd_run() {
  parse_options "$@"
  check_options
  ((${#COMMAND[@]})) || die "run needs a command after --"
  need_root
  BIN=${BIN:-$(dirname "$0")/../build/release/apps/weightlift}
  [[ -x $BIN ]] || die "no weightlift binary at $BIN; build it, or give --bin"
  BIN=$(realpath "$BIN")
  [[ -z $OWNER ]] || die "--owner is for up: a run's testbed belongs to the run"
  clean
  NAME=${NAME:-$$}
  local owner
  owner=$(process_identity $$)
  claim "$NAME" "$owner"
  # On the way out the launchers get SIGTERM first, and 5 s to stop their ranks as they do on
  # Ctrl-C (a rank may have shared memory or files to remove); then whatever is left goes.
  # shellcheck disable=SC2064  # the names are fixed now
  trap "stop_launchers; down '$NAME'" EXIT
  trap 'exit 130' INT TERM
  mapfile -t rate_of < <(rates)
  up "$NAME" "$HOSTS" "$owner" "${rate_of[@]}"
  every_host_loses "$NAME"
  local master subnet token h
  subnet=$(sed -n 's/^TESTBED_SUBNET=//p' "$STATE_DIR/$NAME.env")
  master=10.79.$subnet.1
  token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
  echo "testbed $NAME: $HOSTS hosts x $RANKS ranks, NIC ${RATE:-unlimited}$(
    for h in "${!HOST_RATE[@]}"; do printf ', host %s %s' "$h" "${HOST_RATE[$h]}"; done
    ((LOSS == 0)) || printf ', %d.%d%% loss each way' $((LOSS / 10)) $((LOSS % 10))
  ); master $master:$PORT" >&2
  for ((h = 0; h < HOSTS; ++h)); do
    host_exec "$NAME" "$h" env WEIGHTLIFT_JOB_TOKEN="$token" TESTBED_HOST="$h" \
      "$BIN" launch --nnodes "$HOSTS" --node-rank "$h" --master-addr "$master" \
      --master-port "$PORT" -n "$RANKS" -- "${COMMAND[@]}" \
      > >(sed -u "s/^/[host $h] /") 2>&1 &
    LAUNCHERS+=($!)
  done
  local rc=0 code
  for h in "${!LAUNCHERS[@]}"; do
    code=0
    wait "${LAUNCHERS[$h]}" || code=$?
    if ((code != 0 && rc == 0)); then rc=$code; fi
  done
  LAUNCHERS=()  # all waited for: their pids may belong to others now
  exit "$rc"
}

# The namespace of host h of testbed NAME that is up, or stops saying why not.
fault_host() {
  local name=$1 h=$2 hosts
  [[ -e $STATE_DIR/$name.env ]] || die "no testbed named $name"
  hosts=$(sed -n 's/^TESTBED_HOSTS="\(.*\)"$/\1/p' "$STATE_DIR/$name.env" | wc -w)
  [[ $h =~ ^(0|[1-9][0-9]*)$ ]] && ((h < hosts)) || die "testbed $name has no host '$h' (it has $hosts)"
  ns_host "$name" "$h"
}

# "2.5" -> 25 (per mille), or stops: a percentage from 0 to 100, to 0.1.
permille_of() {
  local flag=$1 percent=$2
  [[ $percent =~ ^([0-9]{1,3})([.]([0-9]))?$ ]] ||
    die "$flag '$percent': expected a percentage such as 2 or 0.5"
  local permille=$((10 * 10#${BASH_REMATCH[1]} + 10#${BASH_REMATCH[3]:-0}))
  ((permille <= 1000)) || die "$flag '$percent': a percentage is at most 100"
  echo "$permille"
}

# set_loss NAME HOST PERMILLE: a table of its own in the host, replaced whole at each call.
set_loss() {
  local name=$1 h=$2 permille=$3 ns segs=65535
  ns=$(ns_host "$name" "$h")
  if ! command -v nft >/dev/null; then
    ((permille == 0)) && return 0  # no nft: no rule was ever set
    die "loss needs nftables (nft); scripts/setup.sh installs it"
  fi
  ip netns exec "$ns" nft delete table inet wltb_loss 2>/dev/null || true
  # A veth passes TCP's segmentation offload on whole (up to 64 KB a packet), so a rule would
  # drop dozens of segments at once. Cut into MTU-sized packets at the host's NIC (what it
  # sends) and its switch port (what it receives), each packet is one segment, as on a wire;
  # it costs CPU, so only while the loss is on.
  ((permille == 0)) || segs=1
  ip -n "$ns" link set dev eth0 gso_max_segs "$segs"
  ip -n "$(ns_switch "$name")" link set dev "p$h" gso_max_segs "$segs"
  ((permille > 0)) || return 0
  ip netns exec "$ns" nft -f - <<EOF
table inet wltb_loss {
  chain sent {
    type filter hook output priority 0; policy accept;
    oifname "eth0" numgen random mod 1000 < $permille counter drop
  }
  chain received {
    type filter hook input priority 0; policy accept;
    iifname "eth0" numgen random mod 1000 < $permille counter drop
  }
}
EOF
}

# loss NAME HOST PERCENT
cmd_loss() {
  local permille
  fault_host "$1" "$2" >/dev/null
  permille=$(permille_of loss "$3")
  set_loss "$1" "$2" "$permille"
}

# drops NAME HOST: "SENT RECEIVED", the packets the loss rules dropped (0 0 without them).
cmd_drops() {
  local ns chain n out=""
  ns=$(fault_host "$1" "$2")
  for chain in sent received; do
    n=$({ ip netns exec "$ns" nft list chain inet wltb_loss "$chain" 2>/dev/null || true; } |
      sed -n 's/.*counter packets \([0-9]*\).*/\1/p')
    out+="${out:+ }${n:-0}"
  done
  echo "$out"
}

# rate NAME HOST RATE: the host's class both ways (a new one on a testbed without a rate).
cmd_rate() {
  local name=$1 h=$2 rate=$3 ns dev
  ns=$(fault_host "$name" "$h")
  check_rate rate "$rate"
  for dev in "$ns eth0" "$(ns_switch "$name") p$h"; do
    read -r ns dev <<<"$dev"
    if [[ -n $(tc -n "$ns" class show dev "$dev" classid 1:1) ]]; then
      # shellcheck disable=SC2046
      tc -n "$ns" class change dev "$dev" parent 1: classid 1:1 $(htb_class "$rate")
    else
      limit "$ns" "$dev" "$rate"
    fi
  done
}

# link NAME HOST down|up
cmd_link() {
  fault_host "$1" "$2" >/dev/null
  [[ $3 == down || $3 == up ]] || die "link '$3': expected down or up"
  ip -n "$(ns_switch "$1")" link set "p$2" "$3"
}

fault() {
  local cmd=$1 what=$2
  shift 2
  local want=3
  [[ $cmd != drops ]] || want=2
  (($# == want)) || die "usage: testbed.sh $cmd NAME HOST${what:+ $what}"
  need_root
  "cmd_$cmd" "$@"
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  run) shift; cmd_run "$@" ;;
  exec)
    [[ $# -ge 4 && $4 == -- ]] || die "usage: testbed.sh exec NAME HOST -- COMMAND"
    need_root
    [[ -e $STATE_DIR/$2.env ]] || die "no testbed named $2"
    name=$2 h=$3
    shift 4
    host_exec "$name" "$h" "$@" ;;
  down)
    [[ $# -eq 2 ]] || die "usage: testbed.sh down NAME"
    need_root
    down "$2" ;;
  clean) need_root; clean ;;
  loss) shift; fault loss PERCENT "$@" ;;
  drops) shift; fault drops "" "$@" ;;
  rate) shift; fault rate RATE "$@" ;;
  link) shift; fault link "down|up" "$@" ;;
  -h | --help | "") usage ;;
  *) die "unknown command '$1': up, run, exec, down, clean, loss, drops, rate or link" ;;
esac
