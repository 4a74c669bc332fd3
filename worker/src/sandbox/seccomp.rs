//! Step 10 of the sandbox and its stage 2: the seccomp filters built from
//! [`super::policy`]'s lists (stage 1 at [`super::apply`], stage 2 at [`lock_down`]),
//! an rbd worker's filters that refuse [`policy::RBD_REFUSED`] with an error, and the
//! SIGSYS handler that names a trapped call before the worker exits
//! [`super::EXIT_SECCOMP`].

use std::collections::BTreeMap;

use nix::errno::Errno;
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, SeccompRule, TargetArch};

use super::{EXIT_SECCOMP, Profile, SandboxError, policy, step_failed};

/// On a trapped system call: say which, with its first three arguments (what an
/// argument filter looked at), and exit with [`EXIT_SECCOMP`].
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // siginfo_t for SIGSYS carries the syscall number at byte offset 24 on x86_64
    // (`si_syscall`, after si_call_addr), which the libc crate does not expose.
    // SAFETY: the kernel passes a valid siginfo_t for a SA_SIGINFO handler.
    let nr = unsafe { *(info.cast::<u8>().add(24).cast::<libc::c_int>()) };
    // SAFETY: for a SA_SIGINFO handler the third argument is the interrupted context;
    // at a seccomp trap its registers hold the system call's arguments.
    let gregs = unsafe { (*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs };
    let args = [libc::REG_RDI, libc::REG_RSI, libc::REG_RDX].map(|r| gregs[r as usize] as u64);
    let mut msg = [0u8; 128];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        msg[len..len + bytes.len()].copy_from_slice(bytes);
        len += bytes.len();
    };
    put(b"ublkd-worker: sandbox: blocked system call ");
    let mut digits = [b'0'; 4];
    let mut n = nr.unsigned_abs();
    for d in digits.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    put(&digits);
    put(b" (args");
    for arg in args {
        let mut hex = *b" 0x0000000000000000";
        for (i, h) in hex[3..].iter_mut().enumerate() {
            *h = b"0123456789abcdef"[((arg >> (60 - 4 * i)) & 0xf) as usize];
        }
        put(&hex);
    }
    put(b")\n");
    // SAFETY: write and _exit are async-signal-safe; `msg[..len]` is initialised.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), len);
        libc::_exit(EXIT_SECCOMP);
    }
}

pub(super) fn install_sigsys_handler() -> Result<(), SandboxError> {
    // SAFETY: a zeroed sigaction is valid; we set the handler and flags below.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = on_sigsys;
    sa.sa_sigaction = handler as usize;
    sa.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `sa` is a valid sigaction for the call; the handler is async-signal-safe.
    let rc = unsafe { libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) };
    if rc < 0 { Err(step_failed("sigaction(SIGSYS)")(Errno::last())) } else { Ok(()) }
}

/// The seccomp rule that lets through the calls `only` describes (`None`: all).
fn rule_of(only: policy::Only) -> Result<Option<Vec<SeccompRule>>, SandboxError> {
    use seccompiler::{SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond};
    let err = SandboxError::SeccompFilter;
    let one = |arg: u8, len: Len, op: Op, value: u64| -> Result<SeccompRule, SandboxError> {
        SeccompRule::new(vec![Cond::new(arg, len, op, value).map_err(err)?]).map_err(err)
    };
    Ok(Some(match only {
        policy::Only::Any => return Ok(None),
        policy::Only::ArgIn { arg, values } => {
            values.iter().map(|&v| one(arg, Len::Dword, Op::Eq, v)).collect::<Result<_, _>>()?
        }
        policy::Only::ArgLacks { arg, mask } => vec![one(arg, Len::Qword, Op::MaskedEq(mask), 0)?],
        policy::Only::ArgHas { arg, mask } => {
            vec![one(arg, Len::Qword, Op::MaskedEq(mask), mask)?]
        }
        policy::Only::ArgMasked { arg, mask, value } => {
            vec![one(arg, Len::Qword, Op::MaskedEq(mask), value)?]
        }
        policy::Only::ArgMaskedIn { arg, mask, values } => values
            .iter()
            .map(|&v| one(arg, Len::Dword, Op::MaskedEq(mask), v))
            .collect::<Result<_, _>>()?,
        // One rule whose conditions all hold: the argument differs from each value.
        policy::Only::ArgNotIn { arg, values } => {
            let conds = values
                .iter()
                .map(|&v| Cond::new(arg, Len::Dword, Op::Ne, v).map_err(err))
                .collect::<Result<_, _>>()?;
            vec![SeccompRule::new(conds).map_err(err)?]
        }
    }))
}

fn filter(setup: bool, profile: Profile) -> Result<BpfProgram, SandboxError> {
    // Per system call: `None` once any entry allows every call, else the union of the
    // entries' rules.
    let mut allowed: BTreeMap<i64, Option<Vec<SeccompRule>>> = BTreeMap::new();
    let mut lists: Vec<&[policy::Allowed]> = vec![policy::ALWAYS];
    if setup {
        lists.push(policy::SETUP_ONLY);
    }
    if profile == Profile::Rbd {
        lists.push(policy::RBD_ALWAYS);
    }
    for a in lists.iter().flat_map(|l| l.iter()) {
        let rule = rule_of(a.only)?;
        match (allowed.entry(a.nr).or_insert_with(|| Some(Vec::new())), rule) {
            (slot, None) => *slot = None,
            (Some(rules), Some(more)) => rules.extend(more),
            (None, Some(_)) => {}
        }
    }
    // seccompiler: an empty rule list allows every call.
    let rules = allowed.into_iter().map(|(nr, r)| (nr, r.unwrap_or_default())).collect();
    let f =
        SeccompFilter::new(rules, SeccompAction::Trap, SeccompAction::Allow, TargetArch::x86_64)
            .map_err(SandboxError::SeccompFilter)?;
    f.try_into().map_err(SandboxError::SeccompFilter)
}

/// The filter that makes [`policy::RBD_REFUSED`] fail with their errno, and lets
/// everything else through to the other filters. Seccomp runs every filter and takes
/// the strictest answer: an error beats the main filter's allow (and a trap beats the
/// error, so the main filter lets these through: `policy::RBD_ALWAYS`).
fn refusals() -> Result<Vec<BpfProgram>, SandboxError> {
    // One filter per errno: a seccompiler filter has one match action.
    let mut by_errno: BTreeMap<u32, BTreeMap<i64, Vec<SeccompRule>>> = BTreeMap::new();
    for r in policy::RBD_REFUSED {
        let rules = by_errno.entry(r.errno).or_default().entry(r.nr).or_default();
        if let Some(more) = rule_of(r.only)? {
            rules.extend(more);
        }
    }
    by_errno
        .into_iter()
        .map(|(errno, rules)| {
            let f = SeccompFilter::new(
                rules,
                SeccompAction::Allow,
                SeccompAction::Errno(errno),
                TargetArch::x86_64,
            )
            .map_err(SandboxError::SeccompFilter)?;
            f.try_into().map_err(SandboxError::SeccompFilter)
        })
        .collect()
}

pub(super) fn apply_refusals() -> Result<(), SandboxError> {
    for prog in refusals()? {
        seccompiler::apply_filter(&prog).map_err(SandboxError::SeccompInstall)?;
    }
    Ok(())
}

pub(super) fn apply_seccomp(setup: bool, profile: Profile) -> Result<(), SandboxError> {
    let prog = filter(setup, profile)?;
    let apply =
        if setup { seccompiler::apply_filter } else { seccompiler::apply_filter_all_threads };
    apply(&prog).map_err(SandboxError::SeccompInstall)
}

/// Seccomp stage 2, for every thread: no new rings, no new threads (but an rbd
/// worker's libraries', see [`policy::RBD_ALWAYS`]).
pub fn lock_down(profile: Profile) -> Result<(), SandboxError> {
    apply_seccomp(false, profile)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_filter_stages_compile() {
        for profile in [Profile::Standard, Profile::Rbd] {
            assert!(!filter(true, profile).unwrap().is_empty());
            assert!(filter(false, profile).unwrap().len() < filter(true, profile).unwrap().len());
        }
        assert!(!refusals().unwrap().is_empty());
    }
}
