#!/usr/bin/env bash
# The demo's body: runs where /dev/ublk-control exists (the host or the test VM).
set -euo pipefail
echo "== kernel: $(uname -r)"
echo "== ublkd --check-kernel"
ublkd --check-kernel
echo "== ublkctl features"
ublkctl features | paste -sd' '
echo "== summary"
echo "kernel $(uname -r): ublk control plane reachable, features $(ublkctl features --json | sed 's/.*"mask":"\([^"]*\)".*/\1/')"
echo "serving a device, I/O, worker kill and recovery: not built yet (end-to-end data path issue)"
