//! A real single-node Ceph cluster inside the test VM, for the rbd target's tests: one
//! mon and one bluestore OSD on a sparse file under `/run` (the guest's tmpfs), no mgr,
//! cephx on, pool [`POOL`] and the client [`CLIENT_ID`] with its own keyring, all on
//! loopback. `tests/vm/ceph-single-node.sh` builds it (its pitfalls are commented
//! there; docs/testing.md, "The rbd tests' Ceph cluster", sums it up); the requests a test makes of the
//! cluster (images, checksums, lock owners, the blocklist, mon commands) go through one
//! long-lived `/usr/bin/python3` with the rados and rbd modules
//! (`tests/vm/ceph-agent.py`), because the `ceph` and `rbd` CLIs take seconds per call
//! under the VM's emulation.
//!
//! A test binary starts one cluster per VM boot and its tests share it
//! ([`Cluster::shared`]): a start takes about 10 s in the guest (9.5–10.9 s measured).
//!
//! [`LoDelay`] holds one process's TCP segments on loopback for a while (a `netem`
//! qdisc behind a `u32` filter on their source ports): writes in flight from a client
//! that is gone by the time they arrive, as a slow network delivers them.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::process::{describe, run, signal};

/// The pool the script creates and initialises for rbd.
pub const POOL: &str = "rbd";
/// The cephx client the tests' devices connect as (`client.rbdtest`: `profile rbd` on
/// the mon, `profile rbd pool=rbd` on the OSDs, enough to blocklist a lock owner).
pub const CLIENT_ID: &str = "rbdtest";
/// Where the cluster lives in the guest (tmpfs).
pub const CEPH_DIR: &str = "/run/ublkd-test-ceph";
/// The OSD's sparse block file: bluestore, so that a kill -9 loses nothing acknowledged.
const OSD_SIZE: &str = "2G";
/// How long the script may take (about 10 s in the guest; the first start in a boot
/// loads the Ceph binaries over virtiofs, and a loaded host makes everything slower).
const START_TIMEOUT: Duration = Duration::from_secs(240);
/// How long a restarted daemon may take until it serves again.
const RESTART_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one agent request may take (its own operations time out after 120 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(180);
/// Lines of each daemon log shown when something fails.
const LOG_TAIL_LINES: usize = 40;

/// The script that builds the cluster.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/ceph-single-node.sh")
}

/// The requests' agent.
fn agent_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/ceph-agent.py")
}

/// The running cluster and its agent.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    agent: Mutex<Agent>,
    /// How long the script took to bring it up (until a write to the pool succeeded).
    pub start_time: Duration,
    /// What the script printed: its steps' times.
    pub start_log: String,
}

impl Cluster {
    /// Starts a cluster in [`CEPH_DIR`] (wiping what is there), with `conf_extra`
    /// appended to its ceph.conf, and its agent; panics with the daemons' log tails if
    /// it does not come up.
    pub fn start_with(conf_extra: &str) -> Cluster {
        let dir = PathBuf::from(CEPH_DIR);
        // The guest's init brings lo up; a host run has it up already.
        let _ = run(Command::new("ip").args(["link", "set", "lo", "up"]));
        let started = Instant::now();
        let mut cmd = Command::new("bash");
        cmd.arg(script())
            .arg("start")
            .env("CEPH_DIR", &dir)
            .env("CEPH_OSD_SIZE", OSD_SIZE)
            .env("CEPH_STORE", "bluestore")
            .env("CEPH_CONF_EXTRA", conf_extra)
            .env_remove("CEPH_CONF");
        let out = super::process::run_within(&mut cmd, START_TIMEOUT);
        let start_time = started.elapsed();
        let start_log = match out {
            Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
            Ok(out) => panic!(
                "the test cluster did not start ({}, after {start_time:?}):\n{}\n{}",
                out.status,
                describe(&out),
                log_tails(&dir)
            ),
            Err(e) => panic!("the test cluster did not start: {e}\n{}", log_tails(&dir)),
        };
        let agent = Agent::start(&dir).unwrap_or_else(|e| {
            panic!("the test cluster's agent did not start: {e}\n{}", log_tails(&dir))
        });
        Cluster { dir, agent: Mutex::new(agent), start_time, start_log }
    }

    /// [`Self::start_with`] a plain ceph.conf.
    pub fn start() -> Cluster {
        Self::start_with("")
    }

    /// The cluster of this test binary (this VM boot), started by the first test that
    /// asks; its tests share it. Each call lifts what a failed test may have left
    /// (`ceph osd pause`, a [`LoDelay`]), so that one failure does not hang the rest.
    /// (It is never stopped: the VM powers off after the test binary.)
    pub fn shared() -> &'static Cluster {
        static SHARED: OnceLock<Cluster> = OnceLock::new();
        let cluster = SHARED.get_or_init(|| {
            let cluster = Cluster::start();
            eprintln!(
                "ceph: the test cluster started in {:.1} s:\n{}",
                cluster.start_time.as_secs_f64(),
                cluster.start_log.trim_end()
            );
            cluster
        });
        LoDelay::remove_any();
        if cluster.osd()["flags"].as_str().is_some_and(|f| f.contains("pause")) {
            cluster.unpause();
        }
        cluster
    }

    /// `ublkctl add -t rbd` arguments for `image` (`POOL/IMAGE[@SNAP]`) of this cluster,
    /// as client [`CLIENT_ID`] with its keyring, then `extra`. The worker is sandboxed
    /// (its rbd profile), as every device's is by default.
    pub fn add_args(&self, image: &str, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = ["-t", "rbd", "--image", image].map(String::from).into();
        args.extend(["--ceph-conf".into(), self.conf_path().display().to_string()]);
        args.extend(["--ceph-id".into(), CLIENT_ID.into()]);
        args.extend(["--keyring".into(), self.keyring_path().display().to_string()]);
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    }

    /// `$CEPH_DIR/ceph.conf`.
    pub fn conf_path(&self) -> PathBuf {
        self.dir.join("ceph.conf")
    }

    /// [`CLIENT_ID`]'s keyring.
    pub fn keyring_path(&self) -> PathBuf {
        self.dir.join(format!("client.{CLIENT_ID}.keyring"))
    }

    /// The cluster's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `POOL/image`, as `ublkctl add --image` and the Ceph tools name it.
    pub fn spec(image: &str) -> String {
        format!("{POOL}/{image}")
    }

    /// One request to the agent; its answer, or why not.
    pub fn request(&self, request: Value) -> Result<Value, String> {
        self.agent.lock().unwrap_or_else(|p| p.into_inner()).call(&request, REQUEST_TIMEOUT)
    }

    /// One request that must succeed.
    fn ask(&self, request: Value) -> Value {
        self.request(request.clone())
            .unwrap_or_else(|e| panic!("ceph request {request}: {e}\n{}", log_tails(&self.dir)))
    }

    /// A mon command (as `ceph … --format json` sends it, e.g.
    /// `{"prefix": "osd pause"}`): its output.
    pub fn mon_command(&self, cmd: Value) -> String {
        self.ask(json!({"op": "mon", "cmd": cmd})).as_str().unwrap_or_default().to_string()
    }

    /// A new image of `size` bytes in [`POOL`], with Ceph's default features (layering,
    /// exclusive-lock, object-map, fast-diff, deep-flatten).
    pub fn create_image(&self, name: &str, size: u64) {
        self.ask(json!({"op": "create_image", "name": name, "size": size}));
    }

    /// A new image of `size` bytes in [`POOL`] with the layering feature only: no
    /// exclusive-lock, so nothing fences its writers.
    pub fn create_image_without_lock(&self, name: &str, size: u64) {
        self.ask(json!({"op": "create_image", "name": name, "size": size, "layering_only": true}));
    }

    /// The image's size in bytes, as the cluster has it now.
    pub fn image_size(&self, name: &str) -> u64 {
        self.ask(json!({"op": "size", "image": name})).as_u64().unwrap_or_default()
    }

    /// `rbd resize` of `name` to `size` bytes with the Ceph CLI, as [`CLIENT_ID`] (slow
    /// under emulation, seconds: the CLI is what an operator runs). librbd has the
    /// image's lock owner (a serving worker) carry it out.
    pub fn rbd_resize(&self, name: &str, size: u64) {
        assert_eq!(size % (1 << 20), 0, "rbd resize --size takes whole MiB here");
        let out = run(Command::new("rbd")
            .arg("--conf")
            .arg(self.conf_path())
            .args(["--id", CLIENT_ID, "--keyring"])
            .arg(self.keyring_path())
            .args(["resize", &Self::spec(name), "--size", &format!("{}M", size >> 20)]));
        assert!(out.status.success(), "rbd resize {name}: {}", describe(&out));
    }

    /// Removes the image and its snapshots.
    pub fn remove_image(&self, name: &str) {
        self.ask(json!({"op": "remove_image", "name": name}));
    }

    /// A test's cleanup, never its failure: removes the image if it can (a client that
    /// was killed may still watch it for up to 30 s), else says so.
    pub fn forget_image(&self, name: &str) {
        if let Err(e) = self.request(json!({"op": "remove_image", "name": name})) {
            eprintln!("ceph: image {name} left in the pool: {}", e.lines().next().unwrap_or(""));
        }
    }

    /// The images in [`POOL`].
    pub fn images(&self) -> Vec<String> {
        strings(&self.ask(json!({"op": "list_images"})))
    }

    pub fn create_snapshot(&self, image: &str, snapshot: &str) {
        self.ask(json!({"op": "create_snapshot", "image": image, "snapshot": snapshot}));
    }

    /// Writes `data` at `offset` of `image` (the agent's client takes the image's
    /// exclusive lock for it, and lets go after).
    pub fn write(&self, image: &str, offset: u64, data: &[u8]) {
        self.ask(json!({"op": "write", "image": image, "offset": offset, "data": hex(data)}));
    }

    /// `len` bytes at `offset` of `image` (or of its `snapshot`), read from the OSD.
    pub fn read(&self, image: &str, snapshot: Option<&str>, offset: u64, len: usize) -> Vec<u8> {
        let answer = self.ask(json!({
            "op": "read", "image": image, "snapshot": snapshot, "offset": offset, "length": len
        }));
        unhex(answer.as_str().unwrap_or_default())
    }

    /// The sha256 of the whole image (or of its snapshot), read from the OSD as
    /// `rbd export POOL/IMAGE - | sha256sum` reads it.
    pub fn export_checksum(&self, image: &str, snapshot: Option<&str>) -> String {
        let answer = self.ask(json!({"op": "checksum", "image": image, "snapshot": snapshot}));
        answer.as_str().unwrap_or_default().to_string()
    }

    /// The image's exclusive-lock owners, as librbd names them (RADOS client addresses,
    /// `127.0.0.1:0/3212945689`).
    pub fn lock_owners(&self, image: &str) -> Vec<String> {
        strings(&self.ask(json!({"op": "lock_owners", "image": image})))
    }

    /// The clients watching the image's header (each open image), by address.
    pub fn watchers(&self, image: &str) -> Vec<String> {
        strings(&self.ask(json!({"op": "watchers", "image": image})))
    }

    /// The addresses `ceph osd blocklist ls` lists.
    pub fn blocklist_ls(&self) -> Vec<String> {
        strings(&self.ask(json!({"op": "blocklist"})))
    }

    /// osd.0 as the osdmap has it: `up`, `up_from`, `public_addr`, and the map's
    /// `epoch` and `flags`.
    pub fn osd(&self) -> Value {
        self.ask(json!({"op": "osd"}))
    }

    /// `ceph osd pause`: clients hold their reads and writes (in their own process)
    /// until [`Self::unpause`].
    pub fn pause(&self) {
        self.mon_command(json!({"prefix": "osd pause"}));
    }

    pub fn unpause(&self) {
        self.mon_command(json!({"prefix": "osd unpause"}));
    }

    /// A command to osd.0's admin socket (as `ceph daemon osd.0 …` sends it, e.g.
    /// `{"prefix": "config set", "var": "debug_osd", "val": ["10"]}`): its answer, which
    /// must not be an error.
    pub fn osd_admin(&self, cmd: Value) -> String {
        let socket = self.dir.join("run/osd.0.asok");
        let answer = admin_socket(&socket, &cmd)
            .unwrap_or_else(|e| panic!("{}: {cmd}: {e}", socket.display()));
        assert!(!answer.starts_with("ERROR"), "{}: {cmd}: {answer}", socket.display());
        answer
    }

    /// osd.0's log so far.
    pub fn osd_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log/osd.0.log")).unwrap_or_default()
    }

    /// The pid a daemon (`osd.0`, `mon.a`) wrote into its pid file.
    fn daemon_pid(&self, name: &str) -> u32 {
        let file = self.dir.join(format!("run/{name}.pid"));
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}\n{}", file.display(), log_tails(&self.dir)));
        text.trim().parse().unwrap_or_else(|e| panic!("{}: {text:?}: {e}", file.display()))
    }

    /// SIGKILLs daemon `name` and waits until it is gone.
    fn kill_daemon(&self, name: &str) {
        let pid = self.daemon_pid(name);
        assert!(signal(pid, libc::SIGKILL), "{name} (pid {pid}) was not running");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !process_gone(pid) {
            assert!(Instant::now() < deadline, "{name} (pid {pid}) outlived SIGKILL by 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts daemon `program -i id` (it forks into the background and writes its pid
    /// file).
    fn start_daemon(&self, program: &str, id: &str) {
        let name = format!("{}.{id}", program.trim_start_matches("ceph-"));
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("log/{name}.stderr")))
            .unwrap();
        let status = Command::new(program)
            .args(["-i", id])
            .env("CEPH_CONF", self.conf_path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        assert!(status.success(), "{program} -i {id}: {status}\n{}", log_tails(&self.dir));
    }

    /// kill -9 of osd.0, and a start again; returns once the osdmap has it up in a new
    /// incarnation and a write to the pool has succeeded (its PGs are active). Clients
    /// with I/O in flight stall meanwhile and resume (librbd retries; nothing fails).
    pub fn restart_osd(&self) -> Duration {
        let before = self.osd()["up_from"].as_u64().unwrap_or(0);
        let started = Instant::now();
        self.kill_daemon("osd.0");
        // Nobody reports a lone OSD's death: the mon would mark it down only when the
        // new incarnation boots, which then has to boot again (~10 s more in the VM).
        self.mon_command(json!({"prefix": "osd down", "ids": ["0"]}));
        self.start_daemon("ceph-osd", "0");
        self.wait_osd_up_after(before);
        started.elapsed()
    }

    /// The whole cluster away: kill -9 of mon.a and osd.0, `meanwhile` run with both
    /// down, then both started again; returns once the OSD is up in a new incarnation
    /// and a write to the pool has succeeded.
    pub fn away(&self, meanwhile: impl FnOnce()) {
        let before = self.osd()["up_from"].as_u64().unwrap_or(0);
        self.kill_daemon("osd.0");
        self.kill_daemon("mon.a");
        meanwhile();
        self.start_daemon("ceph-mon", "a");
        self.wait_mon_answers();
        // As in `restart_osd`: nobody reported the OSD's death.
        self.mon_command(json!({"prefix": "osd down", "ids": ["0"]}));
        self.start_daemon("ceph-osd", "0");
        self.wait_osd_up_after(before);
    }

    /// Waits until osd.0 is up in an incarnation newer than `before` (its `up_from`)
    /// and a write to the pool has succeeded (its PGs are active).
    fn wait_osd_up_after(&self, before: u64) {
        let deadline = Instant::now() + RESTART_TIMEOUT;
        loop {
            let osd = self.osd();
            if osd["up"] == 1 && osd["up_from"].as_u64().unwrap_or(0) > before {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "osd.0 not up again within {RESTART_TIMEOUT:?}: {osd}\n{}",
                log_tails(&self.dir)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        self.ask(json!({"op": "write_check"}));
    }

    /// kill -9 of mon.a, and a start again; returns once it answers a command. Running
    /// I/O does not notice; new clients wait for it meanwhile.
    pub fn restart_mon(&self) -> Duration {
        let started = Instant::now();
        self.kill_daemon("mon.a");
        self.start_daemon("ceph-mon", "a");
        self.wait_mon_answers();
        started.elapsed()
    }

    /// Waits until mon.a (started again) answers a command.
    fn wait_mon_answers(&self) {
        let deadline = Instant::now() + RESTART_TIMEOUT;
        while let Err(e) = self.request(json!({"op": "osd"})) {
            assert!(
                Instant::now() < deadline,
                "mon.a not answering within {RESTART_TIMEOUT:?} of its restart: {e}\n{}",
                log_tails(&self.dir)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The last lines of each daemon's logs, for a failure message.
    pub fn log_tails(&self) -> String {
        log_tails(&self.dir)
    }

    /// Stops the agent and both daemons.
    pub fn stop(self) {
        drop(self.agent);
        let out = run(Command::new("bash").arg(script()).arg("stop").env("CEPH_DIR", &self.dir));
        assert!(out.status.success(), "ceph-single-node.sh stop: {}", describe(&out));
    }
}

/// A JSON array of strings.
fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

fn hex(data: &[u8]) -> String {
    data.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("hex from the agent"))
        .collect()
}

/// Whether process `pid` has ended (no `/proc` entry, or a zombie: a daemon's parent is
/// the guest's init, which may reap it late).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name's closing parenthesis.
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// The last [`LOG_TAIL_LINES`] lines of each of the cluster's logs in `dir`.
fn log_tails(dir: &Path) -> String {
    let mut out = String::new();
    let logs = [
        "log/mon.a.log",
        "log/mon.a.stderr",
        "log/osd.0.log",
        "log/osd.0.stderr",
        "log/osd.0.mkfs.out",
        "log/agent.stderr",
    ];
    for log in logs {
        let Ok(text) = std::fs::read_to_string(dir.join(log)) else { continue };
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
        out.push_str(&format!("--- {}/{log} (last {} lines)\n", dir.display(), tail.len()));
        for line in tail {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// One command to a Ceph daemon's admin socket: the command as JSON and a NUL; the
/// answer is a 4-byte big-endian length and that many bytes.
fn admin_socket(socket: &Path, cmd: &Value) -> Result<String, String> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let mut request = cmd.to_string().into_bytes();
    request.push(0);
    stream.write_all(&request).map_err(|e| e.to_string())?;
    let mut len = [0; 4];
    stream.read_exact(&mut len).map_err(|e| format!("the answer's length: {e}"))?;
    let mut answer = vec![0; u32::from_be_bytes(len) as usize];
    stream.read_exact(&mut answer).map_err(|e| format!("the answer: {e}"))?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// `tests/vm/ceph-agent.py`, connected as client.admin: one JSON request per line on its
/// stdin, one JSON answer per line on its stdout (read by a thread, so that a request
/// can time out).
#[derive(Debug)]
struct Agent {
    child: Child,
    stdin: ChildStdin,
    answers: Receiver<String>,
}

impl Agent {
    fn start(dir: &Path) -> Result<Agent, String> {
        let stderr = std::fs::File::create(dir.join("log/agent.stderr")).unwrap();
        let mut child = Command::new("/usr/bin/python3")
            .arg(agent_script())
            .arg(dir.join("ceph.conf"))
            .arg(POOL)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot run /usr/bin/python3: {e}"))?;
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut agent = Agent { child, stdin, answers };
        agent.answer(Duration::from_secs(120))?;
        Ok(agent)
    }

    fn call(&mut self, request: &Value, timeout: Duration) -> Result<Value, String> {
        writeln!(self.stdin, "{request}").map_err(|e| format!("the agent is gone: {e}"))?;
        self.answer(timeout)
    }

    fn answer(&mut self, timeout: Duration) -> Result<Value, String> {
        let line = match self.answers.recv_timeout(timeout) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                return Err(format!("the agent did not answer within {timeout:?}"));
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.try_wait();
                return Err(format!("the agent exited ({status:?})"));
            }
        };
        let answer: Value =
            serde_json::from_str(&line).map_err(|e| format!("the agent said {line:?}: {e}"))?;
        match (answer.get("ok"), answer.get("err")) {
            (Some(ok), _) => Ok(ok.clone()),
            (_, Some(err)) => Err(format!("{}\n{}", err, answer["trace"].as_str().unwrap_or(""))),
            _ => Err(format!("the agent said {line:?}")),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The TCP connections process `pid` holds, as (local port, remote port) pairs: its
/// socket fds matched against its `/proc/PID/net/tcp` by inode.
pub fn tcp_connections(pid: u32) -> Vec<(u16, u16)> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|t| {
                    let t = t.to_string_lossy().into_owned();
                    Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next()?, 16).ok();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // state 01: established
            (f.len() > 9 && f[3] == "01" && inodes.iter().any(|i| i == f[9]))
                .then(|| Some((port(f[1])?, port(f[2])?)))
                .flatten()
        })
        .collect()
}

/// The TCP ports osd.0 listens on (public and cluster messengers, v1 and v2).
pub fn osd_ports(cluster: &Cluster) -> Vec<u16> {
    let pid = cluster.daemon_pid("osd.0");
    let mut inodes = Vec::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in fds.flatten() {
            if let Ok(t) = std::fs::read_link(e.path())
                && let Some(i) = t.to_string_lossy().strip_prefix("socket:[")
            {
                inodes.push(i.trim_end_matches(']').to_string());
            }
        }
    }
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // state 0A: listening
            (f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]))
                .then(|| u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok())
                .flatten()
        })
        .collect()
}

/// Delays on loopback every TCP segment sent from a set of local ports by a fixed time:
/// a `prio` qdisc as lo's root, whose fourth band (no traffic of its own: the priomap
/// never picks it) is a `netem` qdisc, and a `u32` filter per port sending that
/// port's segments there. What is queued in netem is the kernel's, not the sender's:
/// it is delivered when its time comes even if the process that wrote it was killed
/// meanwhile (its retransmissions queue behind it, delayed alike). Removed on drop.
///
/// Needs `sch_prio`, `sch_netem` and `cls_u32` (in the guest's module tree, see
/// `tests/src/kernel.rs`'s `GUEST_MODULES`) and `tc`.
#[derive(Debug)]
pub struct LoDelay {
    pub delay: Duration,
}

impl LoDelay {
    /// Segments from any of `ports` (source port, loopback) are delayed by `delay`.
    pub fn new(ports: &[u16], delay: Duration) -> LoDelay {
        Self::remove_any();
        for module in ["sch_prio", "sch_netem", "cls_u32"] {
            let _ = run(Command::new("modprobe").arg(module));
        }
        // Four bands, the default priomap over the first three: the fourth gets nothing
        // but what the filters send there.
        let priomap = "1 2 2 2 1 2 0 0 1 1 1 1 1 1 1 1".split(' ');
        tc(&["qdisc", "add", "dev", "lo", "root", "handle", "1:", "prio", "bands", "4", "priomap"]
            .into_iter()
            .chain(priomap)
            .collect::<Vec<_>>());
        let ms = format!("{}ms", delay.as_millis());
        // The limit counts packets: retransmissions of what is held queue up too.
        tc(&["qdisc", "add", "dev", "lo", "parent", "1:4", "handle", "30:", "netem", "delay"]
            .into_iter()
            .chain([ms.as_str(), "limit", "100000"])
            .collect::<Vec<_>>());
        let delay = LoDelay { delay };
        for port in ports {
            delay.add_port(*port);
        }
        delay
    }

    /// Segments from `port` are delayed too, from now on.
    pub fn add_port(&self, port: u16) {
        let port = port.to_string();
        tc(&[
            "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "sport", &port, "0xffff", "flowid", "1:4",
        ]);
    }

    /// What netem holds now (bytes, packets) and the packets it has sent on so far.
    pub fn held(&self) -> (u64, u64, u64) {
        let out = run(Command::new("tc").args(["-s", "qdisc", "show", "dev", "lo"]));
        netem_stats(&String::from_utf8_lossy(&out.stdout))
    }

    /// Removes lo's root qdisc, whatever is there (what a failed test left).
    pub fn remove_any() {
        let _ = run(Command::new("tc").args(["qdisc", "del", "dev", "lo", "root"]));
    }
}

impl Drop for LoDelay {
    fn drop(&mut self) {
        Self::remove_any();
    }
}

/// From `tc -s qdisc show`, netem 30:'s backlog (bytes, packets) and the packets it sent:
///
/// ```text
/// qdisc netem 30: parent 1:4 limit 100000 delay 20s
///  Sent 4242 bytes 3 pkt (dropped 0, overlimits 0 requeues 0)
///  backlog 4586b 3p requeues 0
/// ```
fn netem_stats(text: &str) -> (u64, u64, u64) {
    let Some(at) = text.find("qdisc netem 30:") else { return (0, 0, 0) };
    let block = &text[at + 1..];
    let block = block.find("qdisc ").map_or(block, |end| &block[..end]);
    let words: Vec<&str> = block.split_whitespace().collect();
    let after = |key: &str, n: usize| {
        words.iter().position(|w| *w == key).and_then(|i| words.get(i + n)).copied()
    };
    let sent = after("Sent", 3).and_then(|p| p.parse().ok()).unwrap_or(0);
    let bytes = after("backlog", 1).map_or(0, |b| parse_size(b.trim_end_matches('b')));
    let packets = after("backlog", 2).and_then(|p| p.trim_end_matches('p').parse().ok());
    (bytes, packets.unwrap_or(0), sent)
}

/// `tc` prints sizes as `4586b`, `12Kb`, `3Mb` (here without the `b`).
fn parse_size(text: &str) -> u64 {
    let (digits, unit): (String, String) = text.chars().partition(|c| c.is_ascii_digit());
    let n: u64 = digits.parse().unwrap_or(0);
    match unit.as_str() {
        "K" => n << 10,
        "M" => n << 20,
        _ => n,
    }
}

fn tc(args: &[&str]) {
    let out = run(Command::new("tc").args(args));
    assert!(out.status.success(), "tc {}: {}", args.join(" "), describe(&out));
}
