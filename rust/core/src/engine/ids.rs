//! Request ids: a string or an integer of any size (`5` and `"5"` are different requests).
//!
//! [`RequestId`] owns its value and is stored as the map key; [`RequestIdRef`] borrows one for
//! lookups, so the per-step calls look a request up without allocating.

use std::fmt;
use std::hash::{Hash, Hasher};

use hashbrown::Equivalent;

/// An owned request id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestId {
    /// A string id.
    Str(Box<str>),
    /// An integer id that fits `i64`.
    Int(i64),
    /// A larger integer id, as its decimal text (sign included).
    BigInt(Box<str>),
}

/// A borrowed request id (same hash and equality as the [`RequestId`] it names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestIdRef<'a> {
    /// A string id.
    Str(&'a str),
    /// An integer id that fits `i64`.
    Int(i64),
    /// A larger integer id, as its decimal text (sign included).
    BigInt(&'a str),
}

impl RequestId {
    /// The borrowed form.
    pub fn as_ref(&self) -> RequestIdRef<'_> {
        match self {
            Self::Str(s) => RequestIdRef::Str(s),
            Self::Int(i) => RequestIdRef::Int(*i),
            Self::BigInt(s) => RequestIdRef::BigInt(s),
        }
    }
}

impl RequestIdRef<'_> {
    /// An owned copy.
    pub fn to_id(self) -> RequestId {
        match self {
            Self::Str(s) => RequestId::Str(s.into()),
            Self::Int(i) => RequestId::Int(i),
            Self::BigInt(s) => RequestId::BigInt(s.into()),
        }
    }
}

// Both forms hash a tag byte then the value, so a borrowed id finds its owned key.
impl Hash for RequestIdRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        match *self {
            Self::Str(s) => {
                state.write_u8(0);
                s.hash(state);
            }
            Self::Int(i) => {
                state.write_u8(1);
                state.write_i64(i);
            }
            Self::BigInt(s) => {
                state.write_u8(2);
                s.hash(state);
            }
        }
    }
}

impl Hash for RequestId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_ref().hash(state);
    }
}

impl Equivalent<RequestId> for RequestIdRef<'_> {
    fn equivalent(&self, key: &RequestId) -> bool {
        *self == key.as_ref()
    }
}

/// Whether Python's `str.isprintable()` holds for `c`. Rust's `escape_debug` leaves exactly
/// the same characters alone (neither escapes a character unless its category is Cc, Cf, Cs,
/// Co, Cn, Zl, Zp or Zs other than the space) except grapheme extenders, which it escapes
/// only at the start of a string: `c` is printable iff it stays bare after an `a`.
fn is_printable(c: char) -> bool {
    if c.is_ascii() {
        return matches!(c, ' '..='~');
    }
    let mut buf = [0u8; 8];
    buf[0] = b'a';
    let text = c.encode_utf8(&mut buf[1..]).len() + 1;
    std::str::from_utf8(&buf[..text]).is_ok_and(|s| s.escape_debug().nth(1) == Some(c))
}

/// `text` quoted the way Python's `repr` quotes a `str`: single quotes unless the text holds
/// a single quote and no double one; the quote, backslashes, `\t \n \r` escaped, and any
/// other non-printable character as `\xNN`, `\uNNNN` or `\UNNNNNNNN`.
fn write_py_str(f: &mut fmt::Formatter<'_>, text: &str) -> fmt::Result {
    use fmt::Write as _;
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    f.write_char(quote)?;
    for c in text.chars() {
        match c {
            '\\' => f.write_str("\\\\")?,
            '\t' => f.write_str("\\t")?,
            '\n' => f.write_str("\\n")?,
            '\r' => f.write_str("\\r")?,
            c if c == quote => write!(f, "\\{c}")?,
            c if is_printable(c) => f.write_char(c)?,
            c if u32::from(c) < 0x100 => write!(f, "\\x{:02x}", u32::from(c))?,
            c if u32::from(c) < 0x1_0000 => write!(f, "\\u{:04x}", u32::from(c))?,
            c => write!(f, "\\U{:08x}", u32::from(c))?,
        }
    }
    f.write_char(quote)
}

/// Python's `repr` of the id (`'abc'`, `"it's"` or `123`), cut to a bounded length for
/// messages (`...` after the quote when cut).
impl fmt::Display for RequestIdRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const LIMIT: usize = 80;
        let (text, quote) = match *self {
            Self::Str(s) => (s, true),
            Self::BigInt(s) => (s, false),
            Self::Int(i) => return write!(f, "{i}"),
        };
        let cut = text.char_indices().nth(LIMIT).map_or(text, |(i, _)| &text[..i]);
        let more = if cut.len() < text.len() { "..." } else { "" };
        if quote {
            write_py_str(f, cut)?;
            f.write_str(more)
        } else {
            write!(f, "{cut}{more}")
        }
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_ref().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use hashbrown::HashMap;

    use super::*;

    #[test]
    fn borrowed_ids_find_owned_keys_and_kinds_stay_apart() {
        let mut map: HashMap<RequestId, u8, rustc_hash::FxBuildHasher> = HashMap::default();
        map.insert(RequestId::Str("5".into()), 1);
        map.insert(RequestId::Int(5), 2);
        map.insert(RequestId::BigInt("99999999999999999999".into()), 3);
        assert_eq!(map.get(&RequestIdRef::Str("5")), Some(&1));
        assert_eq!(map.get(&RequestIdRef::Int(5)), Some(&2));
        assert_eq!(map.get(&RequestIdRef::BigInt("99999999999999999999")), Some(&3));
        assert_eq!(map.get(&RequestIdRef::Str("99999999999999999999")), None);
    }

    #[test]
    fn display_is_bounded() {
        assert_eq!(RequestIdRef::Int(-3).to_string(), "-3");
        assert_eq!(RequestIdRef::Str("a").to_string(), "'a'");
        // Python's repr: the quote that needs no escape, escapes for the rest.
        assert_eq!(RequestIdRef::Str("b'a'").to_string(), r#""b'a'""#);
        assert_eq!(RequestIdRef::Str("'\"").to_string(), r#"'\'"'"#);
        assert_eq!(RequestIdRef::Str("a\\b\n\u{7}").to_string(), r"'a\\b\n\x07'");
        assert_eq!(
            RequestIdRef::Str("é\u{a0}\u{200b}\u{301}").to_string(),
            "'é\\xa0\\u200b\u{301}'"
        );
        assert_eq!(RequestIdRef::Str("\u{10ffff}").to_string(), r"'\U0010ffff'");
        let long = "x".repeat(1000);
        assert!(RequestIdRef::Str(&long).to_string().len() < 100);
    }
}
