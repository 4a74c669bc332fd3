//! The one wire codec for messages between ublkd's processes (supervisor ↔ worker,
//! ublkctl ↔ supervisor).
//!
//! It wraps `bincode` 2.0.1, which is unmaintained (RUSTSEC-2025-0141, recorded in
//! `deny.toml`): keeping it behind these two functions means replacing it touches
//! nothing else. Decoding is bounded so that a peer cannot make the reader allocate
//! without limit, and a message with trailing bytes is refused rather than half-read.
//! Every message is bounded by [`MAX_MESSAGE_BYTES`] but one kind: ublkd's answers to
//! `ublkctl`, which grow with the number of devices, have their own bound,
//! [`MAX_RESPONSE_BYTES`] (`encode_within` / `decode_within` take the bound).

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest encoded message either side accepts: every message between ublkd and
/// its workers, and every request of `ublkctl`.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// The largest encoded answer of ublkd to `ublkctl` (`crate::msg::write_response`).
/// `status` takes ~500 bytes per device, so this holds that of ~30,000 devices, far
/// more than one host serves, while a client never allocates more than this for an
/// answer.
pub const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

fn config<const LIMIT: usize>() -> impl bincode::config::Config {
    bincode::config::standard().with_little_endian().with_limit::<LIMIT>()
}

/// Errors in encoding or decoding a message.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("a message could not be encoded: {0}")]
    Encode(String),
    #[error("a message of {len} bytes is larger than the limit of {limit} bytes")]
    TooLarge { len: usize, limit: usize },
    #[error("a message could not be decoded: {0}")]
    Decode(String),
    #[error("a message has {0} bytes after its end")]
    Trailing(usize),
}

/// Encodes `msg`; fails if the result would exceed [`MAX_MESSAGE_BYTES`].
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    encode_within::<MAX_MESSAGE_BYTES, T>(msg)
}

/// Decodes exactly one message of at most [`MAX_MESSAGE_BYTES`] from `bytes`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_within::<MAX_MESSAGE_BYTES, T>(bytes)
}

/// Encodes `msg`; fails if the result would exceed `LIMIT` bytes.
pub fn encode_within<const LIMIT: usize, T: Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    let bytes = bincode::serde::encode_to_vec(msg, config::<LIMIT>())
        .map_err(|e| CodecError::Encode(e.to_string()))?;
    // bincode's limit bounds decoding only; the same bound holds for what we send.
    if bytes.len() > LIMIT {
        return Err(CodecError::TooLarge { len: bytes.len(), limit: LIMIT });
    }
    Ok(bytes)
}

/// Decodes exactly one message of at most `LIMIT` bytes from `bytes`.
pub fn decode_within<const LIMIT: usize, T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, CodecError> {
    if bytes.len() > LIMIT {
        return Err(CodecError::TooLarge { len: bytes.len(), limit: LIMIT });
    }
    let (msg, used) = bincode::serde::decode_from_slice(bytes, config::<LIMIT>())
        .map_err(|e| CodecError::Decode(e.to_string()))?;
    if used != bytes.len() {
        return Err(CodecError::Trailing(bytes.len() - used));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Msg {
        Hello { pid: u32, name: String },
        Blob(Vec<u8>),
    }

    #[test]
    fn round_trip() {
        let m = Msg::Hello { pid: 7, name: "w".into() };
        assert_eq!(decode::<Msg>(&encode(&m).unwrap()).unwrap(), m);
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut b = encode(&Msg::Blob(vec![1, 2])).unwrap();
        b.push(0);
        assert!(matches!(decode::<Msg>(&b), Err(CodecError::Trailing(1))));
    }

    #[test]
    fn oversized_messages_are_refused_both_ways() {
        let big = Msg::Blob(vec![0; MAX_MESSAGE_BYTES]);
        assert!(matches!(encode(&big), Err(CodecError::TooLarge { limit: MAX_MESSAGE_BYTES, .. })));
        assert!(matches!(
            decode::<Msg>(&vec![0; MAX_MESSAGE_BYTES + 1]),
            Err(CodecError::TooLarge { len, .. }) if len == MAX_MESSAGE_BYTES + 1
        ));
    }

    #[test]
    fn a_message_past_the_common_bound_passes_the_response_bound_only() {
        let big = Msg::Blob(vec![7; 4 * MAX_MESSAGE_BYTES]);
        let bytes = encode_within::<MAX_RESPONSE_BYTES, _>(&big).unwrap();
        assert!(matches!(decode::<Msg>(&bytes), Err(CodecError::TooLarge { .. })));
        assert_eq!(decode_within::<MAX_RESPONSE_BYTES, Msg>(&bytes).unwrap(), big);
    }

    #[test]
    fn a_message_past_the_response_bound_is_refused_both_ways() {
        let big = Msg::Blob(vec![0; MAX_RESPONSE_BYTES]);
        let err = encode_within::<MAX_RESPONSE_BYTES, _>(&big).unwrap_err();
        assert!(matches!(err, CodecError::TooLarge { limit: MAX_RESPONSE_BYTES, .. }), "{err}");
        let err = decode_within::<MAX_RESPONSE_BYTES, Msg>(&vec![0; MAX_RESPONSE_BYTES + 1]);
        assert!(matches!(err, Err(CodecError::TooLarge { .. })), "{err:?}");
    }

    #[test]
    fn a_length_prefix_claiming_gigabytes_does_not_allocate_them() {
        // Variant 1 (Blob) followed by a varint length of u64::MAX.
        let forged = [1u8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(decode::<Msg>(&forged), Err(CodecError::Decode(_))));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<Msg>(&bytes);
        }
    }
}
