//! The unary request frame and the one protobuf field the layer reads.
//!
//! A unary gRPC request body is one length-prefixed message: a compressed flag
//! byte, a 4-byte big-endian length, then the message. The layer fingerprints the
//! whole frame, prefix included: the prefix is a function of the message bytes
//! for an uncompressed frame, and its leading `0x00` byte keeps the engine from
//! ever reading a protobuf message that happens to be valid JSON as JSON.

/// Why a request body is not one uncompressed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// Shorter than its prefix says, or no prefix at all.
    Truncated,
    /// More than one message (a client-streaming call, or junk after the message).
    Trailing,
    /// The compressed flag is set.
    Compressed,
}

impl FrameError {
    pub(crate) const fn detail(self) -> &'static str {
        match self {
            Self::Truncated => "the request is not one complete length-prefixed gRPC message",
            Self::Trailing => "an idempotent unary method takes exactly one request message",
            Self::Compressed => {
                "idempotent methods take uncompressed request messages (the fingerprint is over the message bytes)"
            }
        }
    }
}

/// The message of a unary request body (the frame without its 5-byte prefix).
pub(crate) fn unary_message(body: &[u8]) -> Result<&[u8], FrameError> {
    let Some((prefix, rest)) = body.split_first_chunk::<5>() else {
        return Err(FrameError::Truncated);
    };
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    match prefix[0] {
        0 => {}
        1 => return Err(FrameError::Compressed),
        _ => return Err(FrameError::Truncated),
    }
    match rest.len().cmp(&len) {
        std::cmp::Ordering::Less => Err(FrameError::Truncated),
        std::cmp::Ordering::Greater => Err(FrameError::Trailing),
        std::cmp::Ordering::Equal => Ok(rest),
    }
}

/// Why a field could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WireError;

fn varint(buf: &mut &[u8]) -> Result<u64, WireError> {
    let mut out = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first().ok_or(WireError)?;
        *buf = rest;
        out |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(out);
        }
    }
    Err(WireError)
}

fn skip<'a>(buf: &mut &'a [u8], n: u64) -> Result<&'a [u8], WireError> {
    let n = usize::try_from(n).map_err(|_| WireError)?;
    if buf.len() < n {
        return Err(WireError);
    }
    let (head, rest) = buf.split_at(n);
    *buf = rest;
    Ok(head)
}

/// The bytes of the top-level length-delimited field `number` of a protobuf
/// message (the last occurrence wins, as in proto3 parsing), or `None` when the
/// field is absent or empty (proto3's default). Fields are read without a
/// schema; a message that is not well-formed wire format, has groups, or has
/// `number` with another wire type, is an error.
pub(crate) fn string_field(mut msg: &[u8], number: u32) -> Result<Option<&[u8]>, WireError> {
    let mut found = None;
    while !msg.is_empty() {
        let tag = varint(&mut msg)?;
        let (field, wire) = (tag >> 3, tag & 7);
        if field == 0 {
            return Err(WireError);
        }
        let is_it = field == u64::from(number);
        match wire {
            0 if !is_it => {
                varint(&mut msg)?;
            }
            1 if !is_it => {
                skip(&mut msg, 8)?;
            }
            5 if !is_it => {
                skip(&mut msg, 4)?;
            }
            2 => {
                let len = varint(&mut msg)?;
                let bytes = skip(&mut msg, len)?;
                if is_it {
                    found = Some(bytes);
                }
            }
            _ => return Err(WireError),
        }
    }
    Ok(found.filter(|b| !b.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(msg: &[u8]) -> Vec<u8> {
        let mut v = vec![0];
        v.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
        v.extend_from_slice(msg);
        v
    }

    #[test]
    fn frames() {
        assert_eq!(unary_message(&frame(b"abc")), Ok(&b"abc"[..]));
        assert_eq!(unary_message(&frame(b"")), Ok(&b""[..]));
        assert_eq!(unary_message(b"\0\0\0"), Err(FrameError::Truncated));
        assert_eq!(unary_message(&frame(b"abc")[..7]), Err(FrameError::Truncated));
        let mut two = frame(b"a");
        two.extend(frame(b"b"));
        assert_eq!(unary_message(&two), Err(FrameError::Trailing));
        let mut compressed = frame(b"a");
        compressed[0] = 1;
        assert_eq!(unary_message(&compressed), Err(FrameError::Compressed));
    }

    #[test]
    fn fields() {
        // field 1 varint 150, field 2 string "k1", field 3 fixed32, field 2 again "k2".
        let msg = [
            0x08, 0x96, 0x01, 0x12, 2, b'k', b'1', 0x1d, 1, 2, 3, 4, 0x12, 2, b'k', b'2',
        ];
        assert_eq!(string_field(&msg, 2), Ok(Some(&b"k2"[..])));
        assert_eq!(string_field(&msg, 4), Ok(None));
        assert_eq!(string_field(&msg, 1), Err(WireError));
        assert_eq!(string_field(&[0x12, 0], 2), Ok(None));
        assert_eq!(string_field(&[0x12, 5, b'a'], 2), Err(WireError));
        assert_eq!(string_field(&[0x0b, 0x0c], 2), Err(WireError));
    }
}
