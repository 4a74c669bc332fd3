//! The `user_data` of every SQE a queue thread submits: what the completion belongs
//! to (a PREP, a FETCH, a COMMIT, a per-I/O command, a target I/O, the target's own I/O), packed into the 64 bits io_uring hands
//! back with it. Packed and unpacked only here.

/// What a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UserData {
    /// The PREP of every tag of queue `q_id`.
    Prep { q_id: u16 },
    /// The multishot FETCH of queue `q_id`, the thread's queue number `index`.
    Fetch { q_id: u16, index: u32 },
    /// A COMMIT of several elements, kept in the thread's COMMIT slot `slot` until it
    /// completes.
    Commit { q_id: u16, slot: u32 },
    /// A one-element COMMIT sent with `IOSQE_CQE_SKIP_SUCCESS`: only a failure
    /// completes.
    CommitOne { q_id: u16, tag: u16 },
    /// The per-I/O FETCH_REQ or COMMIT_AND_FETCH_REQ of tag `tag` of queue `q_id`:
    /// completes with the tag's next request.
    IoCmd { q_id: u16, tag: u16 },
    /// The target's SQE for request `tag` of queue `q_id`.
    Target { q_id: u16, tag: u16 },
    /// An SQE the target made for itself rather than for one request (`nbd`: a
    /// connection's WRITEV or RECV), named by the target's own `key`.
    TargetOwn { key: u32 },
    /// A test hook's SQE (see `crate::hooks`).
    Attack,
}

// The kind in bits 56..64, the queue in 32..48, a per-kind index in 0..32.
const KIND_PREP: u64 = 1;
const KIND_FETCH: u64 = 2;
const KIND_COMMIT: u64 = 3;
const KIND_TARGET: u64 = 4;
const KIND_ATTACK: u64 = 5;
const KIND_COMMIT_ONE: u64 = 6;
const KIND_IO_CMD: u64 = 7;
const KIND_TARGET_OWN: u64 = 8;

fn pack(kind: u64, q_id: u16, low: u32) -> u64 {
    (kind << 56) | (u64::from(q_id) << 32) | u64::from(low)
}

impl UserData {
    pub fn encode(self) -> u64 {
        match self {
            UserData::Prep { q_id } => pack(KIND_PREP, q_id, 0),
            UserData::Fetch { q_id, index } => pack(KIND_FETCH, q_id, index),
            UserData::Commit { q_id, slot } => pack(KIND_COMMIT, q_id, slot),
            UserData::CommitOne { q_id, tag } => pack(KIND_COMMIT_ONE, q_id, u32::from(tag)),
            UserData::Target { q_id, tag } => pack(KIND_TARGET, q_id, u32::from(tag)),
            UserData::IoCmd { q_id, tag } => pack(KIND_IO_CMD, q_id, u32::from(tag)),
            UserData::TargetOwn { key } => pack(KIND_TARGET_OWN, 0, key),
            UserData::Attack => pack(KIND_ATTACK, 0, 0),
        }
    }

    /// What `ud` (an [`encode`](Self::encode)d value) belongs to; `None` for a value
    /// this thread never submitted.
    pub fn decode(ud: u64) -> Option<UserData> {
        let (kind, q_id, low) = (ud >> 56, (ud >> 32) as u16, ud as u32);
        Some(match kind {
            KIND_PREP => UserData::Prep { q_id },
            KIND_FETCH => UserData::Fetch { q_id, index: low },
            KIND_COMMIT => UserData::Commit { q_id, slot: low },
            KIND_COMMIT_ONE => UserData::CommitOne { q_id, tag: low as u16 },
            KIND_TARGET => UserData::Target { q_id, tag: low as u16 },
            KIND_IO_CMD => UserData::IoCmd { q_id, tag: low as u16 },
            KIND_TARGET_OWN => UserData::TargetOwn { key: low },
            KIND_ATTACK => UserData::Attack,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> [UserData; 8] {
        [
            UserData::Prep { q_id: 3 },
            UserData::Fetch { q_id: 513, index: 7 },
            UserData::Commit { q_id: 513, slot: 77 },
            UserData::CommitOne { q_id: u16::MAX, tag: u16::MAX },
            UserData::Target { q_id: 0, tag: 4095 },
            UserData::IoCmd { q_id: 1, tag: 4095 },
            UserData::TargetOwn { key: u32::MAX },
            UserData::Attack,
        ]
    }

    #[test]
    fn every_kind_round_trips() {
        for ud in all() {
            assert_eq!(UserData::decode(ud.encode()), Some(ud), "{ud:?}");
        }
    }

    #[test]
    fn kinds_with_the_same_numbers_encode_differently() {
        let (q_id, n) = (2, 9);
        let encoded = [
            UserData::Fetch { q_id, index: u32::from(n) }.encode(),
            UserData::Commit { q_id, slot: u32::from(n) }.encode(),
            UserData::CommitOne { q_id, tag: n }.encode(),
            UserData::Target { q_id, tag: n }.encode(),
            UserData::IoCmd { q_id, tag: n }.encode(),
            UserData::TargetOwn { key: u32::from(n) }.encode(),
        ];
        for (i, a) in encoded.iter().enumerate() {
            assert!(encoded[i + 1..].iter().all(|b| a != b), "{encoded:x?}");
        }
    }

    #[test]
    fn values_never_submitted_decode_to_none() {
        assert_eq!(UserData::decode(0), None);
        assert_eq!(UserData::decode(9 << 56), None);
        assert_eq!(UserData::decode(u64::MAX), None);
    }
}
