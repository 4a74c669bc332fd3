//! What the guest runs, written into the run directory (which the guest reads through
//! virtiofs at the same path):
//!
//! - `params`: sourced by the guest's busybox `/init` before the switch into the host's root (`CHECK_BIN`, the
//!   host path of the `ublkd-vm` binary that performs `guest-check`, and `CHECK_KERNEL`,
//!   the kernel series booted, which decides what `guest-check` requires);
//! - `cmd.sh`: run by the host's `/bin/sh` inside the guest: exports the forwarded
//!   environment, [`KERNEL_DIR_VAR`] (added by `vm::run`) and `UBLKD_VM_GUEST=1`, enters
//!   the host's cwd and `exec`s the command.
//!
//! Only a few variables cross into the guest ([`FORWARDED_VARS`], and the
//! [`FORWARDED_PREFIXES`] families; `TERM` only if the host's stdout is a terminal, see
//! [`fit_term`]); every value is single-quoted, so arguments and values may hold spaces,
//! quotes, newlines or any other byte but NUL.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::exit;
use crate::kernel::Series;

/// Variables forwarded by exact name.
pub const FORWARDED_VARS: &[&str] = &["PATH", "HOME", "TERM", "RUST_BACKTRACE", "RUST_LOG"];
/// Variables forwarded by prefix.
pub const FORWARDED_PREFIXES: &[&str] = &["CARGO_", "RUST_", "UBLKD_"];
/// Set in the guest so that tests can tell where they run.
pub const GUEST_MARKER_VAR: &str = "UBLKD_VM_GUEST";
/// Set in the guest to the booted kernel's cache directory (the guest sees it at the
/// same path), where optional modules such as `nbd.ko` are: `insmod
/// "$UBLKD_VM_KERNEL_DIR/nbd.ko"` (see [`crate::kernel::Kernel::nbd_module`]). Its
/// `modules/` tree (kernel TLS's modules, see [`crate::kernel::Kernel::modules_base`]) is
/// what the guest's `/lib/modules/$(uname -r)` points at: those load with `modprobe` or on
/// the kernel's own request, no `insmod` needed.
pub const KERNEL_DIR_VAR: &str = "UBLKD_VM_KERNEL_DIR";

/// The forwarded subset of `vars`, sorted by name. Names that are not shell
/// identifiers are skipped (they cannot be exported from a script).
pub fn forwarded_env(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
) -> Vec<(String, OsString)> {
    let mut out: Vec<(String, OsString)> = vars
        .into_iter()
        .filter_map(|(name, value)| {
            let name = name.into_string().ok()?;
            let wanted = FORWARDED_VARS.contains(&name.as_str())
                || FORWARDED_PREFIXES.iter().any(|p| name.starts_with(p));
            (wanted && is_identifier(&name)).then_some((name, value))
        })
        .collect();
    out.sort();
    out
}

/// Makes `TERM` fit where the guest's output ends up: the guest's stdout is always a
/// tty (the serial console), so programs there would colour their output even when the
/// host's stdout is a pipe or a log file. `TERM` is forwarded only when the host's
/// stdout is a terminal; otherwise the guest gets `TERM=dumb`.
pub fn fit_term(env: &mut Vec<(String, OsString)>, host_stdout_is_tty: bool) {
    if host_stdout_is_tty {
        return;
    }
    env.retain(|(name, _)| name != "TERM");
    env.push(("TERM".to_owned(), "dumb".into()));
    env.sort();
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `value` as one POSIX shell word: single-quoted, each `'` written as `'\''`.
pub fn shell_quote(value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() + 2);
    out.push(b'\'');
    for &b in value {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    out
}

/// The command the guest runs, where, and with what environment.
#[derive(Debug, Clone)]
pub struct GuestCommand {
    /// Program and arguments (the program is looked up in the forwarded `PATH`).
    pub argv: Vec<OsString>,
    /// Working directory (a host path; the guest sees the host's root).
    pub cwd: std::path::PathBuf,
    /// Forwarded environment, from [`forwarded_env`].
    pub env: Vec<(String, OsString)>,
}

/// `cmd.sh` for `cmd`.
pub fn command_script(cmd: &GuestCommand) -> Vec<u8> {
    let mut s =
        b"# ublkd-vm: the guest command (run by the host's /bin/sh inside the guest)\n".to_vec();
    for (name, value) in &cmd.env {
        push_export(&mut s, name, value);
    }
    push_export(&mut s, GUEST_MARKER_VAR, OsStr::new("1"));
    let cwd = shell_quote(cmd.cwd.as_os_str().as_bytes());
    s.extend_from_slice(b"cd ");
    s.extend_from_slice(&cwd);
    s.extend_from_slice(b" || { printf 'ublkd-vm: cannot enter %s in the guest\\n' ");
    s.extend_from_slice(&cwd);
    s.extend_from_slice(format!(" >&2; exit {}; }}\n", exit::SETUP_FAILED).as_bytes());
    s.extend_from_slice(b"exec");
    for arg in &cmd.argv {
        s.push(b' ');
        s.extend_from_slice(&shell_quote(arg.as_bytes()));
    }
    s.push(b'\n');
    s
}

fn push_export(s: &mut Vec<u8>, name: &str, value: &OsStr) {
    s.extend_from_slice(b"export ");
    s.extend_from_slice(name.as_bytes());
    s.push(b'=');
    s.extend_from_slice(&shell_quote(value.as_bytes()));
    s.push(b'\n');
}

/// `params` for the guest's `/init`: the `ublkd-vm` binary that runs `guest-check`.
pub fn params_script(check_bin: &Path, series: Series) -> Vec<u8> {
    let mut s = b"# ublkd-vm: parameters for the guest's /init (sourced by busybox sh)\n".to_vec();
    s.extend_from_slice(b"CHECK_BIN=");
    s.extend_from_slice(&shell_quote(check_bin.as_os_str().as_bytes()));
    s.push(b'\n');
    s.extend_from_slice(b"CHECK_KERNEL=");
    s.extend_from_slice(&shell_quote(series.name().as_bytes()));
    s.push(b'\n');
    s
}

/// Sets `name` to `value` in a forwarded environment (replacing a forwarded value), so
/// that the guest command sees what the harness decided rather than what the caller's
/// environment said.
pub fn set_var(env: &mut Vec<(String, OsString)>, name: &str, value: &str) {
    env.retain(|(n, _)| n != name);
    env.push((name.to_owned(), value.into()));
    env.sort();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn os(s: &str) -> OsString {
        s.into()
    }

    #[test]
    fn env_filter_keeps_listed_names_and_prefixes_only() {
        let vars = [
            ("PATH", "/usr/bin"),
            ("HOME", "/root"),
            ("CARGO_MANIFEST_DIR", "/work"),
            ("RUST_TEST_THREADS", "1"),
            ("UBLKD_VM_TIMEOUT", "5"),
            ("RUST_LOG", "debug"),
            ("LD_PRELOAD", "/evil.so"),
            ("SSH_AUTH_SOCK", "/tmp/x"),
            ("CARGO", "/usr/bin/cargo"),
            ("CARGO_BAD-NAME", "x"),
            ("PATHX", "y"),
        ]
        .map(|(n, v)| (os(n), os(v)));
        let names: Vec<String> = forwarded_env(vars).into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "CARGO_MANIFEST_DIR",
                "HOME",
                "PATH",
                "RUST_LOG",
                "RUST_TEST_THREADS",
                "UBLKD_VM_TIMEOUT"
            ]
        );
    }

    #[test]
    fn term_is_forwarded_to_a_tty_and_dumb_for_a_pipe() {
        let env = vec![("PATH".to_owned(), os("/bin")), ("TERM".to_owned(), os("xterm-256color"))];
        let mut tty = env.clone();
        fit_term(&mut tty, true);
        assert_eq!(tty, env);
        let mut pipe = env.clone();
        fit_term(&mut pipe, false);
        assert_eq!(pipe, [("PATH".to_owned(), os("/bin")), ("TERM".to_owned(), os("dumb"))]);
        let mut none = vec![];
        fit_term(&mut none, false);
        assert_eq!(none, [("TERM".to_owned(), os("dumb"))]);
    }

    #[test]
    fn shell_quote_wraps_and_escapes_single_quotes() {
        assert_eq!(shell_quote(b"a b"), b"'a b'");
        assert_eq!(shell_quote(b"it's"), b"'it'\\''s'");
        assert_eq!(shell_quote(b""), b"''");
    }

    /// The generated script, run by the real `/bin/sh` with `exec` replaced by `printf`,
    /// reproduces every argument and value byte for byte.
    #[test]
    fn command_script_round_trips_awkward_args_through_sh() {
        let argv = ["a b", "it's", "\"dq\"", "$HOME", "`x`", "back\\slash", "new\nline", ""]
            .map(os)
            .to_vec();
        let cmd = GuestCommand {
            argv: argv.clone(),
            cwd: "/".into(),
            env: vec![("RUST_LOG".into(), os("x 'y' $z"))],
        };
        let script = command_script(&cmd);
        let text = String::from_utf8(script).unwrap();
        assert!(text.contains("export UBLKD_VM_GUEST='1'\n"));
        assert_eq!(text.matches("\nexec ").count(), 1);
        let probe = text.replacen("\nexec ", "\nprintf '%s\\0' \"$RUST_LOG\" \"$PWD\" ", 1);
        let out = Command::new("/bin/sh").arg("-c").arg(&probe).env_clear().output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let words: Vec<&[u8]> = out.stdout.split(|&b| b == 0).collect();
        assert_eq!(words[0], b"x 'y' $z");
        assert_eq!(words[1], b"/");
        for (got, want) in words[2..].iter().zip(&argv) {
            assert_eq!(*got, want.as_bytes());
        }
        assert_eq!(words.len(), 2 + argv.len() + 1); // trailing empty piece after the last NUL
    }

    #[test]
    fn missing_cwd_exits_with_setup_code() {
        let cmd =
            GuestCommand { argv: vec![os("true")], cwd: "/nonexistent dir/x".into(), env: vec![] };
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(OsStr::from_bytes(&command_script(&cmd)))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(i32::from(exit::SETUP_FAILED)));
        assert!(String::from_utf8_lossy(&out.stderr).contains("cannot enter /nonexistent dir/x"));
    }

    #[test]
    fn params_script_quotes_the_check_binary_and_names_the_series() {
        let s = params_script(Path::new("/work/it's/ublkd-vm"), Series::Lts6_12);
        let mut lines = s.split(|&b| b == b'\n').skip(1);
        assert_eq!(lines.next().unwrap(), b"CHECK_BIN='/work/it'\\''s/ublkd-vm'");
        assert_eq!(lines.next().unwrap(), b"CHECK_KERNEL='6.12'");
    }

    #[test]
    fn set_var_replaces_a_forwarded_value_and_keeps_the_order() {
        let mut env = vec![("A".to_owned(), os("1")), ("UBLKD_VM_KERNEL".to_owned(), os("7"))];
        set_var(&mut env, "UBLKD_VM_KERNEL", "6.12");
        set_var(&mut env, "B", "2");
        assert_eq!(
            env,
            [
                ("A".to_owned(), os("1")),
                ("B".to_owned(), os("2")),
                ("UBLKD_VM_KERNEL".to_owned(), os("6.12"))
            ]
        );
    }
}
