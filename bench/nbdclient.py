"""The NBD clients of the NBD benchmark (nbd.py): a minimal one of our own, which reads
the export's flags and fills it (the fixed-newstyle handshake, NBD_CMD_WRITE), and the
two under test as the phases attach them as block devices: the kernel's (nbd.ko, set
up by nbd-client) and ublkd's nbd target. nbdkit, the server, is in servers.py.
Python 3 standard library only.
"""

import os
import socket
import struct
import time

import params as P
import servers as S
from benchlib import sh


# ======================================================================================
# a minimal NBD client (the export's flags, the fill)
# ======================================================================================

NBD_FLAG_CAN_MULTI_CONN = 1 << 8
IHAVEOPT = 0x49484156454F5054


def recvn(s, n):
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise RuntimeError("the NBD server closed the connection")
        buf += got
    return buf


def nbd_connect(path):
    """Fixed-newstyle handshake with NBD_OPT_GO on the default export; returns (socket
    in transmission, export size, transmission flags)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(path)
    hdr = recvn(s, 18)
    if hdr[:8] != b"NBDMAGIC" or struct.unpack(">Q", hdr[8:16])[0] != IHAVEOPT:
        raise RuntimeError(f"not a newstyle NBD server: {hdr!r}")
    hflags = struct.unpack(">H", hdr[16:])[0]
    s.sendall(struct.pack(">I", 1 | (hflags & 2)))  # FIXED_NEWSTYLE, NO_ZEROES if offered
    data = struct.pack(">I", 0) + struct.pack(">H", 0)  # name "", no info requests
    s.sendall(struct.pack(">QII", IHAVEOPT, 7, len(data)) + data)  # NBD_OPT_GO
    size = flags = None
    while True:
        _magic, _opt, rtype, ln = struct.unpack(">QIII", recvn(s, 20))
        body = recvn(s, ln)
        if rtype == 1:  # NBD_REP_ACK
            break
        if rtype == 3 and struct.unpack(">H", body[:2])[0] == 0:  # NBD_INFO_EXPORT
            size, flags = struct.unpack(">QH", body[2:12])
        elif rtype & (1 << 31):
            raise RuntimeError(f"NBD_OPT_GO refused ({rtype:#x}): {body[4:]!r}")
    return s, size, flags


def nbd_fill(path, size, chunk):
    """Writes non-zero data over the whole export, `chunk` bytes per NBD_CMD_WRITE."""
    s, _, _ = nbd_connect(path)
    data = (os.urandom(4096) * (chunk // 4096 + 1))[:chunk]
    handle = 0
    for off in range(0, size, chunk):
        n = min(chunk, size - off)
        handle += 1
        s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 1, handle, off, n) + data[:n])
        magic, err, h = struct.unpack(">IIQ", recvn(s, 16))
        if magic != 0x67446698 or err or h != handle:
            raise RuntimeError(f"NBD write at {off} failed: error {err}")
    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 2, handle + 1, 0, 0))  # NBD_CMD_DISC
    s.close()


def unix_connections(path):
    """Connections accepted on the listening unix socket `path` and still open: the
    inodes of the entries of /proc/net/unix with that path in the connected state (a
    client's own end is unbound, so it does not show the path)."""
    inodes = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            v = line.split()
            if len(v) >= 8 and v[7] == path and v[5] == "03":
                inodes.add(v[6])
    return inodes


# ======================================================================================
# the clients under test
# ======================================================================================

def load_nbd():
    """Loads the kernel's NBD client; returns (how, None) or (None, why not)."""
    if os.path.isdir("/sys/module/nbd"):
        return "built in or loaded", None
    kdir = os.environ.get("UBLKD_VM_KERNEL_DIR", "")
    ko = os.path.join(kdir, "nbd.ko")
    if kdir and os.path.exists(ko):
        sh(["insmod", ko, f"nbds_max={P.NBD_NBDS_MAX}"])
        return f"insmod {ko}", None
    manifest = os.path.join(kdir, "manifest")
    nbd = None
    if os.path.exists(manifest):
        for ln in open(manifest):
            if ln.startswith("nbd="):
                nbd = ln.strip()[4:]
    if nbd == "n":
        return None, "the guest kernel has no NBD client (CONFIG_BLK_DEV_NBD unset)"
    if not kdir:
        return None, ("UBLKD_VM_KERNEL_DIR is not set: tests/vm/run is older than the "
                      "nbd.ko support (rebuild ublkd-vm)")
    return None, (f"no nbd.ko in {kdir} (a kernel cache of an older layout? "
                  f"`target/debug/ublkd-vm fetch` fetches it again)")


class KernelNbd:
    """The kernel's client, configured by nbd-client over netlink (which then exits:
    the kernel holds the sockets); each attach takes a fresh /dev/nbdN."""
    next_index = 0

    def __init__(self, name, connections):
        self.name, self.connections = name, connections
        self.dev = None

    def attach(self, sock):
        idx = KernelNbd.next_index
        KernelNbd.next_index += 1
        if idx >= P.NBD_NBDS_MAX:
            raise RuntimeError(f"out of /dev/nbdN (nbds_max={P.NBD_NBDS_MAX})")
        dev = f"nbd{idx}"
        cmd = ["nbd-client", "-unix", sock, f"/dev/{dev}", "-N", ""]
        if self.connections > 1:
            cmd += ["-C", str(self.connections)]
        out = sh(cmd, timeout=60)
        end = time.monotonic() + 20
        while True:
            try:
                with open(f"/sys/block/{dev}/size") as f:
                    if int(f.read()) > 0:
                        break
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"/dev/{dev} has no size 20 s after nbd-client: {out.strip()}")
            time.sleep(0.05)
        self.dev = dev
        return dev

    def pids(self):
        return set()

    def detach(self):
        if self.dev:
            sh(["nbd-client", "-d", f"/dev/{self.dev}"], timeout=60)
            self.dev = None

    def stop(self):
        pass

    def log_problems(self):
        return None


class UblkdNbd(S.UblkdDevice):
    """ublkd with `ublkctl add -t nbd --uri nbd+unix:///?socket=SOCKET`."""
    name = "ublkd"
    CFG = "/run/ublkd-bench-nbd.toml"
    LOG = "/run/ublkd-bench-nbd.log"

    def attach(self, sock):
        return self.add_device("-t", "nbd", "--uri", f"nbd+unix:///?socket={sock}",
                               "-q", str(self.prm["NBD_QUEUES"]),
                               "--threads", str(self.prm.get("NBD_THREADS", 1)),
                               "-d", str(self.prm["NBD_QUEUE_DEPTH"]))


class UblkdNbdZeroCopy(UblkdNbd):
    """ublkd-zc: the same with `--zero-copy` (READ data received into the request's
    pages, WRITE data sent from them; Linux >= 7.2), its own ublkd beside the other."""
    name = "ublkd-zc"
    SOCK = "/run/ublkd-bench-zc.sock"
    CFG = "/run/ublkd-bench-nbd-zc.toml"
    LOG = "/run/ublkd-bench-nbd-zc.log"
    STATE_DIR = "/run/ublkd-bench-zc"

    def attach(self, sock):
        return self.add_device("-t", "nbd", "--uri", f"nbd+unix:///?socket={sock}",
                               "--zero-copy", "-q", str(self.prm["NBD_QUEUES"]),
                               "--threads", str(self.prm.get("NBD_THREADS", 1)),
                               "-d", str(self.prm["NBD_QUEUE_DEPTH"]))


class UblkdNbdRestart(UblkdNbd):
    """The restart phase's ublkd: its own log, whose WARN/ERROR lines the table shows."""
    LOG = "/run/ublkd-bench-nbd-restart.log"


def make_client(name, plan, restart=False):
    if name == "ublkd":
        return UblkdNbdRestart(plan) if restart else UblkdNbd(plan)
    if name == "ublkd-zc":
        return UblkdNbdZeroCopy(plan)
    return KernelNbd(name, 2 if name.endswith("-c2") else 1)
