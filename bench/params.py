# The benchmark's parameters, all in one place. `bench/run` reads this file on the
# host and the guest half reads it inside the VM; command-line flags of `bench/run`
# (--rounds, --runtime, --servers, --quick) override a few of them.

# ---- rounds and timing -------------------------------------------------------------
ROUNDS = 5                # each round runs every server once, in a rotated order
RUNTIME_S = 4             # fio --runtime (time_based), per run
RAMP_S = 1                # fio --ramp_time, per run (its I/O is excluded from fio's stats)
IDLE_S = 2                # per server turn: the server's CPU use with its device idle; 0: skip
# (fio itself takes ~2 s to start under TCG: a run lasts RUNTIME_S + RAMP_S + ~3 s; the
# CPU window excludes that, see measure() in measure.py. 4 s keeps the full run near 30 min.)

# ---- servers, in the order of round 1 (later rounds rotate it) -----------------------
# ublkd: its defaults (loop devices zero-copy, UBLK_F_AUTO_BUF_REG, where the kernel
# has it); ublkd-copy: loop devices with --copy; ublkd-nosandbox: the worker without its
# sandbox (--no-sandbox); ublkd-deferred: `recovery.fast_release = false` (rings with
# DEFER_TASKRUN: faster loop I/O, longer recovery stall); kublk-b-zc: kublk -b --auto_zc.
SERVERS = ["ublkd", "ublkd-deferred", "ublkd-copy", "ublkd-nosandbox", "kublk-b", "kublk-b-zc", "kublk", "rublk"]
RATIO_BASELINES = ["kublk-b", "rublk"]      # the table prints ublkd / each of these
# Servers that run only some jobs (any other runs every job): zero copy only matters
# where data is copied (loop); the sandbox's cost shows on one null and one loop job.
LOOP_JOBS = ["loop-randread-qd64", "loop-randwrite-qd64", "loop-seqread-128k-qd16"]
SERVER_JOBS = {
    "ublkd-copy": LOOP_JOBS,
    "ublkd-deferred": ["null-randread-qd1-j1", "null-randread-qd64-j1"] + LOOP_JOBS,
    "kublk-b-zc": LOOP_JOBS,
    "ublkd-nosandbox": ["null-randread-qd64-j1", "loop-randread-qd64"],
}
# The modes each side may pick as its best, per job (the loop target's target is
# ublkd >= 1.0x kublk's best mode); ublkd-nosandbox is not a production mode.
BEST_OF = {"ublkd": ["ublkd", "ublkd-deferred", "ublkd-copy"], "kublk": ["kublk", "kublk-b", "kublk-b-zc"]}

# ---- the kernel: `--kernel 7.2` (the default) or `--kernel 6.12` (bench.py, recovery.py)
# 7.2: Debian sid's newest cloud kernel >= 7.0, with UBLK_F_BATCH_IO. 6.12: Debian's 6.12
# LTS, without it: ublkd serves on its per-I/O path (FETCH_REQ / COMMIT_AND_FETCH_REQ per
# tag), never zero copy (ublkd's zero copy is UBLK_F_AUTO_BUF_REG on the batch path), and
# kublk runs without -b. The value is what tests/vm/run's --kernel takes.
KERNEL = "7.2"
KERNELS = {"7.2": "7", "6.12": "6.12"}
# What 6.12 changes of the lists above and of RECOVERY_SERVERS below (unless --servers).
# rublk is allowed there (--servers ...,rublk) but not in the default set: not tried yet.
KERNEL_6_12 = {
    "SERVERS": ["ublkd", "ublkd-deferred", "ublkd-nosandbox", "kublk"],
    "RATIO_BASELINES": ["kublk", "rublk"],
    "BEST_OF": {"ublkd": ["ublkd", "ublkd-deferred"], "kublk": ["kublk"]},
    "RECOVERY_SERVERS": ["ublkd", "kublk", "ublkd-deferred"],
    # issue 33's goal there: the per-I/O path's release waits in IORING_UNREGISTER_FILES
    "RECOVERY_TARGET_RATIO": 0.35,
}
# Servers refused on 6.12 (even with --servers), and why.
REFUSED_6_12 = {
    # (6.12 drops the flag it does not know from ADD_DEV's and kublk -b then serves per
    # I/O: it runs, but a row named kublk-b would be kublk)
    "kublk-b": "kublk -b needs UBLK_F_BATCH_IO (Linux >= 7.0); use kublk",
    "kublk-b-zc": "kublk -b --auto_zc needs UBLK_F_BATCH_IO and UBLK_F_AUTO_BUF_REG",
    "ublkd-zc": "ublkd's zero copy needs UBLK_F_BATCH_IO and UBLK_F_AUTO_BUF_REG "
                "(`ublkctl add --zero-copy` is refused there)",
    "ublkd-copy": "ublkd's loop devices copy anyway on 6.12: ublkd-copy would be ublkd",
}

# ---- devices -------------------------------------------------------------------------
QUEUES = 1
QUEUE_DEPTH = 128
NULL_SIZE = "1G"          # ublkd's null device; fio touches only this much on every server
LOOP_FILE = "/tmp/ublkd-bench-loop.img"     # in the guest's tmpfs
LOOP_FILE_MB = 512

# ---- fio jobs ------------------------------------------------------------------------
# name: (target, rw, block size, iodepth, numjobs)
JOBS = {
    "null-randread-qd1-j1":  ("null", "randread", "4k", 1, 1),
    "null-randread-qd64-j1": ("null", "randread", "4k", 64, 1),
    "null-randread-qd1-j2":  ("null", "randread", "4k", 1, 2),
    "null-randread-qd64-j2": ("null", "randread", "4k", 64, 2),
    "loop-randread-qd64":    ("loop", "randread", "4k", 64, 1),
    "loop-randwrite-qd64":   ("loop", "randwrite", "4k", 64, 1),
    "loop-seqread-128k-qd16": ("loop", "read", "128k", 16, 1),
}


def _named_jobs(target, *names):
    """The NBD and RBD benchmarks' jobs, one fio job each over the whole device, as JOBS
    has them: each name reads RW-BS-qdN (RW: randread, randwrite, or seqread and
    seqwrite for fio's read and write) and gives (target, rw, BS, N, 1)."""
    jobs = {}
    for name in names:
        rw, bs, qd = name.split("-")
        jobs[name] = (target, {"seqread": "read", "seqwrite": "write"}.get(rw, rw), bs,
                      int(qd[len("qd"):]), 1)
    return jobs


# ---- --quick: a smoke check of the whole pipeline in a few minutes --------------------
QUICK = {
    "ROUNDS": 2,
    "RUNTIME_S": 2,
    "RAMP_S": 1,
    "IDLE_S": 1,
    "JOBS": ["null-randread-qd1-j1", "null-randread-qd64-j1", "loop-randread-qd64"],
}

# ---- peers: built at run time into CACHE_DIR, never into the repository -------------
CACHE_DIR = "/var/cache/ublkd-bench"        # must be visible in the guest (not /tmp)
KUBLK_SOURCE_PACKAGE = "auto"   # "auto": the newest linux-source-X.Y apt knows; or e.g. "linux-source-7.2"
KUBLK_RELEASE = "sid"           # the apt release linux-source, linux-libc-dev and liburing-dev come from
LIBURING_MIN = (2, 15)
RUBLK_VERSION = None            # None: the newest on crates.io; or e.g. "0.2.15"
RUBLK_BUILD_TIMEOUT_S = 1200

# ---- the VM ---------------------------------------------------------------------------
VM_MEM_MB = 2048
# Seconds per fio run beyond runtime+ramp (fio start-up and exit, device add/del, the
# idle measurement), for the time estimate and the VM timeout (1.6 * estimate + 180).
OVERHEAD_PER_RUN_S = 4.5

# ---- the recovery-stall benchmark: `bench/run recovery` (bench/recovery.py) ----------
# Per server, a loop device on a tmpfs file with fio verifying on it; the server is
# SIGKILLed RECOVERY_KILLS times, RECOVERY_INTERVAL_S after each recovery completed.
# ublkd recovers by itself; kublk-b (kublk -b -r 1 -i 1) gets `kublk recover` at once.
RECOVERY_SERVERS = ["ublkd", "kublk-b", "ublkd-zc", "kublk-b-zc"]  # the two pairs: copy, zero copy
# (on 6.12: KERNEL_6_12's; kublk there is kublk -r 1 -i 1 without -b)
RECOVERY_KILLS = 24             # per server, over all rounds (the issue asks >= 20)
RECOVERY_ROUNDS = 2             # each server's kills split into this many series, alternating
RECOVERY_INTERVAL_S = 1.0       # pause after a recovery completed, before the next kill
RECOVERY_POLL_S = 0.0002        # sleep between stat polls: ~0.6-1.5 ms a poll under TCG
RECOVERY_TIMEOUT_S = 60         # a kill whose I/O does not resume within this fails
RECOVERY_FIO_SETTLE_S = 2       # fio runs this long before the first and after the last kill
RECOVERY_VERIFY_BACKLOG = 256   # fio verify_backlog: verify written blocks during the run
RECOVERY_LOOP_FILE = "/tmp/ublkd-bench-recovery.img"   # in the guest's tmpfs
RECOVERY_LOOP_FILE_MB = 256
RECOVERY_RESTART_MAX = 1000     # ublkd's [recovery] restart_max: never the limit here
RECOVERY_KUBLK_MAX_ATTEMPTS = 200   # `kublk recover` re-runs (e.g. -EBUSY) per kill
RECOVERY_TARGET_RATIO = 0.25    # median stall ublkd / kublk-b (6.12: kublk) must be at most this

# ---- the scale benchmark (bench/scale.py, `bench/run scale`) ----
SCALE_COUNTS = [100, 300, 1000]  # devices, one fresh ublkd per count
SCALE_SIZE = "1G"               # each device: a null device of this size, -q 1 -d 128
SCALE_SETTLE_S = 5              # after the last add, before memory and idle CPU are read
SCALE_IDLE_S = 10               # ublkd's (and its workers') CPU with every device idle
SCALE_STATUS_REPS = 3           # `status --json` of all, `status -n`, `list`, `metrics`: median of
SCALE_KILLS = 5                 # SIGKILLs of device 0's worker while the others serve fio
SCALE_BYSTANDER_IOPS = 500      # the bystanders' fio: 4k randread over them, at this rate
SCALE_BYSTANDERS = 9            # devices besides 0 that serve fio during the kills, spread
                                # over 1..N-1, the same few at every N (the rest stay idle)
SCALE_RECOVERY_TIMEOUT_S = 60   # a kill whose I/O does not resume within this fails
SCALE_VM_MEM_MB = 6144          # 1000 devices: ~1.1 GiB of workers plus the kernel's queues
SCALE_NOFILE = 65536            # ublkd's RLIMIT_NOFILE, as packaging/ublkd.service sets it

# ---- the NBD benchmark (bench/nbd.py, `bench/run nbd`) ----
# ublkd's nbd target beside the kernel's NBD client (nbd.ko + nbd-client), both on the
# same nbdkit export over a unix socket, in one VM boot. Throughput: ONE nbdkit serving
# a RAM export for the whole phase (filled with data once, so that reads never hit
# holes and no run allocates), the clients attached in turn, each round's order
# rotated. Restart: per client a fresh nbdkit (file plugin, a tmpfs file) SIGKILLed
# during a verifying fio and started again on the same socket.
# kernel-nbd: `nbd-client -unix SOCKET /dev/nbdN -N ''` (netlink, 1 connection);
# kernel-nbd-c2: the same with -C 2 (only if the export advertises multi-conn).
# ublkd-zc: ublkd's device with --zero-copy (its own ublkd; Linux >= 7.2).
NBD_CLIENTS = ["kernel-nbd", "ublkd", "ublkd-zc", "kernel-nbd-c2"]
NBD_RATIO_BASELINE = "kernel-nbd"           # the table prints ublkd / this
NBD_ROUNDS = 4                              # each round runs every client once, rotated
NBD_RUNTIME_S = 4                           # fio --runtime per run (as RUNTIME_S)
NBD_RAMP_S = 1                              # fio --ramp_time per run (as RAMP_S)
NBD_EXPORT_SIZE = "1G"                      # nbdkit memory SIZE
NBD_FILL_CHUNK_MB = 1                       # the export's fill: NBD writes of this size
NBD_SOCKET = "/run/ublkd-bench-nbd.sock"    # in the guest
NBD_QUEUES = 1                              # ublkd -q (the kernel's client: 1 queue per connection)
NBD_THREADS = 1                             # ublkd --threads: its connections, where the export allows multi-conn
NBD_QUEUE_DEPTH = 128                       # ublkd -d (the kernel's client's default is 128)
NBD_NBDS_MAX = 32                           # insmod nbd.ko nbds_max=: each attach takes a fresh /dev/nbdN
# name: (target, rw, block size, iodepth, numjobs) as in JOBS; "nbd": the whole device
NBD_JOBS = _named_jobs("nbd", "randread-4k-qd1", "randread-4k-qd32", "randwrite-4k-qd32",
                       "seqread-128k-qd8", "seqwrite-128k-qd8")
NBD_OVERHEAD_PER_RUN_S = 4.5                # for the estimate, as OVERHEAD_PER_RUN_S
# The restart phase: fio randrw 4k with crc32c verify for NBD_RESTART_RUNTIME_S; after
# NBD_RESTART_KILL_AFTER_S of I/O nbdkit is SIGKILLed, and NBD_RESTART_DOWN_S later a
# new nbdkit serves the same file on the same socket. fio runs with
# --continue_on_error=all, so that it counts every failed I/O instead of stopping.
NBD_RESTART_CLIENTS = ["kernel-nbd", "ublkd"]
NBD_RESTART_ROUNDS = 2                      # per client, alternating
NBD_RESTART_RUNTIME_S = 15
NBD_RESTART_KILL_AFTER_S = 5
NBD_RESTART_DOWN_S = 3
NBD_RESTART_IODEPTH = 32
NBD_RESTART_VERIFY_BACKLOG = 256
NBD_RESTART_FILE = "/tmp/ublkd-bench-nbd.img"   # in the guest's tmpfs
NBD_RESTART_FILE_MB = 256
NBD_RESTART_HANG_S = 30                     # fio's I/O still stuck this long after its runtime:
                                            # the device is probed, then detached (fio then exits)
NBD_VM_MEM_MB = 3072                        # the 1 GiB RAM export + the restart file + the rest
NBD_QUICK = {"NBD_ROUNDS": 2, "NBD_RUNTIME_S": 2,
             "NBD_JOBS": ["randread-4k-qd1", "randread-4k-qd32"]}

# ---- the RBD benchmark (bench/rbd.py, `bench/run rbd`) ----
# ublkd's rbd target beside rbd-nbd (librbd behind the kernel's NBD client) and krbd
# (the kernel's own RBD client), on one image of a single-node Ceph cluster (1 mon, 1
# bluestore OSD on a file in the guest's tmpfs, cephx; tests/vm/ceph-single-node.sh) in
# one VM boot. Throughput: the image filled once; each round every client in turn
# (rotated) maps it, runs every job and unmaps it: the image's exclusive lock is one
# client's at a time. Faults: per client a fresh image and a verifying fio, an OSD
# restart or the client's process SIGKILLed in its midst.
# (rbd-nbd-nocache, rbd-nbd with `--rbd_cache=false` as ublkd runs librbd, is not in
# the default set: `--clients ublkd,rbd-nbd,rbd-nbd-nocache`)
RBD_CLIENTS = ["ublkd", "rbd-nbd", "krbd"]
RBD_RATIO_BASELINES = ["rbd-nbd", "krbd", "rbd-nbd-nocache"]  # ublkd / each of these that ran
RBD_ROUNDS = 3
RBD_RUNTIME_S = 5
RBD_RAMP_S = 1
RBD_IMAGE = "bench"
RBD_IMAGE_MB = 256
RBD_QUEUES = 1                              # ublkd -q
RBD_QUEUE_DEPTH = 128                       # ublkd -d (rbd-nbd's and krbd's default: 128)
RBD_CEPH_DIR = "/run/ublkd-bench-ceph"      # in the guest (tmpfs)
RBD_OSD_SIZE = "4G"                         # the OSD's sparse block file
# name: (target, rw, block size, iodepth, numjobs) as in JOBS; the whole device
RBD_JOBS = _named_jobs("rbd", "randread-4k-qd32", "randwrite-4k-qd32", "randread-4k-qd1",
                       "randwrite-4k-qd1", "seqread-128k-qd8", "seqwrite-128k-qd8")
RBD_OVERHEAD_PER_RUN_S = 5                  # for the estimate, as OVERHEAD_PER_RUN_S
# The fault phase: fio randrw 4k qd RBD_FAULT_IODEPTH with crc32c verify for
# RBD_FAULT_RUNTIME_S on a fresh image; RBD_FAULT_AFTER_S into the I/O, the fault.
# fio runs with --continue_on_error=all: it counts every failed I/O instead of stopping.
RBD_FAULTS = {
    "osd-restart": ["ublkd", "rbd-nbd", "krbd"],   # osd.0 SIGKILLed and started again
    "client-kill": ["ublkd", "rbd-nbd"],           # the client's process SIGKILLed
}
RBD_FAULT_ROUNDS = 1
RBD_FAULT_RUNTIME_S = 25
RBD_FAULT_AFTER_S = 5
RBD_FAULT_IODEPTH = 16
RBD_FAULT_VERIFY_BACKLOG = 256
RBD_FAULT_IMAGE_MB = 128
RBD_FAULT_HANG_S = 30                       # I/O still stuck this long after fio's runtime:
                                            # the device is probed, then unmapped
RBD_VM_MEM_MB = 4096                        # the cluster (~0.5 GiB), the images' data in tmpfs
RBD_QUICK = {"RBD_ROUNDS": 1, "RBD_RUNTIME_S": 2,
             "RBD_JOBS": ["randread-4k-qd32", "randwrite-4k-qd1"]}
