//! Msgpack read in place, value by value, from a message's bytes: what the KV event batches
//! need, with no tree of values built. Decoding a batch into `rmpv::Value`s made one heap value
//! per token id, and was a sixth of the exact index's cost for new text.
//!
//! The markers are rmp's ([`rmp::Marker`]). The reads are written here: rmp's own
//! (`rmp::decode`) read through `io::Read` and cannot hand back a value's bytes or skip a
//! value, which the two wire forms need (an event's fields are found by position or by name,
//! and fields this version does not know are passed over). A skip is a loop over a count of
//! values still to pass, never a recursion, so no nesting a publisher sends can exhaust the
//! stack. (So a value nested deeper than `rmpv`'s limit, about 500 levels, is passed over
//! here where `rmpv` refused the message: in a field the index does not read, a batch is now
//! taken.)

use rmp::Marker;

/// A position in a message.
#[derive(Clone, Copy)]
pub struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Cursor { rest: bytes }
    }

    /// The next value's marker, without moving past it.
    pub fn peek(&self) -> Option<Marker> {
        self.rest.first().map(|byte| Marker::from_u8(*byte))
    }

    fn marker(&mut self) -> Option<Marker> {
        let marker = self.peek()?;
        self.rest = &self.rest[1..];
        Some(marker)
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.rest.len() < n {
            return None;
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Some(taken)
    }

    /// A big-endian unsigned integer of `n` bytes (1 to 8).
    fn be(&mut self, n: usize) -> Option<u64> {
        Some(
            self.take(n)?
                .iter()
                .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte)),
        )
    }

    /// Whether the next value is nil (not moved past).
    pub fn is_nil(&self) -> bool {
        self.peek() == Some(Marker::Null)
    }

    /// The length of the array that starts here, moved past its header; `None` (not moved)
    /// when the next value is no array.
    pub fn array(&mut self) -> Option<usize> {
        self.sized(|marker| match marker {
            Marker::FixArray(n) => Some(Length::Inline(n)),
            Marker::Array16 => Some(Length::Next(2)),
            Marker::Array32 => Some(Length::Next(4)),
            _ => None,
        })
    }

    /// The number of pairs of the map that starts here, moved past its header; `None` (not
    /// moved) when the next value is no map.
    pub fn map(&mut self) -> Option<usize> {
        self.sized(|marker| match marker {
            Marker::FixMap(n) => Some(Length::Inline(n)),
            Marker::Map16 => Some(Length::Next(2)),
            Marker::Map32 => Some(Length::Next(4)),
            _ => None,
        })
    }

    /// The length the next marker gives, when `kind` says it is one: moved past the marker
    /// and the length, or not moved at all.
    fn sized(&mut self, kind: impl Fn(Marker) -> Option<Length>) -> Option<usize> {
        let mut probe = *self;
        let len = match kind(probe.marker()?)? {
            Length::Inline(n) => usize::from(n),
            Length::Next(bytes) => probe.be(bytes)? as usize,
        };
        *self = probe;
        Some(len)
    }

    /// The integer that starts here, as a two's complement 64-bit value, and whether it was
    /// written as a negative one; `None` (not moved) when it is no integer.
    fn integer(&mut self) -> Option<(u64, bool)> {
        let mut probe = *self;
        let read = match probe.marker()? {
            Marker::FixPos(n) => (u64::from(n), false),
            Marker::FixNeg(n) => (i64::from(n) as u64, true),
            Marker::U8 => (probe.be(1)?, false),
            Marker::U16 => (probe.be(2)?, false),
            Marker::U32 => (probe.be(4)?, false),
            Marker::U64 => (probe.be(8)?, false),
            Marker::I8 => signed(probe.be(1)? as u8 as i8 as i64),
            Marker::I16 => signed(probe.be(2)? as u16 as i16 as i64),
            Marker::I32 => signed(probe.be(4)? as u32 as i32 as i64),
            Marker::I64 => signed(probe.be(8)? as i64),
            _ => return None,
        };
        *self = probe;
        Some(read)
    }

    /// A non-negative integer; `None` (not moved) for anything else.
    pub fn unsigned(&mut self) -> Option<u64> {
        let mut probe = *self;
        match probe.integer()? {
            (n, false) => {
                *self = probe;
                Some(n)
            }
            (_, true) => None,
        }
    }

    /// An integer, negative ones as their two's complement; `None` (not moved) for anything
    /// else.
    pub fn bits(&mut self) -> Option<u64> {
        self.integer().map(|(n, _)| n)
    }

    /// An integer that fits in an `i64`; `None` (not moved) for anything else.
    pub fn signed(&mut self) -> Option<i64> {
        let mut probe = *self;
        let (n, negative) = probe.integer()?;
        if !negative && n > i64::MAX as u64 {
            return None;
        }
        *self = probe;
        Some(n as i64)
    }

    /// A number as a float (an integer cast, as `rmpv::Value::as_f64` does); `None` (not
    /// moved) for anything else.
    pub fn float(&mut self) -> Option<f64> {
        let mut probe = *self;
        let value = match probe.peek()? {
            Marker::F32 => {
                probe.marker()?;
                f64::from(f32::from_bits(probe.be(4)? as u32))
            }
            Marker::F64 => {
                probe.marker()?;
                f64::from_bits(probe.be(8)?)
            }
            _ => match probe.integer()? {
                (n, false) => n as f64,
                (n, true) => n as i64 as f64,
            },
        };
        *self = probe;
        Some(value)
    }

    /// The bytes of a string or a binary; `None` (not moved) for anything else.
    pub fn bytes(&mut self) -> Option<&'a [u8]> {
        let mut probe = *self;
        let len = probe.sized(|marker| match marker {
            Marker::FixStr(n) => Some(Length::Inline(n)),
            Marker::Str8 | Marker::Bin8 => Some(Length::Next(1)),
            Marker::Str16 | Marker::Bin16 => Some(Length::Next(2)),
            Marker::Str32 | Marker::Bin32 => Some(Length::Next(4)),
            _ => None,
        })?;
        let bytes = probe.take(len)?;
        *self = probe;
        Some(bytes)
    }

    /// A string that is UTF-8; `None` (not moved) for anything else.
    pub fn str(&mut self) -> Option<&'a str> {
        let mut probe = *self;
        if !matches!(
            probe.peek()?,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
        ) {
            return None;
        }
        let text = std::str::from_utf8(probe.bytes()?).ok()?;
        *self = probe;
        Some(text)
    }

    /// The bytes of the next value, whole, moved past it; `None` when the message ends
    /// inside it.
    pub fn value(&mut self) -> Option<&'a [u8]> {
        let start = self.rest;
        // Values still to pass: an array adds its items, a map its keys and values.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let marker = self.marker()?;
            let skip = match marker {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => 0,
                // Never written by msgpack: the message is no msgpack.
                Marker::Reserved => return None,
                Marker::U8 | Marker::I8 => 1,
                Marker::U16 | Marker::I16 => 2,
                Marker::U32 | Marker::I32 | Marker::F32 => 4,
                Marker::U64 | Marker::I64 | Marker::F64 => 8,
                Marker::FixStr(n) => usize::from(n),
                Marker::Str8 | Marker::Bin8 => self.be(1)? as usize,
                Marker::Str16 | Marker::Bin16 => self.be(2)? as usize,
                Marker::Str32 | Marker::Bin32 => self.be(4)? as usize,
                // An extension: its type byte, then its data.
                Marker::FixExt1 => 2,
                Marker::FixExt2 => 3,
                Marker::FixExt4 => 5,
                Marker::FixExt8 => 9,
                Marker::FixExt16 => 17,
                Marker::Ext8 => (self.be(1)? as usize).checked_add(1)?,
                Marker::Ext16 => (self.be(2)? as usize).checked_add(1)?,
                Marker::Ext32 => (self.be(4)? as usize).checked_add(1)?,
                Marker::FixArray(n) => {
                    pending += u64::from(n);
                    0
                }
                Marker::Array16 => {
                    pending += self.be(2)?;
                    0
                }
                Marker::Array32 => {
                    pending += self.be(4)?;
                    0
                }
                Marker::FixMap(n) => {
                    pending += 2 * u64::from(n);
                    0
                }
                Marker::Map16 => {
                    pending += 2 * self.be(2)?;
                    0
                }
                Marker::Map32 => {
                    pending += 2 * self.be(4)?;
                    0
                }
            };
            self.take(skip)?;
        }
        Some(&start[..start.len() - self.rest.len()])
    }

    /// The bytes left after the cursor.
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }
}

/// Where a marker's length is: in the marker itself, or in the next so many bytes.
enum Length {
    Inline(u8),
    Next(usize),
}

fn signed(n: i64) -> (u64, bool) {
    (n as u64, n < 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn encode(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, value).unwrap();
        out
    }

    #[test]
    fn integers_floats_and_strings_read_as_rmpv_reads_them() {
        for n in [
            0u64,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u32::MAX as u64,
            u64::MAX,
        ] {
            let bytes = encode(&Value::from(n));
            assert_eq!(Cursor::new(&bytes).unsigned(), Some(n), "{n}");
            assert_eq!(Cursor::new(&bytes).bits(), Some(n), "{n}");
        }
        for n in [
            -1i64,
            -32,
            -33,
            -128,
            -129,
            -32_768,
            -32_769,
            i32::MIN as i64,
            i64::MIN,
        ] {
            let bytes = encode(&Value::from(n));
            assert_eq!(Cursor::new(&bytes).unsigned(), None, "{n}");
            assert_eq!(Cursor::new(&bytes).bits(), Some(n as u64), "{n}");
            assert_eq!(Cursor::new(&bytes).signed(), Some(n), "{n}");
        }
        assert_eq!(Cursor::new(&encode(&Value::from(u64::MAX))).signed(), None);
        assert_eq!(Cursor::new(&encode(&Value::F64(1.5))).float(), Some(1.5));
        assert_eq!(Cursor::new(&encode(&Value::F32(0.25))).float(), Some(0.25));
        assert_eq!(Cursor::new(&encode(&Value::from(3))).float(), Some(3.0));
        assert_eq!(Cursor::new(&encode(&Value::from(-3))).float(), Some(-3.0));
        assert_eq!(Cursor::new(&encode(&Value::Nil)).float(), None);
        let long = "x".repeat(70_000);
        assert_eq!(
            Cursor::new(&encode(&Value::from(&*long))).str(),
            Some(&*long)
        );
        let binary = encode(&Value::Binary(vec![1, 2, 3]));
        assert_eq!(Cursor::new(&binary).str(), None);
        assert_eq!(Cursor::new(&binary).bytes(), Some(&[1u8, 2, 3][..]));
    }

    #[test]
    fn a_value_is_passed_whole_and_a_cut_one_is_not() {
        let nested = Value::Array(vec![
            Value::Map(vec![(Value::from("k"), Value::Array(vec![Value::Nil; 20]))]),
            Value::Ext(7, vec![0; 300]),
            Value::from(u64::MAX),
            Value::F32(1.0),
            Value::Binary(vec![9; 70_000]),
        ]);
        let mut bytes = encode(&nested);
        bytes.push(0xc0);
        let mut cursor = Cursor::new(&bytes);
        assert_eq!(cursor.value().map(<[u8]>::len), Some(bytes.len() - 1));
        assert!(cursor.is_nil());
        for cut in 0..bytes.len() - 1 {
            assert_eq!(Cursor::new(&bytes[..cut]).value(), None, "cut at {cut}");
        }
    }

    #[test]
    fn deep_nesting_is_passed_without_recursion() {
        // A million nested one-item arrays: a recursive reader would exhaust the stack.
        let mut bytes = vec![0x91; 1_000_000];
        bytes.push(0x01);
        assert_eq!(
            Cursor::new(&bytes).value().map(<[u8]>::len),
            Some(bytes.len())
        );
    }

    #[test]
    fn a_wrong_kind_leaves_the_cursor_where_it_was() {
        let bytes = encode(&Value::from("text"));
        let mut cursor = Cursor::new(&bytes);
        assert_eq!(cursor.array(), None);
        assert_eq!(cursor.map(), None);
        assert_eq!(cursor.unsigned(), None);
        assert_eq!(cursor.float(), None);
        assert_eq!(cursor.str(), Some("text"));
        assert!(cursor.rest().is_empty());
    }
}
