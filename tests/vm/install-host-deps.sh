#!/usr/bin/env bash
# Installs what the test VM needs on a Debian 12 host: qemu (TCG is enough), static
# busybox for the guest's init, fio, and the sid suite pinned below bookworm so that
# only the packages we ask for by name (the kernel, its headers) come from sid.
# Idempotent: a second run installs nothing and prints one line.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "install-host-deps: must run as root (it runs apt-get)" >&2
  exit 1
fi

# python3-prometheus-client: tests/tests/metrics.rs parses ublkctl's metrics with it.
# nbdkit, qemu-utils: supervisor/tests/nbd.rs negotiates with real NBD servers (nbdkit,
# qemu-nbd serving a qcow2 image made by qemu-img) on the host, no VM needed.
# nbd-client: the kernel's NBD client beside ublkd's nbd target in `bench/run nbd`
# (in the VM; nothing of it starts at boot: its nbd-client.service is masked and
# /etc/nbdtab lists no device).
# prometheus: its promtool checks and unit-tests packaging/monitoring/'s alert rules
# (tests/tests/monitoring.rs, a host test).
# ceph-mon, ceph-osd, ceph-common: the single-node Ceph cluster tests/tests/rbd.rs starts
# inside the VM (tests/vm/ceph-single-node.sh; ceph-common brings python3-rados and
# python3-rbd, which tests/vm/ceph-agent.py uses, and librbd1, which rbd workers load at
# run time). Nothing of them runs on the host: Debian starts no Ceph daemon at install.
# rbd-nbd: librbd through the kernel's NBD client, the baseline beside ublkd's rbd target.
# iproute2: tc, which delays a dead worker's TCP segments in the rbd fencing test.
# protobuf-compiler: protoc, which csi/build.rs runs on the CSI protobuf (csi/proto/).
# udev: systemd-udevd in the VM booted with systemd as PID 1 (tests/tests/systemd.rs),
# which makes the package's /dev/disk/by-id/ublk-NAME links as a real host's does. The
# other VM boots start no udevd.
need=(qemu-system-x86 busybox-static kmod cpio xz-utils fio gcc shellcheck python3-prometheus-client
  nbdkit qemu-utils nbd-client prometheus ceph-mon ceph-osd ceph-common rbd-nbd iproute2
  protobuf-compiler udev)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

sid_list=/etc/apt/sources.list.d/ublkd-sid.sources
pin=/etc/apt/preferences.d/ublkd-sid
changed=0
if [ ! -f "$sid_list" ]; then
  cat >"$sid_list" <<'SRC'
# Added by ublkd's tests/vm/install-host-deps.sh: the test VM boots sid's kernel.
Types: deb
URIs: http://deb.debian.org/debian
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  changed=1
fi
if [ ! -f "$pin" ]; then
  # Without a pin, sid has the same priority as bookworm(-security) and its newer
  # versions would win (a new libc). At 100, sid is used only when asked for by name
  # (`apt-get download pkg/sid`), as backports are.
  printf 'Package: *\nPin: release n=sid\nPin-Priority: 100\n' >"$pin"
  changed=1
fi

stamp=/var/lib/apt/lists/.ublkd-updated
if [ "$changed" = 1 ] || [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +720 2>/dev/null)" ]; then
  echo "install-host-deps: apt-get update (bookworm + sid)" >&2
  apt-get update -qq
  touch "$stamp"
fi

if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-host-deps: installing ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm --no-install-recommends "${missing[@]}" >/dev/null
  # Only promtool is wanted of prometheus: the server its package enables and starts
  # is not (installed here, so nobody else's).
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
else
  echo "install-host-deps: all host packages present" >&2
fi
