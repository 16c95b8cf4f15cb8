#!/usr/bin/env bash
# Shape ONE interface with tc: a rate limit (tbf), plus delay/loss through netem when the kernel
# has it (it says so clearly when it does not; the application shaper can add latency instead:
# network_profile.latency_ms). Never touches any interface it was not named.
#
#   setup_netem.sh --netns NS [--dev DEV] --rate-mbit R [--delay-ms D] [--loss-pct L]
#   setup_netem.sh --dev DEV --rate-mbit R [--delay-ms D] [--loss-pct L]
#
# With --netns and no --dev, the namespace's first non-loopback interface is shaped (its lo if
# it has nothing else). Outside a namespace, --dev lo is refused: it would slow the whole host.
set -euo pipefail

netns="" dev="" rate="" delay=0 loss=0
die() { echo "setup_netem: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --netns) netns="${2:?}"; shift 2 ;;
    --dev) dev="${2:?}"; shift 2 ;;
    --rate-mbit) rate="${2:?}"; shift 2 ;;
    --delay-ms) delay="${2:?}"; shift 2 ;;
    --loss-pct) loss="${2:?}"; shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ -n "$rate" ]] || die "--rate-mbit is required"
[[ -n "$netns" || -n "$dev" ]] || die "name a --netns or a --dev; refusing to guess an interface"
[[ "$rate" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--rate-mbit must be a number, got $rate"
[[ "$delay" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--delay-ms must be a number, got $delay"
[[ "$loss" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--loss-pct must be a number, got $loss"
command -v tc >/dev/null || die "tc not found (Debian: apt-get install iproute2)"

run() { if [[ -n "$netns" ]]; then ip netns exec "$netns" "$@"; else "$@"; fi; }

if [[ -n "$netns" ]]; then
  ip netns list | grep -qw -- "$netns" || die "no network namespace named $netns"
  if [[ -z "$dev" ]]; then
    dev=$(ip -n "$netns" -o link show | awk -F': ' '$2 !~ /^lo(@|$)/ {split($2, a, "@"); print a[1]; exit}')
    dev=${dev:-lo}
  fi
elif [[ "$dev" == "lo" ]]; then
  die "refusing to shape the host's loopback; use a network namespace (--netns)"
fi
run ip link show "$dev" >/dev/null 2>&1 || die "no interface $dev${netns:+ in namespace $netns}"

# 64 KiB burst: tbf on loopback-sized MTUs needs at least that (see shared/anchors.md).
tbf=(tbf rate "${rate}mbit" burst 64kb latency 400ms)
run tc qdisc del dev "$dev" root 2>/dev/null || true
is_zero() { [[ "$1" =~ ^0+([.]0+)?$ ]]; }
if ! is_zero "$delay" || ! is_zero "$loss"; then
  if run tc qdisc add dev "$dev" root handle 1: netem delay "${delay}ms" loss "${loss}%" 2>/dev/null; then
    run tc qdisc add dev "$dev" parent 1:1 handle 10: "${tbf[@]}"
    echo "setup_netem: $dev${netns:+ ($netns)}: ${rate} Mbit/s, ${delay} ms delay, ${loss}% loss"
    exit 0
  fi
  echo "setup_netem: netem is not available in this kernel: delay/loss NOT applied by tc" \
       "(the application shaper adds latency: network_profile.latency_ms); applying the rate only" >&2
fi
run tc qdisc add dev "$dev" root "${tbf[@]}"
echo "setup_netem: $dev${netns:+ ($netns)}: ${rate} Mbit/s"
