#!/bin/bash
# ceph-single-node.sh - a throw-away single-node Ceph (1 mon, 1 OSD, no mgr, cephx) for
# the rbd tests (tests/src/harness/ceph.rs starts it inside the test VM; it runs the same
# on a Debian 12 host with ceph-mon, ceph-osd and ceph-common installed).
# Usage: ceph-single-node.sh start|stop
#   start: wipes $CEPH_DIR, creates and starts mon.a + osd.0, pool "rbd" (rbd-initialised)
#          client.rbdtest (keyring $CEPH_DIR/client.rbdtest.keyring) and ublkd's default
#          client.ublkd (keyring $CEPH_DIR/client.ublkd.keyring); returns once a
#          write to the pool has succeeded. Prints each step's time since the start.
#   stop:  SIGTERM (then SIGKILL) both daemons.
# Env:   CEPH_DIR      (default /tmp/ceph)   everything lives here
#        CEPH_IP       (default 127.0.0.1)   address the daemons bind to
#        CEPH_STORE    (default bluestore)   bluestore | memstore (memstore is lost on kill -9)
#        CEPH_OSD_SIZE (default 10G)         sparse block file / memstore capacity
#        CEPH_CONF_EXTRA                     text appended to ceph.conf (with [section] lines)
# Clients: export CEPH_CONF=$CEPH_DIR/ceph.conf; then e.g. rbd --id rbdtest ...
#          (client.admin is the default id; its keyring is $CEPH_DIR/client.admin.keyring)
# Restart one daemon (CEPH_CONF exported): `ceph-osd -i 0` or `ceph-mon -i a`; each forks
# into the background and writes $CEPH_DIR/run/<name>.pid. Logs: $CEPH_DIR/log/.
# Needs: ceph-mon, ceph-osd, ceph-common (python3-rados and python3-rbd come with it).
# Pitfalls met in the VM (each fixed below where it bites): no hostname (crush_location),
# qemu64's CPU (no erasure-code plugin), the slow default paxos_propose_interval.
set -euo pipefail
D=${CEPH_DIR:-/tmp/ceph}
IP=${CEPH_IP:-127.0.0.1}
STORE=${CEPH_STORE:-bluestore}
# Under the test VM's emulation each program's first start costs up to a second (it
# comes in over virtiofs): what the script can do with bash's builtins, it does.
size=${CEPH_OSD_SIZE:-10G}
case $size in
*K) SIZE=$((${size%K} << 10)) ;;
*M) SIZE=$((${size%M} << 20)) ;;
*G) SIZE=$((${size%G} << 30)) ;;
*) SIZE=$size ;;
esac
t0=${EPOCHREALTIME/./}
ts() {
  local us=$((${EPOCHREALTIME/./} - t0))
  printf '[%3d.%02ds] %s\n' $((us / 1000000)) $((us / 10000 % 100)) "$*"
}

stop() {
  local p pid
  for p in "$D"/run/osd.0.pid "$D"/run/mon.a.pid; do
    [ -f "$p" ] || continue
    pid=$(cat "$p")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$p"
  done
}

B64=ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/
# base64 of the bytes spelled by the hex string $1
b64() {
  local hex=$1 out='' i n len=$((${#1} / 2))
  for ((i = 0; i + 3 <= len; i += 3)); do
    n=$((16#${hex:2*i:6}))
    out+=${B64:n>>18&63:1}${B64:n>>12&63:1}${B64:n>>6&63:1}${B64:n&63:1}
  done
  case $((len - i)) in
  1)
    n=$((16#${hex:2*i:2} << 16))
    out+=${B64:n>>18&63:1}${B64:n>>12&63:1}==
    ;;
  2)
    n=$((16#${hex:2*i:4} << 8))
    out+=${B64:n>>18&63:1}${B64:n>>12&63:1}${B64:n>>6&63:1}=
    ;;
  esac
  printf '%s\n' "$out"
}

# a random uuid (the kernel's)
uuid() { local u; read -r u </proc/sys/kernel/random/uuid; printf '%s\n' "$u"; }

# a cephx secret as `ceph-authtool --gen-print-key` makes it: type 1 (AES), creation
# time 0, length 16, then 16 random bytes (a random uuid's: a throw-away cluster's keys)
genkey() { local u; u=$(uuid); b64 "0100""0000000000000000""1000""${u//-/}"; }

start() {
  stop
  unset CEPH_CONF
  rm -rf "$D"
  mkdir -p "$D"/{mon.a,osd.0,run,log,crash}
  local fsid osd_uuid
  fsid=$(uuid)
  osd_uuid=$(uuid)
  # keyrings are for root's eyes only
  umask 077
  cat >"$D/client.admin.keyring" <<EOF
[client.admin]
	key = $(genkey)
	caps mon = "allow *"
	caps osd = "allow *"
	caps mgr = "allow *"
	caps mds = "allow *"
EOF
  cat >"$D/osd.0/keyring" <<EOF
[osd.0]
	key = $(genkey)
	caps mon = "allow profile osd"
	caps osd = "allow *"
	caps mgr = "allow profile osd"
EOF
  # the mon's initial auth database: its own key plus everything it must know at mkfs
  {
    printf '[mon.]\n\tkey = %s\n\tcaps mon = "allow *"\n' "$(genkey)"
    printf '%s\n' "$(<"$D/client.admin.keyring")" "$(<"$D/osd.0/keyring")"
  } >"$D/mon.keyring"
  cat >"$D/ceph.conf" <<EOF
[global]
fsid = $fsid
mon_host = [v2:$IP:3300,v1:$IP:6789]
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
ms_bind_ipv6 = false
run_dir = $D/run
crash_dir = $D/crash
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
# no erasure-code plugin preload: the jerasure plugin dies with SIGILL on qemu's default
# TCG CPU (qemu64); replicated RBD pools do not need it
osd_erasure_code_plugins =

[mon]
mon_data = $D/\$name
log_file = $D/log/\$name.log
pid_file = $D/run/\$name.pid
admin_socket = $D/run/\$name.asok
mon_cluster_log_file = $D/log/cluster.log
# each osdmap change waits this long (default 1 s); 0.1 makes start and pool ops ~3x faster
paxos_propose_interval = 0.1
mon_data_avail_warn = 2
mon_data_avail_crit = 1
mon_warn_on_insecure_global_id_reclaim_allowed = false

[osd]
osd_data = $D/\$name
public_addr = $IP
cluster_addr = $IP
# fixed CRUSH host name: the default is \$(hostname -s), and a VM without a hostname
# ("(none)") makes the OSD die with "unable to update_crush_location: (22) Invalid argument"
crush_location = root=default host=node0
log_file = $D/log/\$name.log
pid_file = $D/run/\$name.pid
admin_socket = $D/run/\$name.asok
osd_objectstore = $STORE
bluestore_block_size = $SIZE
bluestore_block_create = true
# skip the fsck after mkfs (saves ~0.8 s on the host)
bluestore_fsck_on_mkfs = false
memstore_device_bytes = $SIZE
memstore_page_set = true
memstore_page_size = 4096
# memory: this build has no tcmalloc, so osd_memory_target autotuning does not bound RSS;
# fixed 64 MiB cache + small rocksdb memtables: peak OSD RSS 278 MB instead of 646 MB
osd_memory_target = 939524096
bluestore_cache_autotune = false
bluestore_cache_size = 67108864
bluestore_rocksdb_options = compression=kNoCompression,max_write_buffer_number=2,min_write_buffer_number_to_merge=1,recycle_log_file_num=2,write_buffer_size=33554432,writable_file_max_buffer_size=0,compaction_readahead_size=2097152,max_background_compactions=1,max_total_wal_size=134217728
osd_min_pg_log_entries = 100
osd_max_pg_log_entries = 1000
osd_target_pg_log_entries_per_osd = 8000
osd_op_num_shards = 1
osd_op_num_threads_per_shard = 2

[client]
keyring = $D/\$name.keyring
EOF
  printf '%s\n' "${CEPH_CONF_EXTRA:-}" >>"$D/ceph.conf"
  export CEPH_CONF=$D/ceph.conf
  ts "keys + ceph.conf"
  # The OSD's mkfs needs no mon (--no-mon-config): it runs beside the mon's mkfs and start.
  ceph-osd -i 0 --mkfs --osd-uuid "$osd_uuid" --no-mon-config >"$D/log/osd.0.mkfs.out" 2>&1 &
  osd_mkfs=$!
  # a failed step ends the script: the mkfs must not go on writing into $D after it
  trap 'kill "$osd_mkfs" 2>/dev/null || true' EXIT
  monmaptool --create --enable-all-features --set-min-mon-release 16 --fsid "$fsid" \
    --addv a "[v2:$IP:3300,v1:$IP:6789]" "$D/monmap" >/dev/null
  ceph-mon --mkfs -i a --monmap "$D/monmap" --keyring "$D/mon.keyring"
  ts "mon mkfs"
  if ! ceph-mon -i a 2>>"$D/log/mon.a.stderr"; then
    tail -n 5 "$D/log/mon.a.stderr" >&2
    exit 1
  fi
  ts "mon started"
  if ! wait "$osd_mkfs"; then
    cat "$D/log/osd.0.mkfs.out" >&2
    exit 1
  fi
  trap - EXIT
  ts "osd mkfs ($STORE)"
  # the rest talks to the mon: one python process instead of many slow `ceph` CLI calls
  /usr/bin/python3 - "$osd_uuid" "$D" <<'PY'
import json, subprocess, sys, time, rados, rbd
uuid, D = sys.argv[1:3]
t0 = time.time()
def ts(msg): print(f"  [+{time.time() - t0:5.2f}s] {msg}", flush=True)
c = rados.Rados(conffile=f"{D}/ceph.conf", rados_id="admin")
c.connect(timeout=60)
ts("connected to the mon")
def cmd(**kw):
    ret, out, err = c.mon_command(json.dumps(kw), b"", timeout=60)
    if ret != 0:
        sys.exit(f"mon command {kw}: {ret} {err}")
    return out
cmd(prefix="osd new", uuid=uuid, id=0)
ts("osd.0 allocated")
osd = subprocess.Popen(["ceph-osd", "-i", "0"], stderr=open(f"{D}/log/osd.0.stderr", "a"))
# while the OSD starts: the pool (its PGs wait for the OSD) and the client's key
cmd(prefix="osd pool create", pool="rbd", pg_num=8)
ts("pool rbd created")
key = cmd(prefix="auth get-or-create", entity="client.rbdtest", format="plain",
          caps=["mon", "profile rbd", "osd", "profile rbd pool=rbd", "mgr", "profile rbd pool=rbd"])
open(f"{D}/client.rbdtest.keyring", "wb").write(key)
# ublkd's default client (`ceph_id` unset), with exactly the caps the operator's guide
# documents for it: a device added without --ceph-id connects as it.
key = cmd(prefix="auth get-or-create", entity="client.ublkd", format="plain",
          caps=["mon", "profile rbd", "osd", "profile rbd pool=rbd"])
open(f"{D}/client.ublkd.keyring", "wb").write(key)
if osd.wait() != 0:
    sys.exit(f"ceph-osd -i 0 exited with {osd.returncode}: see {D}/log/osd.0.log")
while json.loads(cmd(prefix="osd dump", format="json"))["osds"][0]["up"] != 1:
    time.sleep(0.1)
ts("osd.0 up")
io = c.open_ioctx("rbd")
rbd.RBD().pool_init(io, False)           # = `rbd pool init rbd`
io.write_full("ready-check", b"ok")      # returns once the PGs are active
io.remove_object("ready-check")
ts("pool rbd initialised and writable")
io.close(); c.shutdown()
PY
  ts "ready"
}

case ${1:-} in
start) start ;;
stop) stop ;;
*)
  echo "usage: $0 start|stop" >&2
  exit 2
  ;;
esac
