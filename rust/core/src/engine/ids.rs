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

/// Python-like text (`'abc'` or `123`), cut to a bounded length for messages.
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
            write!(f, "'{}'{more}", cut.escape_debug())
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
        let long = "x".repeat(1000);
        assert!(RequestIdRef::Str(&long).to_string().len() < 100);
    }
}
