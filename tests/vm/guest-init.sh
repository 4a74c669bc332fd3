#!/bin/busybox sh
# /init of ublkd-vm's initramfs (busybox sh), built into the image by
# tests/src/initramfs.rs. shellcheck checks it in ./run-tests.
# shellcheck shell=sh
/bin/busybox mkdir -p /proc /sys /dev /host /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

RUN=
NONCE=
SYSTEMD=
read -r cmdline </proc/cmdline
for arg in $cmdline; do
  case "$arg" in
    ublkd.run=*) RUN="${arg#ublkd.run=}" ;;
    ublkd.nonce=*) NONCE="${arg#ublkd.nonce=}" ;;
    ublkd.systemd=1) SYSTEMD=1 ;;
  esac
done
M="UBLKD-VM:$NONCE"
off() { poweroff -f; while :; do sleep 1; done; }
fail() { echo; echo "$M:SETUP-FAILED:$*"; off; }

if [ -z "$RUN" ] || [ -z "$NONCE" ]; then
  fail "no ublkd.run= or ublkd.nonce= on the kernel command line"
fi
if [ -f /ublk_drv.ko ]; then
  insmod /ublk_drv.ko || fail "insmod ublk_drv.ko"
fi
H=/host
mount -t virtiofs -o ro hostfs $H || fail "mount virtiofs hostfs read-only"
OVL="$H$RUN/../../kernel/$(uname -r)/overlay.ko"
[ -f "$OVL" ] && insmod "$OVL" 2>/dev/null
[ -f "$H$RUN/params" ] || fail "no $RUN/params in the host's root"
# Modules beyond those insmod-ed here (kernel TLS's; see tests/src/kernel.rs) are in
# the cached kernel's module tree: /lib/modules/<release> is made to point there below,
# so that modprobe and the kernel's own request_module find them. Optional: a cache
# entry without that tree boots without it.
KREL=$(uname -r)
MODS="${RUN%/*/*}/kernel/$KREL/modules/lib/modules/$KREL"
[ -f "$H$MODS/modules.dep" ] || MODS=
CHECK_BIN=
CHECK_KERNEL=
# shellcheck source=/dev/null  # written per run by ublkd-vm
. "$H$RUN/params"
[ -n "$CHECK_BIN" ] || fail "no CHECK_BIN in $RUN/params"
[ -n "$CHECK_KERNEL" ] || fail "no CHECK_KERNEL in $RUN/params"

# What the guest runs once set up, in both modes (written into a script below, after
# that script's own `off`): report READY, run guest-check and the command, report the
# command's status, power off. $1 is the command that prints the kernel release.
guest_body() {
  cat <<BODY
echo; echo "$M:READY:\$($1)"
"$CHECK_BIN" guest-check --kernel "$CHECK_KERNEL" </dev/null
rc=\$?
if [ \$rc -ne 0 ]; then echo; echo "$M:CHECK-FAILED:\$rc"; off; fi
/bin/sh "$RUN/cmd.sh" </dev/null
rc=\$?
echo; echo "$M:EXIT:\$rc"
off
BODY
}

if [ -n "$SYSTEMD" ]; then
  # --systemd: the host's systemd becomes PID 1 of a writable copy of the host's root
  # (an overlay: the read-only virtiofs share below, tmpfs above), and starts
  # ublkd-vm.target: basic.target plus ublkd-vm.service, which runs the command
  # (after guest-check), prints the markers and powers off. systemd mounts /proc,
  # /sys, /dev, /run and the cgroup tree itself.
  R=/sysroot
  mkdir -p /ovl $R
  grep -qw overlay /proc/filesystems || fail "overlayfs did not load (needed by --systemd)"
  mount -t tmpfs -o mode=755 tmpfs /ovl || fail "mount the overlay's tmpfs"
  mkdir -p /ovl/upper /ovl/work
  mount -t overlay overlay -o lowerdir=$H,upperdir=/ovl/upper,workdir=/ovl/work $R ||
    fail "mount the overlay root"
  [ -x $R/lib/systemd/systemd ] || fail "the host has no /lib/systemd/systemd"
  if [ -n "$MODS" ]; then
    mkdir -p $R/lib/modules || fail "mkdir /lib/modules"
    ln -sfn "$MODS" "$R/lib/modules/$KREL" || fail "link /lib/modules/$KREL to $MODS"
  fi
  G=$R/etc/ublkd-vm
  U=$R/etc/systemd/system
  mkdir -p $G $U || fail "mkdir $G $U"
  {
    cat <<GUEST
#!/bin/sh
# ublkd-vm.service's command: written by ublkd-tests (tests/vm/guest-init.sh).
off() { sync; systemctl --force --force poweroff; while :; do sleep 1; done; }
GUEST
    guest_body "uname -r"
  } > $G/guest || fail "write $G/guest"
  cat > $U/ublkd-vm.target <<TARGET || fail "write ublkd-vm.target"
[Unit]
Description=ublkd-vm: the system the guest command runs in
Requires=basic.target ublkd-vm.service
After=basic.target
AllowIsolate=yes
TARGET
  cat > $U/ublkd-vm.service <<SERVICE || fail "write ublkd-vm.service"
[Unit]
Description=ublkd-vm: the guest command
After=basic.target
[Service]
Type=exec
ExecStart=/bin/sh /etc/ublkd-vm/guest
Environment=UBLKD_VM_SYSTEMD=1
StandardInput=null
StandardOutput=tty
StandardError=inherit
TTYPath=/dev/console
TimeoutStartSec=infinity
SERVICE
  # Masked: what would walk or clean the host's trees through virtiofs (tmpfiles'
  # boot-time cleanup of /tmp), reach for the network or hardware, or only cost boot
  # time under TCG. The journal stays (it is volatile: the root is in RAM).
  for u in systemd-tmpfiles-setup.service systemd-tmpfiles-clean.timer \
    systemd-tmpfiles-setup-dev.service systemd-timesyncd.service systemd-pstore.service \
    systemd-update-utmp.service systemd-random-seed.service systemd-binfmt.service \
    proc-sys-fs-binfmt_misc.automount systemd-firstboot.service systemd-repart.service \
    systemd-pcrphase.service systemd-pcrphase-sysinit.service \
    systemd-machine-id-commit.service systemd-journal-flush.service \
    systemd-modules-load.service kmod-static-nodes.service systemd-sysctl.service \
    systemd-sysusers.service apt-daily.timer apt-daily-upgrade.timer \
    dpkg-db-backup.timer e2scrub_all.timer man-db.timer fstrim.timer \
    sys-kernel-debug.mount sys-kernel-tracing.mount sys-kernel-config.mount \
    sys-fs-fuse-connections.mount dev-hugepages.mount dev-mqueue.mount \
    systemd-ask-password-console.path cryptsetup.target veritysetup.target \
    integritysetup.target; do
    ln -sfn /dev/null $U/$u || fail "mask $u"
  done
  # The host may be a container image: its markers would make systemd treat the VM as
  # a container, and its policy-rc.d would forbid packages to start their services.
  rm -f $R/.dockerenv $R/run/.containerenv $R/usr/sbin/policy-rc.d
  # No man-db trigger on every dpkg run (it rebuilds the index: a minute under TCG).
  rm -f $R/var/lib/man-db/auto-update
  # shellcheck disable=SC2093  # what follows runs only if switch_root fails
  exec switch_root $R /lib/systemd/systemd --unit=ublkd-vm.target
  fail "switch_root to systemd"
fi

mount -t proc proc $H/proc || fail "mount $H/proc"
mount -t sysfs sysfs $H/sys || fail "mount $H/sys"
mount -t devtmpfs devtmpfs $H/dev || fail "mount $H/dev"
mkdir -p $H/dev/pts $H/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $H/dev/pts || fail "mount $H/dev/pts"
mount -t tmpfs -o mode=1777 tmpfs $H/dev/shm || fail "mount $H/dev/shm"
ln -sfn /proc/self/fd $H/dev/fd
ln -sfn /proc/self/fd/0 $H/dev/stdin
ln -sfn /proc/self/fd/1 $H/dev/stdout
ln -sfn /proc/self/fd/2 $H/dev/stderr
mount -t tmpfs -o mode=755 tmpfs $H/run || fail "mount $H/run"
# /tmp and /var/tmp are writable in the guest. Where overlayfs loads, they show the
# host's files under a tmpfs upper layer, so a checkout under /tmp (as a CI runner
# may make) is still there; otherwise they are plain, empty tmpfs.
for d in tmp var/tmp; do
  [ -d $H/$d ] || continue
  u=$H/run/ublkd-vm-overlay/$d
  mkdir -p $u/upper $u/work && chmod 1777 $u/upper
  if grep -qw overlay /proc/filesystems &&
    mount -t overlay overlay -o lowerdir=$H/$d,upperdir=$u/upper,workdir=$u/work $H/$d; then
    :
  else
    mount -t tmpfs -o mode=1777 tmpfs $H/$d || fail "mount $H/$d"
  fi
done
# /lib/modules/<release>: the host's /lib (here /usr/lib, where /lib is a link to it)
# gets a tmpfs upper layer holding just that link, as /tmp does above; the host's own
# files stay as they are.
if [ -n "$MODS" ]; then
  L=$(readlink -f $H/lib)
  case "$L" in "$H"/*) ;; *) L=$H/usr/lib ;; esac
  u=$H/run/ublkd-vm-overlay/lib
  mkdir -p $u/upper/modules $u/work || fail "mkdir $u"
  ln -sfn "$MODS" "$u/upper/modules/$KREL" || fail "link $u/upper/modules/$KREL"
  if ! grep -qw overlay /proc/filesystems ||
    ! mount -t overlay overlay -o lowerdir="$L",upperdir=$u/upper,workdir=$u/work "$L"; then
    echo "[guest] note: no overlayfs, so no /lib/modules/$KREL: modprobe loads nothing"
  fi
fi
ip link set lo up 2>/dev/null

# The host's root becomes the real root (switch_root moves it over / and chroots
# there), not a chroot beside it: the kernel refuses user namespaces (which the
# worker sandbox creates) to a chrooted process. Stage two runs from /run (tmpfs) with
# a copy of busybox, since switch_root empties the initramfs.
S=/run/ublkd-vm
mkdir -p $H$S || fail "mkdir $H$S"
cp /bin/busybox $H$S/busybox || fail "copy busybox to $H$S"
{
  cat <<STAGE2
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
off() { $S/busybox poweroff -f; while :; do $S/busybox sleep 1; done; }
STAGE2
  guest_body "$S/busybox uname -r"
} > $H$S/stage2 || fail "write $H$S/stage2"
# shellcheck disable=SC2093  # what follows runs only if switch_root fails
exec switch_root $H $S/busybox sh $S/stage2
fail "switch_root"
