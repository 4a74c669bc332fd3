//! Which exclusive-lock owners an activating worker may take the image from: only the
//! clients of the device's own earlier workers (`ToWorker::Activate`'s `fence`, what
//! each said in its `Standby`). Breaking a lock blocklists its owner in the cluster, so
//! that a write an earlier worker still has in flight can never land after the new
//! worker's; anyone else's lock is left alone and the activation fails naming it.

/// An owner of the image's lock that is not one of the device's earlier workers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "image {spec} is locked by another client ({owners}); ublkd does not take it from a \
     client it did not start (see `rbd lock ls`)"
)]
pub struct LockedByOther {
    pub spec: String,
    /// The foreign owners' addresses, comma-separated.
    pub owners: String,
}

/// The owners to break before taking the lock: every one of `owners` if all are in
/// `fence` (none when the image is unlocked), else the foreign ones as the refusal.
pub fn owners_to_break<'a>(
    spec: &str,
    owners: &'a [String],
    fence: &[String],
) -> Result<Vec<&'a str>, LockedByOther> {
    let foreign: Vec<&str> =
        owners.iter().filter(|o| !fence.contains(o)).map(String::as_str).collect();
    if !foreign.is_empty() {
        return Err(LockedByOther { spec: spec.to_string(), owners: foreign.join(", ") });
    }
    Ok(owners.iter().map(String::as_str).collect())
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
        assert_eq!(owners_to_break("rbd/x", &[], &strings(&[OLD])), Ok(vec![]));
        assert_eq!(owners_to_break("rbd/x", &[], &[]), Ok(vec![]));
    }

    #[test]
    fn an_earlier_workers_lock_is_broken() {
        let owners = strings(&[OLD]);
        assert_eq!(owners_to_break("rbd/x", &owners, &strings(&[OLDER, OLD])), Ok(vec![OLD]));
    }

    #[test]
    fn a_lock_of_a_client_ublkd_did_not_start_is_refused_by_name() {
        let owners = strings(&[STRANGER]);
        let refused = owners_to_break("rbd/x", &owners, &strings(&[OLD])).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "image rbd/x is locked by another client (10.0.0.7:0/4242); ublkd does not take \
             it from a client it did not start (see `rbd lock ls`)"
        );
    }

    #[test]
    fn one_foreign_owner_among_earlier_workers_refuses_all_and_breaks_none() {
        let owners = strings(&[OLD, STRANGER]);
        let refused = owners_to_break("rbd/x", &owners, &strings(&[OLD])).unwrap_err();
        assert_eq!(refused.owners, STRANGER);
    }

    #[test]
    fn an_empty_fence_list_refuses_any_owner() {
        assert!(owners_to_break("rbd/x", &strings(&[OLD]), &[]).is_err());
    }

    #[test]
    fn owners_are_compared_exactly() {
        // Another nonce is another client instance.
        let owners = strings(&["127.0.0.1:0/29617948080"]);
        assert!(owners_to_break("rbd/x", &owners, &strings(&[OLD])).is_err());
    }
}
