//! Encoding and decoding of `UBLK_F_BATCH_IO` element buffers.
//!
//! PREP and COMMIT pass the kernel an array of elements through `sqe->addr`; each is a
//! [`UblkElemHeader`] followed, if the command's flags say so and in this order, by a
//! `u64` buffer address (`UBLK_BATCH_F_HAS_BUF_ADDR`) and a `u64` zone-append LBA
//! (`UBLK_BATCH_F_HAS_ZONE_LBA`): 8, 16 or 24 bytes. FETCH answers with an array of
//! `u16` tags in a provided buffer. This module owns both encodings, so the data path
//! never does byte arithmetic of its own.
//!
//! [`ElemBuf`] allocates once, at its capacity; pushing elements and dropping the
//! committed prefix after a partial COMMIT never allocate.

use crate::uapi::{
    UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK, UBLK_BATCH_F_HAS_BUF_ADDR, UBLK_BATCH_F_HAS_ZONE_LBA,
    UblkBatchIo, UblkElemHeader,
};

/// The most tags one FETCH CQE may carry, per the kernel's batch design.
pub const MAX_TAGS_PER_FETCH: usize = 128;

/// Errors in building or reading a batch buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("batch flags {0:#x} carry bits the batch interface does not define")]
    UnknownFlags(u16),
    #[error("element size {got} does not match the batch flags, which need {want} bytes")]
    ElemBytesMismatch { got: u8, want: u8 },
    #[error("a batch buffer of {len} bytes is not a whole number of {elem_bytes}-byte elements")]
    Ragged { len: usize, elem_bytes: u8 },
    #[error("the batch buffer is full at its capacity of {capacity} elements")]
    Full { capacity: u16 },
    #[error("a batch of {0} elements is more than one command can carry (65535)")]
    TooMany(usize),
    #[error("the kernel reports {reported} bytes committed, but the command carried {sent} bytes")]
    CommittedTooMuch { reported: usize, sent: usize },
    #[error(
        "the kernel reports {reported} bytes committed, not a whole number of {elem_bytes}-byte elements"
    )]
    CommittedRagged { reported: usize, elem_bytes: u8 },
    #[error("a FETCH result of {0} bytes is not a whole number of 2-byte tags")]
    FetchRagged(usize),
    #[error("a FETCH result of {0} tags is more than the {MAX_TAGS_PER_FETCH} one CQE may carry")]
    FetchTooMany(usize),
    #[error("FETCH delivered tag {tag}, outside the queue depth of {depth}")]
    TagOutOfRange { tag: u16, depth: u16 },
}

/// Which optional fields follow each element's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ElemFormat {
    /// `UBLK_BATCH_F_HAS_BUF_ADDR`: a buffer address for kernel-copy mode.
    pub buf_addr: bool,
    /// `UBLK_BATCH_F_HAS_ZONE_LBA`: a zone-append LBA (zoned devices).
    pub zone_lba: bool,
    /// `UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK` (zero copy; changes no layout): when the
    /// kernel cannot register a request's pages in the fetching ring it delivers the
    /// request marked `UBLK_IO_F_NEED_REG_BUF` instead of failing it with EIO.
    pub auto_buf_reg_fallback: bool,
}

impl ElemFormat {
    /// Just the 8-byte header (USER_COPY: the kernel needs no address; zero copy uses
    /// [`Self::ZERO_COPY`], the same layout with the fallback flag).
    pub const HEADER: ElemFormat =
        ElemFormat { buf_addr: false, zone_lba: false, auto_buf_reg_fallback: false };
    /// Zero copy (`UBLK_F_AUTO_BUF_REG`): the header, and a request whose pages the
    /// kernel cannot register is delivered, not failed.
    pub const ZERO_COPY: ElemFormat = ElemFormat { auto_buf_reg_fallback: true, ..Self::HEADER };
    /// Header and buffer address (kernel-copy mode): 16 bytes.
    pub const WITH_BUF_ADDR: ElemFormat = ElemFormat { buf_addr: true, ..Self::HEADER };

    /// The format a command's `flags` describe; an unknown bit is refused.
    pub fn from_flags(flags: u16) -> Result<Self, BatchError> {
        let known = UBLK_BATCH_F_HAS_BUF_ADDR
            | UBLK_BATCH_F_HAS_ZONE_LBA
            | UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK;
        if flags & !known != 0 {
            return Err(BatchError::UnknownFlags(flags));
        }
        Ok(ElemFormat {
            buf_addr: flags & UBLK_BATCH_F_HAS_BUF_ADDR != 0,
            zone_lba: flags & UBLK_BATCH_F_HAS_ZONE_LBA != 0,
            auto_buf_reg_fallback: flags & UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK != 0,
        })
    }

    /// The flags for the command header.
    pub const fn flags(self) -> u16 {
        (if self.buf_addr { UBLK_BATCH_F_HAS_BUF_ADDR } else { 0 })
            | (if self.zone_lba { UBLK_BATCH_F_HAS_ZONE_LBA } else { 0 })
            | (if self.auto_buf_reg_fallback { UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK } else { 0 })
    }

    /// Bytes per element: 8, 16 or 24.
    pub const fn elem_bytes(self) -> u8 {
        (size_of::<UblkElemHeader>() + 8 * (self.buf_addr as usize + self.zone_lba as usize)) as u8
    }

    /// Checks that `elem_bytes` is the size these flags need, as the kernel does.
    pub fn check_elem_bytes(self, elem_bytes: u8) -> Result<(), BatchError> {
        let want = self.elem_bytes();
        if elem_bytes == want {
            Ok(())
        } else {
            Err(BatchError::ElemBytesMismatch { got: elem_bytes, want })
        }
    }
}

/// The largest element: header, buffer address and zone LBA.
const MAX_ELEM_BYTES: usize = 24;
const _: () = assert!(
    ElemFormat { buf_addr: true, zone_lba: true, auto_buf_reg_fallback: false }.elem_bytes()
        as usize
        == MAX_ELEM_BYTES
);

/// One element of a PREP or COMMIT command. Fields the format leaves out are not
/// encoded (and decode as zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchElem {
    pub tag: u16,
    pub buf_index: u16,
    /// COMMIT only: bytes transferred, or `-errno`.
    pub result: i32,
    pub buf_addr: u64,
    pub zone_lba: u64,
}

impl BatchElem {
    fn encode_into(&self, format: ElemFormat, out: &mut [u8]) {
        out[0..2].copy_from_slice(&self.tag.to_ne_bytes());
        out[2..4].copy_from_slice(&self.buf_index.to_ne_bytes());
        out[4..8].copy_from_slice(&self.result.to_ne_bytes());
        let mut at = 8;
        if format.buf_addr {
            out[at..at + 8].copy_from_slice(&self.buf_addr.to_ne_bytes());
            at += 8;
        }
        if format.zone_lba {
            out[at..at + 8].copy_from_slice(&self.zone_lba.to_ne_bytes());
        }
    }

    fn decode_from(format: ElemFormat, bytes: &[u8]) -> BatchElem {
        let u64_at = |at: usize| u64::from_ne_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let mut elem = BatchElem {
            tag: u16::from_ne_bytes([bytes[0], bytes[1]]),
            buf_index: u16::from_ne_bytes([bytes[2], bytes[3]]),
            result: i32::from_ne_bytes(bytes[4..8].try_into().expect("4 bytes")),
            ..BatchElem::default()
        };
        let mut at = 8;
        if format.buf_addr {
            elem.buf_addr = u64_at(at);
            at += 8;
        }
        if format.zone_lba {
            elem.zone_lba = u64_at(at);
        }
        elem
    }
}

/// A reusable element buffer for one PREP or COMMIT command.
///
/// The kernel reads it while the command runs: keep the buffer alive and unchanged
/// until the command's CQE arrives.
#[derive(Debug, Clone)]
pub struct ElemBuf {
    format: ElemFormat,
    bytes: Vec<u8>,
    capacity: u16,
}

impl ElemBuf {
    /// A buffer for up to `capacity` elements (at most a queue's depth), allocated now.
    pub fn new(format: ElemFormat, capacity: u16) -> Self {
        let bytes = Vec::with_capacity(usize::from(capacity) * usize::from(format.elem_bytes()));
        ElemBuf { format, bytes, capacity }
    }

    pub fn len(&self) -> usize {
        self.bytes.len() / usize::from(self.format.elem_bytes())
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn push(&mut self, elem: BatchElem) -> Result<(), BatchError> {
        // On every I/O's path: no division (`len`), no zero fill of the new bytes.
        let size = usize::from(self.format.elem_bytes());
        if self.bytes.len() + size > usize::from(self.capacity) * size {
            return Err(BatchError::Full { capacity: self.capacity });
        }
        let mut encoded = [0u8; MAX_ELEM_BYTES];
        elem.encode_into(self.format, &mut encoded);
        self.bytes.extend_from_slice(&encoded[..size]);
        Ok(())
    }

    pub fn clear(&mut self) {
        self.bytes.clear();
    }

    /// The element at `index`.
    pub fn get(&self, index: usize) -> Option<BatchElem> {
        let size = usize::from(self.format.elem_bytes());
        let bytes = self.bytes.get(index * size..(index + 1) * size)?;
        Some(BatchElem::decode_from(self.format, bytes))
    }

    /// The encoded elements, as the kernel will read them.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The command header for these elements on queue `q_id`.
    pub fn header(&self, q_id: u16) -> UblkBatchIo {
        UblkBatchIo {
            q_id,
            flags: self.format.flags(),
            // `push` caps the count at `capacity`, a u16.
            nr_elem: self.len() as u16,
            elem_bytes: self.format.elem_bytes(),
            reserved: 0,
            reserved2: 0,
        }
    }

    /// After a COMMIT whose CQE said `res`, drops the elements the kernel processed and
    /// returns how many that was; the rest stay, in order, to be committed again.
    pub fn consume_committed(&mut self, res: usize) -> Result<usize, BatchError> {
        let done = committed_elems(res, self.format, self.bytes.len())?;
        self.bytes.drain(..done * usize::from(self.format.elem_bytes()));
        Ok(done)
    }
}

/// How many elements a COMMIT processed, from its CQE's non-negative `res` (bytes of
/// elements processed) and the bytes the command carried.
pub fn committed_elems(res: usize, format: ElemFormat, sent: usize) -> Result<usize, BatchError> {
    let elem_bytes = format.elem_bytes();
    if res > sent {
        return Err(BatchError::CommittedTooMuch { reported: res, sent });
    }
    if !res.is_multiple_of(usize::from(elem_bytes)) {
        return Err(BatchError::CommittedRagged { reported: res, elem_bytes });
    }
    Ok(res / usize::from(elem_bytes))
}

/// Decodes a whole element buffer (what the kernel would read for `header`).
pub fn decode_elems(header: &UblkBatchIo, bytes: &[u8]) -> Result<Vec<BatchElem>, BatchError> {
    let format = ElemFormat::from_flags(header.flags)?;
    format.check_elem_bytes(header.elem_bytes)?;
    let size = usize::from(header.elem_bytes);
    if !bytes.len().is_multiple_of(size) {
        return Err(BatchError::Ragged { len: bytes.len(), elem_bytes: header.elem_bytes });
    }
    let count = bytes.len() / size;
    if count > usize::from(u16::MAX) {
        return Err(BatchError::TooMany(count));
    }
    Ok(bytes.chunks_exact(size).map(|chunk| BatchElem::decode_from(format, chunk)).collect())
}

/// The tags one FETCH CQE delivered: `bytes` is the first `res` bytes of the selected
/// provided buffer. Every tag is checked against the queue depth, so a caller can use
/// it as an index without further checks.
pub fn decode_fetched_tags(bytes: &[u8], queue_depth: u16) -> Result<FetchedTags<'_>, BatchError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(BatchError::FetchRagged(bytes.len()));
    }
    let count = bytes.len() / 2;
    if count > MAX_TAGS_PER_FETCH {
        return Err(BatchError::FetchTooMany(count));
    }
    for pair in bytes.chunks_exact(2) {
        let tag = u16::from_ne_bytes([pair[0], pair[1]]);
        if tag >= queue_depth {
            return Err(BatchError::TagOutOfRange { tag, depth: queue_depth });
        }
    }
    Ok(FetchedTags { pairs: bytes.chunks_exact(2) })
}

/// Iterator over validated fetched tags.
#[derive(Debug, Clone)]
pub struct FetchedTags<'a> {
    pairs: std::slice::ChunksExact<'a, u8>,
}

impl Iterator for FetchedTags<'_> {
    type Item = u16;

    fn next(&mut self) -> Option<u16> {
        self.pairs.next().map(|pair| u16::from_ne_bytes([pair[0], pair[1]]))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.pairs.size_hint()
    }
}

impl ExactSizeIterator for FetchedTags<'_> {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn elem(tag: u16, result: i32, buf_addr: u64) -> BatchElem {
        BatchElem { tag, buf_index: 0, result, buf_addr, zone_lba: 0 }
    }

    #[test]
    fn elem_bytes_follow_flags() {
        assert_eq!(ElemFormat::HEADER.elem_bytes(), 8);
        assert_eq!(ElemFormat::WITH_BUF_ADDR.elem_bytes(), 16);
        let zoned = ElemFormat { zone_lba: true, ..ElemFormat::HEADER };
        assert_eq!(ElemFormat { buf_addr: true, ..zoned }.elem_bytes(), 24);
        assert_eq!(zoned.elem_bytes(), 16);
        // The fallback flag changes no layout, and round-trips through the header.
        assert_eq!(ElemFormat::ZERO_COPY.elem_bytes(), 8);
        assert_eq!(ElemFormat::ZERO_COPY.flags(), UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK);
        assert_eq!(
            ElemFormat::from_flags(ElemFormat::ZERO_COPY.flags()),
            Ok(ElemFormat::ZERO_COPY)
        );
    }

    #[test]
    fn buf_addr_comes_before_zone_lba() {
        let format = ElemFormat { buf_addr: true, zone_lba: true, auto_buf_reg_fallback: false };
        let mut buf = ElemBuf::new(format, 1);
        buf.push(BatchElem {
            tag: 1,
            buf_index: 2,
            result: -5,
            buf_addr: 0xAAAA,
            zone_lba: 0xBBBB,
        })
        .unwrap();
        let b = buf.as_bytes();
        assert_eq!(b.len(), 24);
        assert_eq!(u16::from_ne_bytes([b[0], b[1]]), 1);
        assert_eq!(u16::from_ne_bytes([b[2], b[3]]), 2);
        assert_eq!(i32::from_ne_bytes(b[4..8].try_into().unwrap()), -5);
        assert_eq!(u64::from_ne_bytes(b[8..16].try_into().unwrap()), 0xAAAA);
        assert_eq!(u64::from_ne_bytes(b[16..24].try_into().unwrap()), 0xBBBB);
    }

    #[test]
    fn header_describes_the_buffer() {
        let mut buf = ElemBuf::new(ElemFormat::WITH_BUF_ADDR, 4);
        buf.push(elem(0, 0, 0x1000)).unwrap();
        buf.push(elem(1, 0, 0x2000)).unwrap();
        let h = buf.header(3);
        assert_eq!((h.q_id, h.nr_elem, h.elem_bytes), (3, 2, 16));
        assert_eq!(h.flags, UBLK_BATCH_F_HAS_BUF_ADDR);
    }

    #[test]
    fn push_past_capacity_is_refused_without_growing() {
        let mut buf = ElemBuf::new(ElemFormat::HEADER, 2);
        let cap = buf.bytes.capacity();
        buf.push(elem(0, 0, 0)).unwrap();
        buf.push(elem(1, 0, 0)).unwrap();
        assert_eq!(buf.push(elem(2, 0, 0)), Err(BatchError::Full { capacity: 2 }));
        assert_eq!(buf.bytes.capacity(), cap);
    }

    #[test]
    fn partial_commit_keeps_the_rest_in_order() {
        let mut buf = ElemBuf::new(ElemFormat::HEADER, 8);
        for tag in 0..5 {
            buf.push(elem(tag, 4096, 0)).unwrap();
        }
        assert_eq!(buf.consume_committed(16), Ok(2));
        let left: Vec<u16> = (0..buf.len()).map(|i| buf.get(i).unwrap().tag).collect();
        assert_eq!(left, [2, 3, 4]);
        assert_eq!(buf.consume_committed(24), Ok(3));
        assert!(buf.is_empty());
    }

    #[test]
    fn commit_result_that_is_ragged_or_too_large_is_an_error() {
        let f = ElemFormat::WITH_BUF_ADDR;
        assert_eq!(
            committed_elems(17, f, 32),
            Err(BatchError::CommittedRagged { reported: 17, elem_bytes: 16 })
        );
        assert_eq!(
            committed_elems(48, f, 32),
            Err(BatchError::CommittedTooMuch { reported: 48, sent: 32 })
        );
        assert_eq!(committed_elems(0, f, 32), Ok(0));
    }

    #[test]
    fn decode_refuses_malformed_headers_and_buffers() {
        let mut h =
            UblkBatchIo { flags: UBLK_BATCH_F_HAS_BUF_ADDR, elem_bytes: 8, ..Default::default() };
        assert_eq!(
            decode_elems(&h, &[0; 16]),
            Err(BatchError::ElemBytesMismatch { got: 8, want: 16 })
        );
        h.elem_bytes = 16;
        assert_eq!(decode_elems(&h, &[0; 20]), Err(BatchError::Ragged { len: 20, elem_bytes: 16 }));
        h.flags = 1 << 9;
        assert_eq!(decode_elems(&h, &[0; 16]), Err(BatchError::UnknownFlags(1 << 9)));
    }

    #[test]
    fn fetched_tags_are_checked_against_depth() {
        let bytes: Vec<u8> = [3u16, 0, 127].iter().flat_map(|t| t.to_ne_bytes()).collect();
        let tags: Vec<u16> = decode_fetched_tags(&bytes, 128).unwrap().collect();
        assert_eq!(tags, [3, 0, 127]);
        assert_eq!(
            decode_fetched_tags(&bytes, 127).unwrap_err(),
            BatchError::TagOutOfRange { tag: 127, depth: 127 }
        );
        assert_eq!(decode_fetched_tags(&[0; 3], 8).unwrap_err(), BatchError::FetchRagged(3));
        assert_eq!(decode_fetched_tags(&[0; 258], 8).unwrap_err(), BatchError::FetchTooMany(129));
        assert_eq!(decode_fetched_tags(&[], 8).unwrap().len(), 0);
    }

    fn any_format() -> impl Strategy<Value = ElemFormat> {
        // The kernel refuses the fallback flag beside a buffer address.
        (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(buf_addr, zone_lba, fallback)| {
            ElemFormat { buf_addr, zone_lba, auto_buf_reg_fallback: fallback && !buf_addr }
        })
    }

    fn any_elem() -> impl Strategy<Value = BatchElem> {
        (any::<u16>(), any::<u16>(), any::<i32>(), any::<u64>(), any::<u64>()).prop_map(
            |(tag, buf_index, result, buf_addr, zone_lba)| BatchElem {
                tag,
                buf_index,
                result,
                buf_addr,
                zone_lba,
            },
        )
    }

    proptest! {
        #[test]
        fn encode_then_decode_round_trips(format in any_format(), elems in prop::collection::vec(any_elem(), 0..64)) {
            let mut buf = ElemBuf::new(format, 64);
            for e in &elems {
                buf.push(*e).unwrap();
            }
            let decoded = decode_elems(&buf.header(0), buf.as_bytes()).unwrap();
            let expected: Vec<BatchElem> = elems
                .iter()
                .map(|e| BatchElem {
                    buf_addr: if format.buf_addr { e.buf_addr } else { 0 },
                    zone_lba: if format.zone_lba { e.zone_lba } else { 0 },
                    ..*e
                })
                .collect();
            prop_assert_eq!(decoded, expected);
            prop_assert_eq!(buf.as_bytes().len(), elems.len() * usize::from(format.elem_bytes()));
        }

        #[test]
        fn decode_never_panics_on_arbitrary_input(flags in any::<u16>(), elem_bytes in any::<u8>(), bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let h = UblkBatchIo { flags, elem_bytes, ..Default::default() };
            if let Ok(elems) = decode_elems(&h, &bytes) {
                prop_assert_eq!(elems.len() * usize::from(elem_bytes), bytes.len());
            }
        }

        #[test]
        fn fetched_tags_never_panic_and_stay_in_range(bytes in prop::collection::vec(any::<u8>(), 0..300), depth in any::<u16>()) {
            if let Ok(tags) = decode_fetched_tags(&bytes, depth) {
                for tag in tags {
                    prop_assert!(tag < depth);
                }
            }
        }

        #[test]
        fn consume_committed_never_loses_or_invents_elements(n in 0usize..32, res in any::<u16>(), format in any_format()) {
            let mut buf = ElemBuf::new(format, 32);
            for tag in 0..n as u16 {
                buf.push(BatchElem { tag, ..Default::default() }).unwrap();
            }
            match buf.consume_committed(usize::from(res)) {
                Ok(done) => {
                    prop_assert_eq!(done + buf.len(), n);
                    if let Some(first) = buf.get(0) {
                        prop_assert_eq!(usize::from(first.tag), done);
                    }
                }
                Err(_) => prop_assert_eq!(buf.len(), n),
            }
        }
    }
}
