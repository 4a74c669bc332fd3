//! What a worker's sandbox really is, read by the supervisor from `/proc/<pid>` rather
//! than taken from the worker's word.

use std::path::Path;

use ublkd_proto::msg::{SandboxReport, SandboxStatus};

const NAMESPACES: [&str; 7] = ["user", "mnt", "net", "ipc", "uts", "cgroup", "pid"];

/// The sandbox of process `pid`, compared with this process's namespaces.
pub fn sandbox_of(pid: u32, reported: Option<&SandboxReport>) -> Option<SandboxStatus> {
    let proc_dir = format!("/proc/{pid}");
    let status = std::fs::read_to_string(format!("{proc_dir}/status")).ok()?;
    let mut out = parse_status(&status)?;
    out.namespaces = NAMESPACES
        .iter()
        .filter(|ns| {
            let theirs = std::fs::read_link(format!("{proc_dir}/ns/{ns}")).ok();
            let ours = std::fs::read_link(Path::new("/proc/self/ns").join(ns)).ok();
            theirs.is_some() && theirs != ours
        })
        .map(|ns| ns.to_string())
        .collect();
    out.landlock = match reported.and_then(|r| r.landlock_abi) {
        Some(abi) => format!("ABI {abi}"),
        None => "unsupported".into(),
    };
    out.missing = reported.map(|r| r.missing.clone()).unwrap_or_default();
    Some(out)
}

/// The uid, gid, seccomp mode, no_new_privs and effective capabilities in a
/// `/proc/<pid>/status` text.
pub fn parse_status(text: &str) -> Option<SandboxStatus> {
    let field = |name: &str| {
        text.lines().find_map(|l| l.strip_prefix(name)).map(|rest| rest.trim().to_string())
    };
    let first =
        |v: Option<String>| v.and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok());
    Some(SandboxStatus {
        uid: first(field("Uid:"))?,
        gid: first(field("Gid:"))?,
        namespaces: Vec::new(),
        seccomp: match field("Seccomp:").as_deref() {
            Some("2") => "filter",
            Some("1") => "strict",
            _ => "disabled",
        }
        .into(),
        no_new_privs: field("NoNewPrivs:").as_deref() == Some("1"),
        capabilities: field("CapEff:").unwrap_or_default(),
        landlock: String::new(),
        missing: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_status_fields_are_read() {
        let text = "Name:\tublkd-worker\nUid:\t65534\t65534\t65534\t65534\nGid:\t65534\t65534\t65534\t65534\n\
                    CapEff:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n";
        let s = parse_status(text).unwrap();
        assert_eq!((s.uid, s.gid), (65534, 65534));
        assert_eq!(s.seccomp, "filter");
        assert!(s.no_new_privs);
        assert_eq!(s.capabilities, "0000000000000000");
    }

    #[test]
    fn this_process_is_seen_as_unsandboxed() {
        let me = sandbox_of(std::process::id(), None).unwrap();
        assert!(me.namespaces.is_empty(), "{me:?}");
        assert_eq!(me.landlock, "unsupported");
    }
}
