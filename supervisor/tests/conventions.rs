//! `ublkctl`'s and `ublkd`'s conventions that need no kernel, run on the built binaries:
//! a bad argument exits 2 before ublkd is asked, an unreachable ublkd 8 (as JSON under
//! `--json`), an error answer's kind its own code and an older ublkd's bare error 1
//! (from a fake ublkd here), and `ublkd --check-config` on a good and a bad file. The
//! conditions that need devices are in tests/tests/conventions.rs (in the VM).

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::thread::JoinHandle;

use ublkd_proto::msg::{self, CtlRequest, CtlResponse, ErrorKind};

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ublkd-conv-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn ublkctl(socket: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ublkctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_bad_argument_exits_2_before_ublkd_is_asked() {
    let socket = scratch("bad-arg").join("none.sock");
    let out = ublkctl(&socket, &["add", "-t", "rbd"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("an rbd device needs its image"), "{}", text(&out.stderr));
    // The config crate's rule (a size is a multiple of the block size), not ublkctl's.
    let out = ublkctl(&socket, &["add", "-t", "null", "-s", "1000"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("cannot reach ublkd"), "{}", text(&out.stderr));
}

#[test]
fn an_unreachable_ublkd_exits_8_and_says_so_in_json_on_stderr() {
    let socket = scratch("unreachable").join("none.sock");
    let out = ublkctl(&socket, &["status"]);
    assert_eq!(out.status.code(), Some(8), "{}", text(&out.stderr));
    let out = ublkctl(&socket, &["--json", "del", "-n", "0"]);
    assert_eq!(out.status.code(), Some(8));
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    let error: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(error["schema"], 1);
    assert_eq!(error["error"]["kind"], "ublkd_unreachable");
    assert!(error["error"]["message"].as_str().unwrap().contains("cannot reach ublkd"));
}

/// A fake ublkd on `socket` answering each of `answers` to one connection, in turn;
/// returns the requests it got.
fn fake_ublkd(socket: &Path, answers: Vec<CtlResponse>) -> JoinHandle<Vec<CtlRequest>> {
    let listener = UnixListener::bind(socket).unwrap();
    std::thread::spawn(move || {
        let mut got = Vec::new();
        for answer in answers {
            let (mut conn, _) = listener.accept().unwrap();
            got.push(msg::read_frame::<CtlRequest>(&mut conn).unwrap());
            msg::write_response(&mut conn, &answer).unwrap();
        }
        got
    })
}

#[test]
fn an_error_answer_exits_with_its_kinds_code() {
    let cases = [
        (ErrorKind::NoSuchDevice, 9, "no_such_device"),
        (ErrorKind::AlreadyExists, 10, "already_exists"),
        (ErrorKind::Busy, 11, "busy"),
        (ErrorKind::NotSupported, 4, "not_supported"),
        (ErrorKind::BadArgument, 2, "bad_argument"),
        (ErrorKind::PermissionDenied, 5, "permission_denied"),
        (ErrorKind::Other, 1, "other"),
    ];
    let dir = scratch("kinds");
    for (i, (kind, code, name)) in cases.into_iter().enumerate() {
        let socket = dir.join(format!("{i}.sock"));
        let message = format!("the {name} refusal");
        let fake =
            fake_ublkd(&socket, vec![CtlResponse::Failed { kind, message: message.clone() }]);
        let out = ublkctl(&socket, &["--json", "del", "-n", "3"]);
        assert_eq!(out.status.code(), Some(code), "{kind:?}: {}", text(&out.stderr));
        let error: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
        assert_eq!(error["error"]["kind"], name);
        assert_eq!(error["error"]["message"], message);
        let got = fake.join().unwrap();
        let asked = CtlRequest::WithKinds(Box::new(CtlRequest::Del { id: Some(3) }));
        assert_eq!(got, [asked]);
    }
}

#[test]
fn an_older_ublkd_is_asked_again_bare_and_its_errors_exit_1() {
    let socket = scratch("older").join("ublkd.sock");
    // What an older ublkd answers a request it cannot decode, then its own error.
    let fake = fake_ublkd(
        &socket,
        vec![
            CtlResponse::Error { message: "bad request: a message could not be decoded".into() },
            CtlResponse::Error { message: "no device 3: ublkd serves no devices".into() },
        ],
    );
    let out = ublkctl(&socket, &["del", "-n", "3"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("no device 3"), "{}", text(&out.stderr));
    let got = fake.join().unwrap();
    assert!(matches!(got[0], CtlRequest::WithKinds(_)), "{got:?}");
    assert_eq!(got[1], CtlRequest::Del { id: Some(3) });

    // And its answers that are no error are taken as they come.
    let socket = scratch("older-ok").join("ublkd.sock");
    let fake = fake_ublkd(
        &socket,
        vec![
            CtlResponse::Error { message: "bad request: a message could not be decoded".into() },
            CtlResponse::Deleted { ids: vec![3] },
        ],
    );
    let out = ublkctl(&socket, &["--json", "del", "-n", "3"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let deleted: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(deleted["deleted"], serde_json::json!([3]));
    fake.join().unwrap();
}

/// `ublkd --check-config FILE` with `text` in FILE (its socket in `dir`).
fn check_config(dir: &Path, text_after_daemon: &str) -> (Option<i32>, String) {
    let file = dir.join("ublkd.toml");
    let head = format!(
        "[daemon]\nsocket = \"{}\"\nstate_dir = \"{}\"\n",
        dir.join("ublkd.sock").display(),
        dir.join("state").display()
    );
    std::fs::write(&file, format!("{head}{text_after_daemon}")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ublkd"))
        .arg("--check-config")
        .arg(&file)
        .output()
        .unwrap();
    (out.status.code(), format!("{}{}", text(&out.stdout), text(&out.stderr)))
}

#[test]
fn check_config_passes_a_good_file_and_names_a_bad_ones_line() {
    let dir = scratch("check");
    let (code, said) =
        check_config(&dir, "\n[[device]]\ntarget = \"null\"\nsize = \"16M\"\nname = \"a\"\n");
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("valid, 1 device(s)"), "{said}");
    // The same rule a start applies: a size is a multiple of the block size.
    let (code, said) = check_config(&dir, "\n[[device]]\ntarget = \"null\"\nsize = 1000\n");
    assert_eq!(code, Some(6), "{said}");
    assert!(said.contains("device[0].size") && said.contains("line 7"), "{said}");
    let (code, said) = check_config(&dir, "\n[[device]]\ntarget = \"nul\"\n");
    assert_eq!(code, Some(6), "{said}");
    assert!(said.contains("line 6"), "{said}");
    let missing = dir.join("missing.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_ublkd"))
        .arg("--check-config")
        .arg(&missing)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(6), "{}", text(&out.stderr));
}
