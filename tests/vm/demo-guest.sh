#!/usr/bin/env bash
# The demo's body: runs where /dev/ublk-control exists (this machine or the test VM).
# ublkd serves a memory-backed device, fio writes and verifies data on it, a worker is
# killed halfway, ublkd recovers the device by itself, and a summary is printed.
set -euo pipefail
work=$(mktemp -d /tmp/ublkd-demo.XXXXXX)
sock=/run/ublkd-demo/ublkd.sock
cat >"$work/ublkd.toml" <<TOML
[daemon]
socket = "$sock"
state_dir = "/run/ublkd-demo"
TOML
say() { printf '\n== %s\n' "$*"; }
field() { sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p" | tr -d '"'; }

say "kernel $(uname -r); ublk features: $(ublkctl features | paste -sd' ')"
UBLKD_LOG=info ublkd --config "$work/ublkd.toml" 2>"$work/ublkd.log" &
ublkd_pid=$!
cleanup() {
  kill "$ublkd_pid" 2>/dev/null && wait "$ublkd_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
for _ in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done

say "ublkctl add -t memory -s 256M"
id=$(ublkctl --socket "$sock" add -t memory -s 256M)
id=${id#/dev/ublkb}
ublkctl --socket "$sock" list -n "$id"

say "fio: random 4k-16k writes and reads with crc32c verification, 10 s"
fio --eta=never --name=demo --filename="/dev/ublkb$id" --rw=randrw --bsrange=4k-16k \
  --iodepth=32 --ioengine=io_uring --direct=1 --size=64M --time_based --runtime=10 \
  --verify=crc32c --verify_fatal=1 --verify_state_save=0 --output-format=json \
  --output="$work/fio.json" &
fio_pid=$!
sleep 3
before=$(ublkctl --socket "$sock" status -n "$id" --json)
worker=$(echo "$before" | field worker_pid)
say "kill -9 worker $worker (ios so far: $(echo "$before" | field ios))"
kill -9 "$worker"
for _ in $(seq 100); do
  now=$(ublkctl --socket "$sock" status -n "$id" --json)
  [ "$(echo "$now" | field recoveries)" -ge 1 ] && break
  sleep 0.1
done
ublkctl --socket "$sock" status -n "$id"
wait "$fio_pid" && fio_rc=0 || fio_rc=$?
after=$(ublkctl --socket "$sock" status -n "$id" --json)
fio_errors=$(python3 -c "import json; print(sum(j['error'] for j in json.load(open('$work/fio.json'))['jobs']))")
read_iops=$(python3 -c "import json; print(int(sum(j['read']['iops'] for j in json.load(open('$work/fio.json'))['jobs'])))")
write_iops=$(python3 -c "import json; print(int(sum(j['write']['iops'] for j in json.load(open('$work/fio.json'))['jobs'])))")
ublkctl --socket "$sock" del -n "$id" 2>/dev/null

say "summary"
echo "device:        /dev/ublkb$id, memory, 256 MiB, served by ublkd-worker (pid $(echo "$after" | field worker_pid) after the kill)"
echo "I/O:           $(echo "$after" | field ios) requests (fio: $read_iops read + $write_iops write IOPS), $(echo "$after" | field errors) errors"
echo "worker killed: pid $worker, SIGKILL, mid-I/O"
echo "recovery:      $(echo "$after" | field recoveries) recovery, stall $(echo "$after" | field last_recovery_ms) ms (death detected to LIVE), reason: $(echo "$after" | field last_recovery_reason)"
echo "fio:           exit $fio_rc, $fio_errors I/O errors, crc32c verify $([ "$fio_rc" = 0 ] && [ "$fio_errors" = 0 ] && echo passed || echo FAILED)"
[ "$fio_rc" = 0 ] && [ "$fio_errors" = 0 ] && [ "$(echo "$after" | field recoveries)" -ge 1 ]
