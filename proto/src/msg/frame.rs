//! Length-framed messages on a stream (the `ublkctl` socket): a little-endian `u32`
//! length, then the encoded message, each kind of frame with its own bound.

use std::io::{self, Read, Write};

use serde::Serialize;

use super::{CtlResponse, MsgError};
use crate::codec::{self, MAX_MESSAGE_BYTES, MAX_RESPONSE_BYTES};

/// Writes one length-framed message of at most [`MAX_MESSAGE_BYTES`] to a stream.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), MsgError> {
    write_frame_within::<MAX_MESSAGE_BYTES, T>(w, msg)
}

/// Reads one length-framed message of at most [`MAX_MESSAGE_BYTES`] from a stream;
/// refuses a larger frame before reading it.
pub fn read_frame<T: serde::de::DeserializeOwned>(r: &mut impl Read) -> Result<T, MsgError> {
    read_frame_within::<MAX_MESSAGE_BYTES, T>(r)
}

/// Writes ublkd's answer to a `ublkctl` request: one frame of at most
/// [`MAX_RESPONSE_BYTES`], which grows with the devices it lists.
pub fn write_response(w: &mut impl Write, response: &CtlResponse) -> Result<(), MsgError> {
    write_frame_within::<MAX_RESPONSE_BYTES, CtlResponse>(w, response)
}

/// Reads ublkd's answer to a `ublkctl` request ([`write_response`]); refuses a frame
/// over [`MAX_RESPONSE_BYTES`] before reading it.
pub fn read_response(r: &mut impl Read) -> Result<CtlResponse, MsgError> {
    read_frame_within::<MAX_RESPONSE_BYTES, CtlResponse>(r)
}

fn write_frame_within<const LIMIT: usize, T: Serialize>(
    w: &mut impl Write,
    msg: &T,
) -> Result<(), MsgError> {
    let bytes = codec::encode_within::<LIMIT, T>(msg)?;
    let len = u32::try_from(bytes.len())
        .map_err(|_| MsgError::FrameTooLarge { len: bytes.len(), limit: LIMIT })?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(&bytes)?;
    w.flush()?;
    Ok(())
}

fn read_frame_within<const LIMIT: usize, T: serde::de::DeserializeOwned>(
    r: &mut impl Read,
) -> Result<T, MsgError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(MsgError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > LIMIT {
        return Err(MsgError::FrameTooLarge { len, limit: LIMIT });
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(codec::decode_within::<LIMIT, T>(&buf)?)
}
