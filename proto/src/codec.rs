//! The one wire codec for messages between ublkd's processes (supervisor ↔ worker,
//! ublkctl ↔ supervisor).
//!
//! It wraps `bincode` 2.0.1, which is unmaintained (RUSTSEC-2025-0141, recorded in
//! `deny.toml`): keeping it behind these two functions means replacing it touches
//! nothing else. Decoding is bounded ([`MAX_MESSAGE_BYTES`]) so that a peer cannot
//! make the reader allocate without limit, and a message with trailing bytes is
//! refused rather than half-read.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest encoded message either side accepts.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_little_endian().with_limit::<MAX_MESSAGE_BYTES>()
}

/// Errors in encoding or decoding a message.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("a message could not be encoded: {0}")]
    Encode(String),
    #[error("a message of {0} bytes is larger than the limit of {MAX_MESSAGE_BYTES} bytes")]
    TooLarge(usize),
    #[error("a message could not be decoded: {0}")]
    Decode(String),
    #[error("a message has {0} bytes after its end")]
    Trailing(usize),
}

/// Encodes `msg`; fails if the result would exceed [`MAX_MESSAGE_BYTES`].
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    let bytes = bincode::serde::encode_to_vec(msg, config())
        .map_err(|e| CodecError::Encode(e.to_string()))?;
    // bincode's limit bounds decoding only; the same bound holds for what we send.
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Decodes exactly one message from `bytes`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge(bytes.len()));
    }
    let (msg, used) = bincode::serde::decode_from_slice(bytes, config())
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
        assert!(matches!(encode(&big), Err(CodecError::TooLarge(_))));
        assert!(matches!(
            decode::<Msg>(&vec![0; MAX_MESSAGE_BYTES + 1]),
            Err(CodecError::TooLarge(_))
        ));
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
