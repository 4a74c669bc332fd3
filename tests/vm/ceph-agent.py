"""The rbd tests' client of the test cluster (tests/src/harness/ceph.rs runs it with
/usr/bin/python3, whose rados and rbd modules come with ceph-common).

One process for all of a test binary's cluster requests: the `ceph` and `rbd` CLIs take
seconds each to start inside the test VM, this answers in milliseconds. It connects as
client.admin and reads one JSON request per line on stdin, answering each with one JSON
line on stdout: {"ok": RESULT} or {"err": "what failed"}.

Usage: ceph-agent.py CEPH_CONF POOL
"""

import hashlib
import json
import sys
import traceback

import rados
import rbd

# An operation the cluster does not answer fails after this long instead of hanging
# the test (librados waits forever by default).
OP_TIMEOUT_SECS = "120"
# Reads of a whole image, in chunks of this size.
CHUNK = 4 << 20


class Agent:
    def __init__(self, conf, pool):
        self.cluster = rados.Rados(conffile=conf, rados_id="admin")
        self.cluster.conf_set("rados_osd_op_timeout", OP_TIMEOUT_SECS)
        self.cluster.conf_set("rados_mon_op_timeout", OP_TIMEOUT_SECS)
        # What this client reads comes from the OSDs, never from a cache of its own.
        self.cluster.conf_set("rbd_cache", "false")
        self.cluster.connect(timeout=60)
        self.pool = pool
        self.ioctx = self.cluster.open_ioctx(pool)
        # Images whose lock this client holds (`hold_lock`).
        self.held = {}

    def image(self, name, snapshot=None, read_only=True):
        return rbd.Image(self.ioctx, name, snapshot=snapshot, read_only=read_only)

    # Requests: each takes the request's fields as keyword arguments.

    def ping(self):
        return "pong"

    def mon(self, cmd, timeout=60):
        """A mon command (a dict, as `ceph ... --format json` sends it): its output."""
        ret, out, err = self.cluster.mon_command(json.dumps(cmd), b"", timeout=timeout)
        if ret != 0:
            raise RuntimeError(f"mon command {cmd}: {ret} {err}")
        return out.decode(errors="replace")

    def create_image(self, name, size, layering_only=False):
        """With Ceph's default features, or (`layering_only`) without exclusive-lock
        and the features that need it, as an image made for krbd on an old kernel."""
        features = rbd.RBD_FEATURE_LAYERING if layering_only else None
        rbd.RBD().create(self.ioctx, name, size, features=features)

    def remove_image(self, name):
        """Removes the image and its snapshots."""
        with self.image(name, read_only=False) as img:
            for snap in list(img.list_snaps()):
                img.remove_snap(snap["name"])
        rbd.RBD().remove(self.ioctx, name)

    def list_images(self):
        return sorted(rbd.RBD().list(self.ioctx))

    def create_snapshot(self, image, snapshot):
        with self.image(image, read_only=False) as img:
            img.create_snap(snapshot)

    def write(self, image, offset, data):
        """Writes `data` (hex) at `offset` and flushes (takes the exclusive lock)."""
        with self.image(image, read_only=False) as img:
            img.write(bytes.fromhex(data), offset)
            img.flush()

    def read(self, image, offset, length, snapshot=None):
        with self.image(image, snapshot) as img:
            return img.read(offset, length).hex()

    def checksum(self, image, snapshot=None):
        """sha256 of the whole image, as `rbd export POOL/IMAGE - | sha256sum` has it."""
        digest = hashlib.sha256()
        with self.image(image, snapshot) as img:
            size = img.size()
            for offset in range(0, size, CHUNK):
                digest.update(img.read(offset, min(CHUNK, size - offset)))
        return digest.hexdigest()

    def size(self, image):
        with self.image(image) as img:
            return img.size()

    def lock_owners(self, image):
        """The exclusive lock's owners, as librbd names them (a RADOS client address)."""
        # librbd lists them only to a client that opened the image for writing (which
        # neither takes nor asks for the lock).
        with self.image(image, read_only=False) as img:
            return [o["owner"] for o in img.lock_get_owners()]

    def watchers(self, image):
        with self.image(image) as img:
            return [w["addr"] for w in img.watchers_list()]

    def blocklist(self):
        """The addresses `ceph osd blocklist ls` lists."""
        out = self.mon({"prefix": "osd blocklist ls", "format": "json"})
        # Pacific prints the address list and then the range list: `[...][...]`.
        entries, _ = json.JSONDecoder().raw_decode(out or "[]")
        return [e["addr"] for e in entries]

    def osd(self):
        """osd.0 as `ceph osd dump` has it: up, in, up_from, its public address."""
        dump = json.loads(self.mon({"prefix": "osd dump", "format": "json"}))
        osd = dump["osds"][0]
        return {
            "up": osd["up"],
            "up_from": osd["up_from"],
            "public_addr": osd["public_addr"],
            "epoch": dump["epoch"],
            "flags": dump.get("flags", ""),
        }

    def take_over(self, image, offset, data, blocklist):
        """What a new lock owner does to a dead one: breaks every owner's exclusive lock
        (blocklisting it first if `blocklist`, as `rbd_blocklist_on_break_lock` says),
        takes the lock, writes `data` (hex) at `offset`, and lets the lock go."""
        self.cluster.conf_set("rbd_blocklist_on_break_lock", "true" if blocklist else "false")
        try:
            with self.image(image, read_only=False) as img:
                broken = []
                for owner in img.lock_get_owners():
                    img.lock_break(owner["mode"], owner["owner"])
                    broken.append(owner["owner"])
                img.lock_acquire(rbd.RBD_LOCK_MODE_EXCLUSIVE)
                img.write(bytes.fromhex(data), offset)
                img.flush()
                img.lock_release()
                return broken
        finally:
            self.cluster.conf_set("rbd_blocklist_on_break_lock", "true")

    def hold_lock(self, image):
        """Takes `image`'s exclusive lock as another client would (an rbd-nbd mapping,
        say) and keeps it until `release_lock`; returns this client's address."""
        img = self.image(image, read_only=False)
        img.lock_acquire(rbd.RBD_LOCK_MODE_EXCLUSIVE)
        self.held[image] = img
        return self.cluster.get_addrs()

    def release_lock(self, image):
        img = self.held.pop(image)
        img.lock_release()
        img.close()

    def write_check(self):
        """A write to the pool: returns once the pool's PGs take writes."""
        self.ioctx.write_full("ublkd-test-ready-check", b"ok")
        self.ioctx.remove_object("ublkd-test-ready-check")


def main():
    conf, pool = sys.argv[1:3]
    agent = Agent(conf, pool)
    print(json.dumps({"ok": "ready"}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            op = request.pop("op")
            if op.startswith("_") or not hasattr(agent, op):
                raise ValueError(f"no such request: {op}")
            answer = {"ok": getattr(agent, op)(**request)}
        except Exception as e:  # noqa: BLE001 - every failure is the test's to show
            answer = {"err": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
