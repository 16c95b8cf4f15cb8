#!/usr/bin/env bash
# Undo setup_netem.sh on the same interface: remove its root qdisc. Safe to run twice.
#   cleanup_netem.sh --netns NS [--dev DEV] | --dev DEV
set -euo pipefail

netns="" dev=""
die() { echo "cleanup_netem: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --netns) netns="${2:?}"; shift 2 ;;
    --dev) dev="${2:?}"; shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ -n "$netns" || -n "$dev" ]] || die "name a --netns or a --dev"
run() { if [[ -n "$netns" ]]; then ip netns exec "$netns" "$@"; else "$@"; fi; }
if [[ -n "$netns" && -z "$dev" ]]; then
  ip netns list | grep -qw -- "$netns" || { echo "cleanup_netem: namespace $netns is gone"; exit 0; }
  dev=$(ip -n "$netns" -o link show | awk -F': ' '$2 !~ /^lo(@|$)/ {split($2, a, "@"); print a[1]; exit}')
  dev=${dev:-lo}
elif [[ -z "$netns" && "$dev" == "lo" ]]; then
  die "refusing to touch the host's loopback"
fi
if run tc qdisc show dev "$dev" 2>/dev/null | grep -qE 'qdisc (tbf|netem) [0-9a-f]+: root'; then
  run tc qdisc del dev "$dev" root
  echo "cleanup_netem: $dev${netns:+ ($netns)}: shaping removed"
else
  echo "cleanup_netem: $dev${netns:+ ($netns)}: nothing to remove"
fi
