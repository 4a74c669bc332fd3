//! Which exclusive-lock owners an activating worker may take the image from: the
//! clients of the device's own earlier workers (`ToWorker::Activate`'s `fence`, what
//! each said in its `Standby`), and owners the cluster says are dead: no longer
//! watching the image's header, as a client that crashed or lost power leaves its
//! lock (librbd breaks such a lock itself; ublkd's list of earlier workers lives under
//! /run and is gone after a reboot). Breaking a lock blocklists its owner in the
//! cluster, so that a write it still has in flight can never land after the new
//! worker's; a live owner ublkd did not start is left alone and the activation fails
//! naming it.

/// An owner of the image's lock that is neither one of the device's earlier workers
/// nor dead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "image {spec} is locked by another client ({owners}), which still watches the \
     image; ublkd does not take it from a client it did not start (see `rbd lock ls` \
     and `rbd status`)"
)]
pub struct LockedByOther {
    pub spec: String,
    /// The foreign owners' addresses, comma-separated.
    pub owners: String,
}

/// The owners to break before taking the lock, given the image's watchers' addresses:
/// every one of `owners` if each is in `fence` or watches no more (none when the image
/// is unlocked), else the live foreign ones as the refusal.
pub fn owners_to_break<'a>(
    spec: &str,
    owners: &'a [String],
    fence: &[String],
    watchers: &[String],
) -> Result<Vec<&'a str>, LockedByOther> {
    let watching = |owner: &str| watchers.iter().any(|w| same_client(w, owner));
    let foreign: Vec<&str> =
        owners.iter().filter(|o| !fence.contains(o) && watching(o)).map(String::as_str).collect();
    if !foreign.is_empty() {
        return Err(LockedByOther { spec: spec.to_string(), owners: foreign.join(", ") });
    }
    Ok(owners.iter().map(String::as_str).collect())
}

/// Whether two of Ceph's client addresses (`IP:PORT/NONCE`) name the same client
/// instance. A lock owner and a watcher print the same address, but an address may
/// carry its messenger type in front (`v1:`, `v2:`, `any:`), which says nothing of the
/// client.
fn same_client(a: &str, b: &str) -> bool {
    fn bare(addr: &str) -> &str {
        ["v1:", "v2:", "any:"].iter().find_map(|p| addr.strip_prefix(p)).unwrap_or(addr)
    }
    bare(a) == bare(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    const OLD: &str = "127.0.0.1:0/2961794808";
    const OLDER: &str = "127.0.0.1:0/1111";
    const STRANGER: &str = "10.0.0.7:0/4242";

    #[test]
    fn an_unlocked_image_breaks_nothing() {
        assert_eq!(owners_to_break("rbd/x", &[], &strings(&[OLD]), &[]), Ok(vec![]));
        assert_eq!(owners_to_break("rbd/x", &[], &[], &[]), Ok(vec![]));
    }

    #[test]
    fn an_earlier_workers_lock_is_broken() {
        let owners = strings(&[OLD]);
        assert_eq!(
            owners_to_break("rbd/x", &owners, &strings(&[OLDER, OLD]), &owners),
            Ok(vec![OLD])
        );
    }

    #[test]
    fn a_lock_of_a_client_ublkd_did_not_start_is_refused_by_name() {
        let owners = strings(&[STRANGER]);
        let refused = owners_to_break("rbd/x", &owners, &strings(&[OLD]), &owners).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "image rbd/x is locked by another client (10.0.0.7:0/4242), which still watches \
             the image; ublkd does not take it from a client it did not start (see `rbd \
             lock ls` and `rbd status`)"
        );
    }

    #[test]
    fn one_foreign_owner_among_earlier_workers_refuses_all_and_breaks_none() {
        let owners = strings(&[OLD, STRANGER]);
        let refused = owners_to_break("rbd/x", &owners, &strings(&[OLD]), &owners).unwrap_err();
        assert_eq!(refused.owners, STRANGER);
    }

    #[test]
    fn an_empty_fence_list_refuses_any_live_owner() {
        assert!(owners_to_break("rbd/x", &strings(&[OLD]), &[], &strings(&[OLD])).is_err());
    }

    #[test]
    fn owners_are_compared_exactly() {
        // Another nonce is another client instance.
        let owners = strings(&["127.0.0.1:0/29617948080"]);
        assert!(owners_to_break("rbd/x", &owners, &strings(&[OLD]), &owners).is_err());
    }

    #[test]
    fn a_dead_owner_is_broken_though_ublkd_did_not_start_it() {
        // After a power loss: the old worker's lock, its client gone from the watchers,
        // and no list of earlier workers.
        let owners = strings(&[STRANGER]);
        let me = strings(&["127.0.0.1:0/777"]);
        assert_eq!(owners_to_break("rbd/x", &owners, &[], &me), Ok(vec![STRANGER]));
    }

    #[test]
    fn a_dead_owner_beside_a_live_stranger_breaks_nothing() {
        let owners = strings(&[OLD, STRANGER]);
        let refused = owners_to_break("rbd/x", &owners, &[], &strings(&[STRANGER])).unwrap_err();
        assert_eq!(refused.owners, STRANGER);
    }

    #[test]
    fn a_watchers_messenger_prefix_does_not_hide_it() {
        let owners = strings(&[STRANGER]);
        let watchers = strings(&["v1:10.0.0.7:0/4242"]);
        assert!(owners_to_break("rbd/x", &owners, &[], &watchers).is_err());
        let watchers = strings(&["v2:10.0.0.7:0/4243"]);
        assert!(owners_to_break("rbd/x", &owners, &[], &watchers).is_ok());
    }
}
