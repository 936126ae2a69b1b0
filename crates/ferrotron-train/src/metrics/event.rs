//! The few `tensorflow.Event` protobuf fields a scalar event file needs, encoded and decoded
//! by hand (`tensorboard/compat/proto/event.proto`, `summary.proto`):
//!
//! ```text
//! message Event   { double wall_time = 1; int64 step = 2;
//!                   oneof what { string file_version = 3; Summary summary = 5; } }
//! message Summary { repeated Value value = 1; }
//! message Value   { string tag = 1; oneof value { float simple_value = 2; } }
//! ```
//!
//! Encoding follows proto3 as Python's `SerializeToString` does: fields in number order and
//! zero scalars (`wall_time`, `step`) left out, so the bytes equal TensorBoard's own.

use std::io;

/// One `Summary.Value` with a `simple_value` (what `SummaryWriter.add_scalar` writes).
#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    /// The series name, e.g. `lm loss`.
    pub tag: String,
    /// The value (protobuf `float`).
    pub value: f32,
}

/// The `what` oneof of an [`Event`].
#[derive(Clone, Debug, PartialEq)]
pub enum EventData {
    /// `file_version` (field 3): the first record of a file, `brain.Event:2`.
    FileVersion(String),
    /// `summary` (field 5) holding scalar values.
    Summary(Vec<Scalar>),
}

/// A `tensorflow.Event` restricted to wall time, step and file version or scalar summary.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch (field 1, `double`).
    pub wall_time: f64,
    /// Global step (field 2, `int64`); Ferrotron writes the iteration.
    pub step: i64,
    /// File version or summary.
    pub data: EventData,
}

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

impl Event {
    /// The serialized protobuf message.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        if self.wall_time != 0.0 {
            put_key(&mut out, 1, FIXED64);
            out.extend_from_slice(&self.wall_time.to_le_bytes());
        }
        if self.step != 0 {
            put_key(&mut out, 2, VARINT);
            put_varint(&mut out, self.step as u64); // int64: two's complement, 10 bytes if < 0
        }
        match &self.data {
            EventData::FileVersion(v) => put_bytes(&mut out, 3, v.as_bytes()),
            EventData::Summary(values) => {
                let mut summary = Vec::new();
                for s in values {
                    let mut value = Vec::new();
                    put_bytes(&mut value, 1, s.tag.as_bytes());
                    put_key(&mut value, 2, FIXED32);
                    value.extend_from_slice(&s.value.to_le_bytes());
                    put_bytes(&mut summary, 1, &value);
                }
                put_bytes(&mut out, 5, &summary);
            }
        }
        out
    }

    /// Parses a serialized `Event`, skipping fields other than the ones above (so it reads
    /// events written by TensorFlow or PyTorch too). An event with neither `file_version`
    /// nor `summary` decodes as an empty summary; a `Value` without `simple_value` as 0.
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidData`] for malformed protobuf (truncated varint or field,
    /// unsupported wire type, non-UTF-8 string), naming the message and field.
    pub fn decode(bytes: &[u8]) -> io::Result<Event> {
        let mut event = Event {
            wall_time: 0.0,
            step: 0,
            data: EventData::Summary(Vec::new()),
        };
        let mut r = Reader::new(bytes, "Event");
        while let Some((field, wire)) = r.key()? {
            match (field, wire) {
                (1, FIXED64) => event.wall_time = f64::from_le_bytes(r.fixed::<8>()?),
                (2, VARINT) => event.step = r.varint()? as i64,
                (3, LEN) => event.data = EventData::FileVersion(r.string("file_version")?),
                (5, LEN) => event.data = EventData::Summary(decode_summary(r.bytes()?)?),
                _ => r.skip(field, wire)?,
            }
        }
        Ok(event)
    }
}

fn decode_summary(bytes: &[u8]) -> io::Result<Vec<Scalar>> {
    let mut values = Vec::new();
    let mut r = Reader::new(bytes, "Summary");
    while let Some((field, wire)) = r.key()? {
        match (field, wire) {
            (1, LEN) => values.push(decode_value(r.bytes()?)?),
            _ => r.skip(field, wire)?,
        }
    }
    Ok(values)
}

fn decode_value(bytes: &[u8]) -> io::Result<Scalar> {
    let mut scalar = Scalar {
        tag: String::new(),
        value: 0.0,
    };
    let mut r = Reader::new(bytes, "Summary.Value");
    while let Some((field, wire)) = r.key()? {
        match (field, wire) {
            (1, LEN) => scalar.tag = r.string("tag")?,
            (2, FIXED32) => scalar.value = f32::from_le_bytes(r.fixed::<4>()?),
            _ => r.skip(field, wire)?,
        }
    }
    Ok(scalar)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, u64::from(field << 3 | u32::from(wire)));
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A cursor over one protobuf message.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    message: &'static str,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], message: &'static str) -> Self {
        Reader {
            buf,
            pos: 0,
            message,
        }
    }

    fn err(&self, what: &str) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("protobuf {} at byte {}: {what}", self.message, self.pos),
        )
    }

    /// The next field number and wire type, or `None` at the end of the message.
    fn key(&mut self) -> io::Result<Option<(u32, u8)>> {
        if self.pos == self.buf.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let field = u32::try_from(key >> 3).map_err(|_| self.err("field number too large"))?;
        Ok(Some((field, (key & 7) as u8)))
    }

    fn varint(&mut self) -> io::Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .buf
                .get(self.pos)
                .ok_or_else(|| self.err("truncated varint"))?;
            self.pos += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| self.err(&format!("truncated field of {n} bytes")))?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn fixed<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let len = self.varint()?;
        let len = usize::try_from(len).map_err(|_| self.err("length too large"))?;
        self.take(len)
    }

    fn string(&mut self, field: &str) -> io::Result<String> {
        let bytes = self.bytes()?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(&format!("{field} is not UTF-8")))
    }

    fn skip(&mut self, field: u32, wire: u8) -> io::Result<()> {
        match wire {
            VARINT => self.varint().map(drop),
            FIXED64 => self.take(8).map(drop),
            LEN => self.bytes().map(drop),
            FIXED32 => self.take(4).map(drop),
            _ => Err(self.err(&format!("field {field} has unsupported wire type {wire}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Bytes from TensorBoard's own protobuf classes (`tensorboard.compat.proto.event_pb2`,
    /// tensorboard 2.21.0): `Event(wall_time=1700000001.25, step=10,
    /// summary=Summary(value=[Summary.Value(tag="lm loss", simple_value=3.21)]))`.
    const SCALAR_EVENT: &str = "0900005040fc54d941100a2a100a0e0a076c6d206c6f737315a4704d40";

    fn scalar_event() -> Event {
        Event {
            wall_time: 1_700_000_001.25,
            step: 10,
            data: EventData::Summary(vec![Scalar {
                tag: "lm loss".into(),
                value: 3.21,
            }]),
        }
    }

    #[test]
    fn encodes_like_tensorboard() {
        assert_eq!(scalar_event().encode(), hex(SCALAR_EVENT));
        assert_eq!(Event::decode(&hex(SCALAR_EVENT)).unwrap(), scalar_event());
    }

    #[test]
    fn round_trips_file_version_and_large_negative_steps() {
        for (step, data) in [
            (0, EventData::FileVersion("brain.Event:2".into())),
            (-3, EventData::Summary(Vec::new())),
            (i64::MAX, EventData::Summary(vec![])),
        ] {
            let e = Event {
                wall_time: 12.5,
                step,
                data,
            };
            assert_eq!(Event::decode(&e.encode()).unwrap(), e);
        }
    }

    #[test]
    fn skips_unknown_fields_and_rejects_garbage() {
        // Event{step: 7, source_metadata (field 10, LEN): "xy", summary: {}}
        let bytes = [0x10, 7, 0x52, 2, b'x', b'y', 0x2a, 0];
        let e = Event::decode(&bytes).unwrap();
        assert_eq!((e.step, e.data), (7, EventData::Summary(vec![])));

        let err = Event::decode(&[0x09, 1, 2]).unwrap_err().to_string();
        assert!(
            err.contains("Event") && err.contains("truncated field"),
            "{err}"
        );
        let err = Event::decode(&[0x2a, 3, 0x0a, 5, 0x0a])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Summary") && err.contains("truncated"),
            "{err}"
        );
        let err = Event::decode(&[0x0b]).unwrap_err().to_string();
        assert!(err.contains("unsupported wire type 3"), "{err}");
        let err = Event::decode(&[0x1a, 1, 0xff]).unwrap_err().to_string();
        assert!(err.contains("file_version is not UTF-8"), "{err}");
    }
}
