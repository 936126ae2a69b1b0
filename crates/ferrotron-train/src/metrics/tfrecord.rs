//! TFRecord framing, the container of TensorBoard event files
//! (`tensorflow/core/lib/io/record_writer.cc`, `tensorboard/summary/writer/record_writer.py`).
//!
//! Every record is
//!
//! | bytes | field |
//! |---|---|
//! | 8 | payload length `n`, u64 little-endian |
//! | 4 | masked CRC32C of those 8 length bytes, u32 little-endian |
//! | `n` | payload (here a serialized `tensorflow.Event`) |
//! | 4 | masked CRC32C of the payload, u32 little-endian |
//!
//! with `mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping, on u32).

use std::io::{self, Write};

/// Bytes of framing around each payload: length (8) + its CRC (4) + payload CRC (4).
pub const RECORD_OVERHEAD: usize = 16;

const MASK_DELTA: u32 = 0xa282_ead8;

/// TensorFlow's `MaskedCrc`: the CRC32C (Castagnoli) of `data`, rotated right by 15 bits
/// plus `0xa282ead8`, so that CRCs of data that itself holds CRCs stay well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Writes `payload` as one TFRecord to `out` (no flush).
///
/// # Errors
/// The I/O error of `out`.
pub fn write_record(out: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = (payload.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc32c(&len).to_le_bytes())?;
    out.write_all(payload)?;
    out.write_all(&masked_crc32c(payload).to_le_bytes())
}

/// Splits a whole TFRecord stream into its payloads, checking both CRCs of every record.
///
/// # Errors
/// [`io::ErrorKind::InvalidData`] naming the record index and byte offset for a truncated
/// record or a CRC mismatch (of the length or of the payload).
pub fn read_records(bytes: &[u8]) -> io::Result<Vec<&[u8]>> {
    let mut records = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        let index = records.len();
        let bad = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("TFRecord {index} at byte {pos}: {what}"),
            )
        };
        let header = bytes
            .get(pos..pos + 12)
            .ok_or_else(|| bad("truncated length header"))?;
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc32c(len_bytes) != read_u32(len_crc) {
            return Err(bad("length CRC mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        let len = usize::try_from(len).map_err(|_| bad("length does not fit in memory"))?;
        let start = pos + 12;
        let end = start
            .checked_add(len)
            .filter(|&end| end.saturating_add(4) <= bytes.len())
            .ok_or_else(|| bad(&format!("truncated payload of {len} bytes")))?;
        let payload = &bytes[start..end];
        if masked_crc32c(payload) != read_u32(&bytes[end..end + 4]) {
            return Err(bad("payload CRC mismatch"));
        }
        records.push(payload);
        pos = end + 4;
    }
    Ok(records)
}

fn read_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value_and_mask() {
        // The CRC-32C check value (RFC 3720 / iSCSI): crc32c("123456789") = 0xe3069283.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let crc = 0xe306_9283u32;
        let want = crc.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), want);
    }

    #[test]
    fn round_trip_and_corruption() {
        let mut buf = Vec::new();
        write_record(&mut buf, b"hello").unwrap();
        write_record(&mut buf, b"").unwrap();
        write_record(&mut buf, &[7u8; 300]).unwrap();
        assert_eq!(buf.len(), 3 * RECORD_OVERHEAD + 5 + 300);
        let recs = read_records(&buf).unwrap();
        assert_eq!(recs, vec![&b"hello"[..], &b""[..], &[7u8; 300][..]]);

        let mut flipped = buf.clone();
        flipped[14] ^= 1; // inside the first payload
        let err = read_records(&flipped).unwrap_err().to_string();
        assert!(
            err.contains("TFRecord 0 at byte 0: payload CRC mismatch"),
            "{err}"
        );

        let mut bad_len = buf.clone();
        bad_len[21 + 1] ^= 1; // the second record's length (starts at 21)
        let err = read_records(&bad_len).unwrap_err().to_string();
        assert!(
            err.contains("TFRecord 1 at byte 21: length CRC mismatch"),
            "{err}"
        );

        let err = read_records(&buf[..buf.len() - 1]).unwrap_err().to_string();
        assert!(
            err.contains("TFRecord 2") && err.contains("truncated payload"),
            "{err}"
        );
        let err = read_records(&buf[..30]).unwrap_err().to_string();
        assert!(err.contains("truncated length header"), "{err}");
    }
}
