//! The conventions scripts rely on (issue 48): `ublkctl`'s exit codes, each produced by
//! its real condition (an unknown device, a name taken, a mounted ext4 that `del`
//! refuses, an unprivileged user, a bad argument, no ublkd, a resize while an upgrade is
//! under way or of a device whose worker died, an add while ublkd shuts down, a worker
//! that fails to start), `--json` of every command parsed against docs/json.md, and
//! `ublkd --check-config` listing what a reload of a running ublkd would add, change
//! and remove.
//!
//! "Not supported by this kernel" (exit 4) needs a 6.12 guest: resize.rs's
//! `resize_is_refused_where_the_kernel_lacks_update_size` checks it there.
//! These tests need `/dev/ublk-control` and root: they run inside the test VM.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use ublkd_proto::uapi::UBLK_F_UPDATE_SIZE;

use ublkd_tests::harness::machine::{block_dev, kernel_features, serial};
use ublkd_tests::harness::process::{bin, run, run_ok, signal};
use ublkd_tests::harness::storage::Mount;
use ublkd_tests::harness::ublkd::Ublkd;

/// `ublkctl ARGS…` must exit `code`; its stderr.
fn exits(ublkd: &Ublkd, args: &[&str], code: i32) -> String {
    let out = ublkd.ctl(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "`ublkctl {}`: {stderr}", args.join(" "));
    stderr
}

#[test]
fn each_failure_exits_with_its_own_code() {
    let _serial = serial();
    let ublkd = Ublkd::start("conv-codes");
    let id = ublkd.add(&["-t", "null", "-s", "16M", "--name", "taken"]);
    let ids = id.to_string();

    // 9: no such device, by id and by name.
    let said = exits(&ublkd, &["del", "-n", "99"], 9);
    assert!(said.contains("no device 99"), "{said}");
    exits(&ublkd, &["status", "-n", "99"], 9);
    exits(&ublkd, &["recover", "99"], 9);
    exits(&ublkd, &["resize", "-n", "99", "-s", "32M"], 9);
    exits(&ublkd, &["del", "-n", "nosuch"], 9);

    // 10: already exists: the name, then the id.
    let said = exits(&ublkd, &["add", "-t", "null", "-s", "16M", "--name", "taken"], 10);
    assert!(said.contains("is already the name of device"), "{said}");
    exits(&ublkd, &["add", "-t", "null", "-s", "16M", "--id", &ids], 10);

    // 2: bad arguments, refused by ublkctl itself (ublkd is up, but not asked: the
    // same refusal comes with ublkd down, below).
    let said = exits(&ublkd, &["add", "-t", "rbd"], 2);
    assert!(said.contains("an rbd device needs its image"), "{said}");
    exits(&ublkd, &["add", "-t", "null", "-s", "1000"], 2);

    // 11: busy: ext4 mounted on a memory device, `del` refused, the device kept.
    let mem = ublkd.add(&["-t", "memory", "-s", "64M"]);
    let dev = block_dev(mem);
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&dev));
    let mount = Mount::new(&dev, Path::new("/tmp/conv-busy"));
    let said = exits(&ublkd, &["del", "-n", &mem.to_string()], 11);
    assert!(said.contains("in use"), "{said}");
    assert_eq!(ublkd.status_of(mem)["state"], "LIVE");
    mount.umount();
    ublkd.del(mem);

    // 5: permission denied, for a user who is not root (nobody, no groups).
    let mut as_nobody = Command::new(bin("ublkctl"));
    as_nobody.arg("--socket").arg(&ublkd.ctl.socket).arg("status");
    // SAFETY: between fork and exec the child calls only setgroups, setgid and setuid
    // (async-signal-safe), dropping its own root before it runs ublkctl.
    unsafe {
        as_nobody.pre_exec(|| {
            let nobody = 65534;
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(nobody) != 0
                || libc::setuid(nobody) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let out = run(&mut as_nobody);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "ublkctl as nobody: {stderr}");

    let socket = ublkd.ctl.socket.clone();
    ublkd.stop();
    // 8: ublkd not reachable; 2 still for a bad argument, checked before connecting.
    let ctl =
        |args: &[&str]| run(Command::new(bin("ublkctl")).arg("--socket").arg(&socket).args(args));
    let out = ctl(&["status"]);
    assert_eq!(out.status.code(), Some(8), "{}", String::from_utf8_lossy(&out.stderr));
    let out = ctl(&["add", "-t", "rbd"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

/// 12 (try again later) and 13 (the worker failed to start), each by its real condition.
/// The workers run through a wrapper that, while a marker file exists, starts the real
/// worker only after a sleep (so an upgrade stays under way) or exits 1 at once (a
/// worker that cannot start); automatic recovery is off, so a killed worker leaves its
/// device not LIVE until `ublkctl recover`.
#[test]
fn try_again_and_a_failed_worker_exit_with_their_own_codes() {
    let _serial = serial();
    let slow = Path::new("/tmp/conv-again-slow");
    let fails = Path::new("/tmp/conv-again-fails");
    let _ = std::fs::remove_file(slow);
    let _ = std::fs::remove_file(fails);
    let wrapper = Path::new("/tmp/conv-again-worker");
    // fd 3 (the worker's control socket) is closed for the sleep only.
    let script = format!(
        "#!/bin/sh\n[ -e {fails} ] && {{ echo 'conv: this worker cannot start' >&2; exit 1; }}\n\
         [ -e {slow} ] && sleep 8 3<&-\nexec {worker} \"$@\"\n",
        fails = fails.display(),
        slow = slow.display(),
        worker = bin("ublkd-worker").display()
    );
    std::fs::write(wrapper, script).unwrap();
    std::fs::set_permissions(wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let extra =
        format!("worker_binary = \"{}\"\n\n[recovery]\nrestart_max = 0\n", wrapper.display());
    let ublkd = Ublkd::start_with("conv-again", &extra, &[]);
    let id = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let ids = id.to_string();

    // 12: a resize while an upgrade of the device is under way (its new worker sleeps).
    std::fs::write(slow, b"").unwrap();
    let mut upgrade = Command::new(bin("ublkctl"))
        .arg("--socket")
        .arg(&ublkd.ctl.socket)
        .args(["upgrade", "-n", &ids])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ublkctl upgrade");
    ublkd.wait_until("the upgrade under way", || {
        ublkd.status_of(id)["note"].as_str().is_some_and(|n| n.contains("being upgraded"))
    });
    let said = exits(&ublkd, &["resize", "-n", &ids, "-s", "32M"], 12);
    assert!(said.contains("is being upgraded or resized"), "{said}");
    let out = ublkd.ctl(&["--json", "resize", "-n", &ids, "-s", "32M"]);
    assert_eq!(out.status.code(), Some(12));
    let error: Value = serde_json::from_slice(&out.stderr).expect("one JSON object");
    assert_eq!(error["error"]["kind"], "try_again", "{error}");
    std::fs::remove_file(slow).unwrap();
    let upgraded = upgrade.wait().expect("ublkctl upgrade ends");
    assert!(upgraded.success(), "the upgrade: {upgraded}");

    // 13: an add whose worker exits before it is ready, with its kind under --json.
    std::fs::write(fails, b"").unwrap();
    let said = exits(&ublkd, &["add", "-t", "null", "-s", "16M"], 13);
    assert!(said.contains("worker"), "{said}");
    let out = ublkd.ctl(&["--json", "add", "-t", "null", "-s", "16M"]);
    assert_eq!(out.status.code(), Some(13));
    let error: Value = serde_json::from_slice(&out.stderr).expect("one JSON object");
    assert_eq!(error["error"]["kind"], "worker_failed", "{error}");
    // Nothing of the failed adds is left.
    assert_eq!(ublkd.status().len(), 1, "{:?}", ublkd.status());

    // 12: a resize of a device whose worker died, with automatic recovery off.
    let worker = ublkd.worker_pid(id);
    assert!(signal(worker, libc::SIGKILL));
    ublkd.wait_until("the device not LIVE", || ublkd.status_of(id)["state"] != "LIVE");
    let said = exits(&ublkd, &["resize", "-n", &ids, "-s", "32M"], 12);
    assert!(said.contains("is not LIVE"), "{said}");
    std::fs::remove_file(fails).unwrap();
    ublkd.ctl_ok(&["recover", &ids]);
    assert_eq!(ublkd.status_of(id)["state"], "LIVE");
    ublkd.del(id);
    ublkd.stop();
}

/// 12 for a request while ublkd shuts down: its one device's worker is stopped
/// (SIGSTOP), so the shutdown's delete waits out the worker's grace before it kills it,
/// and meanwhile an add is refused as "not now".
#[test]
fn a_request_while_ublkd_shuts_down_exits_try_again() {
    let _serial = serial();
    let ublkd = Ublkd::start("conv-shutdown");
    let id = ublkd.add(&["-t", "null", "-s", "16M"]);
    let worker = ublkd.worker_pid(id);
    assert!(signal(worker, libc::SIGSTOP));
    let mut shutdown = Command::new(bin("ublkctl"))
        .arg("--socket")
        .arg(&ublkd.ctl.socket)
        .arg("shutdown")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ublkctl shutdown");
    // The shutdown has begun once its device is no longer listed (it is being deleted).
    ublkd.wait_until("the shutdown under way", || ublkd.status().is_empty());
    let said = exits(&ublkd, &["add", "-t", "null", "-s", "16M"], 12);
    assert!(said.contains("ublkd is shutting down"), "{said}");
    let done = shutdown.wait().expect("ublkctl shutdown ends");
    assert!(done.success(), "the shutdown: {done}");
    assert!(!ublkd.ctl.socket.exists());
    drop(ublkd);
}

/// The keys docs/json.md lists for `row` (`ublkctl add`, …, `an error (stderr)`).
fn documented(row: &str) -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/json.md"))
        .expect("docs/json.md");
    let line = doc
        .lines()
        .find(|l| l.starts_with(&format!("| {row} |")))
        .unwrap_or_else(|| panic!("docs/json.md has no row for {row}"));
    let keys = line.split('|').nth(2).expect("a keys cell");
    keys.split(',').map(|k| k.trim().trim_matches('`').to_string()).collect()
}

/// Every key path of `v` as docs/json.md writes them (`devices[].id`, `error.kind`),
/// not below an array's elements' own fields (`status`'s `sandbox` is one key).
fn key_paths(v: &Value) -> BTreeMap<String, ()> {
    let mut paths = BTreeMap::new();
    let Value::Object(top) = v else { panic!("not a JSON object: {v}") };
    for (k, child) in top {
        paths.insert(k.clone(), ());
        match child {
            Value::Array(items) => {
                for item in items {
                    if let Value::Object(fields) = item {
                        for f in fields.keys() {
                            paths.insert(format!("{k}[].{f}"), ());
                        }
                    }
                }
            }
            Value::Object(fields) => {
                for f in fields.keys() {
                    paths.insert(format!("{k}.{f}"), ());
                }
            }
            _ => {}
        }
    }
    paths
}

/// `text`, one JSON object, has exactly the keys docs/json.md lists for `row`, and
/// schema 1; returns it.
fn follows_schema(row: &str, text: &str) -> Value {
    let v: Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("{row}: not one JSON object ({e}): {text}"));
    assert_eq!(v["schema"], 1, "{row}: {text}");
    let have: Vec<String> = key_paths(&v).into_keys().collect();
    let mut want = documented(row);
    want.sort();
    // An empty array has no element keys: only what is there is compared.
    let want: Vec<String> = want
        .into_iter()
        .filter(|k| !k.contains("[].") || have.iter().any(|h| h.contains("[].")))
        .collect();
    assert_eq!(have, want, "{row}: the keys differ from docs/json.md: {text}");
    v
}

fn json_ok(ublkd: &Ublkd, args: &[&str]) -> String {
    let mut full = vec!["--json"];
    full.extend_from_slice(args);
    ublkd.ctl_ok(&full)
}

#[test]
fn every_command_prints_the_json_docs_json_md_documents() {
    let _serial = serial();
    let ublkd = Ublkd::start("conv-json");
    let added =
        follows_schema("`ublkctl add`", &json_ok(&ublkd, &["add", "-t", "null", "-s", "16M"]));
    let id = added["id"].as_u64().unwrap() as u32;
    assert_eq!(added["disk"], format!("/dev/ublkb{id}"));
    let ids = id.to_string();
    ublkd_tests::harness::machine::wait_for_path(&block_dev(id));

    let list = follows_schema("`ublkctl list`", &json_ok(&ublkd, &["list"]));
    assert_eq!(list["devices"][0]["id"], id);
    assert_eq!(
        (&list["devices"][0]["target"], &list["devices"][0]["read_only"]),
        (&"null".into(), &false.into())
    );
    let status = follows_schema("`ublkctl status`", &json_ok(&ublkd, &["status", "-n", &ids]));
    assert_eq!(status["devices"][0]["state"], "LIVE");
    let metrics = follows_schema("`ublkctl metrics`", &json_ok(&ublkd, &["metrics"]));
    assert_eq!(metrics["devices"][0]["target"], "null");
    let recovered = follows_schema("`ublkctl recover`", &json_ok(&ublkd, &["recover", &ids]));
    assert!(recovered["message"].as_str().unwrap().contains("nothing to recover"));
    if kernel_features() & UBLK_F_UPDATE_SIZE != 0 {
        let resized = follows_schema(
            "`ublkctl resize`",
            &json_ok(&ublkd, &["resize", "-n", &ids, "-s", "32M"]),
        );
        assert_eq!(resized["size_bytes"], 32 << 20);
    }
    let upgraded = follows_schema("`ublkctl upgrade`", &json_ok(&ublkd, &["upgrade", "-n", &ids]));
    assert_eq!(upgraded["devices"][0]["upgraded"], true, "{upgraded}");
    let features = follows_schema("`ublkctl features`", &json_ok(&ublkd, &["features"]));
    assert!(features["mask"].as_str().unwrap().starts_with("0x"));

    // An error: one object on stderr, the same exit code as without --json.
    let out: Output = ublkd.ctl(&["--json", "del", "-n", "99"]);
    assert_eq!(out.status.code(), Some(9));
    assert!(out.stdout.is_empty());
    let error = follows_schema("an error (stderr)", &String::from_utf8_lossy(&out.stderr));
    assert_eq!(error["error"]["kind"], "no_such_device");

    let deleted = follows_schema("`ublkctl del`", &json_ok(&ublkd, &["del", "-n", &ids]));
    assert_eq!(deleted["deleted"], serde_json::json!([id]));
    ublkd.add(&["-t", "null", "-s", "16M", "--id", "7"]);
    let shut = follows_schema("`ublkctl shutdown`", &json_ok(&ublkd, &["shutdown"]));
    assert_eq!(shut["deleted"], serde_json::json!([7]));
    // ublkd has exited (ublkctl waits for that): nothing is left to stop.
    assert!(!ublkd.ctl.socket.exists());
    drop(ublkd);
}

/// `ublkd --check-config ARGS…`: its exit code and stdout and stderr together.
fn check_config(path: &Path) -> (Option<i32>, String) {
    let out = run(Command::new(bin("ublkd")).arg("--check-config").arg(path));
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

#[test]
fn check_config_lists_what_a_reload_of_the_running_ublkd_would_do() {
    let _serial = serial();
    let device = |id: u32, size: &str| {
        format!("\n[[device]]\nid = {id}\ntarget = \"memory\"\nsize = \"{size}\"\n")
    };
    let kept = device(20, "16M");
    let ublkd = Ublkd::start_with(
        "conv-check",
        &format!("{kept}{}{}", device(21, "16M"), device(22, "16M")),
        &[],
    );
    let config = ublkd.config_path().to_path_buf();
    let (code, said) = check_config(&config);
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("valid, 3 device(s)"), "{said}");
    assert!(said.contains("change no device"), "{said}");

    // A file that keeps 20, changes 21's size, drops 22 and adds 23.
    let header: String = std::fs::read_to_string(&config)
        .unwrap()
        .lines()
        .take(3)
        .map(|l| format!("{l}\n"))
        .collect();
    let next = Path::new("/tmp/conv-check-next.toml");
    std::fs::write(next, format!("{header}{kept}{}{}", device(21, "32M"), device(23, "16M")))
        .unwrap();
    let (code, said) = check_config(next);
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("reloads /tmp/ublkd-test-conv-check.toml, not this file"), "{said}");
    assert!(said.contains("  add memory (id 23)"), "{said}");
    assert!(said.contains("  change device 21: memory (id 21)"), "{said}");
    assert!(said.contains("  remove device 22: memory (id 22)"), "{said}");
    assert!(!said.contains("device 20"), "{said}");
    // Nothing was done.
    let ids: Vec<u64> = ublkd.status().iter().map(|d| d["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [20, 21, 22]);

    // An error, named with its line: exit 6, as ublkd's start would.
    let bad = Path::new("/tmp/conv-check-bad.toml");
    std::fs::write(bad, format!("{header}\n[[device]]\ntarget = \"memory\"\nsize = 1000\n"))
        .unwrap();
    let (code, said) = check_config(bad);
    assert_eq!(code, Some(6), "{said}");
    assert!(said.contains("device[0].size") && said.contains("line 7"), "{said}");
    ublkd.stop();
}
