//! The one error type of the core crate.
//!
//! Every variant carries enough context (the argument, the layer, the value) for the
//! bindings to raise a Python exception whose message stands on its own.

/// The message of [`CoreError::FlatUnavailable`]: flat tables asked of a build without the
/// `flat` feature.
pub const FLAT_UNAVAILABLE: &str = "flat per-group block tables are unavailable: this build of flat_kvcache \
                                    was compiled without the `flat` cargo feature";

/// Errors raised by the pure-Rust core.
///
/// The bindings map each variant to one Python exception class:
/// `InvalidArgument` -> `ValueError`, `Type` -> `TypeError`, `Overflow` -> `OverflowError`,
/// `Config` -> `RuntimeError`, `FlatUnavailable` -> `RuntimeError`, `UnknownRequest` and `UnknownSlot` -> `KeyError`,
/// `Invariant` -> `RuntimeError`,
/// `OutOfMemory` -> `MemoryError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A value that is out of its documented domain (negative size, unknown label, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// An argument of the wrong type (a bool or a non-int where an int is expected, ...).
    ///
    /// The bindings only report the facts (an [`IntArg`](crate::num::int::IntArg) says "bool" or
    /// "float"); the core raises this, so that type and value checks run in one order.
    #[error("{0}")]
    Type(String),
    /// An argument, or a size computed from `arg`, does not fit the native integer type.
    #[error("{arg} does not fit in an unsigned 64-bit integer")]
    Overflow {
        /// The argument (or expression over arguments) whose value overflowed.
        arg: String,
    },
    /// A configuration that cannot run (incompatible backend, missing groups, build flag off).
    #[error("{0}")]
    Config(String),
    /// Flat per-group block tables were asked of a build without the `flat` feature (SPEC 10).
    #[error("{}", FLAT_UNAVAILABLE)]
    FlatUnavailable,
    /// A request id that has no tables.
    #[error("unknown request id {0}")]
    UnknownRequest(String),
    /// A slot that holds no request, given to `method`.
    #[error("{method}: slot {slot} holds no request")]
    UnknownSlot {
        /// The method that was given the slot.
        method: String,
        /// The slot.
        slot: u64,
    },
    /// An engine invariant does not hold (the message describes the first violation).
    #[error("invariant violated: {0}")]
    Invariant(String),
    /// Memory for a structure sized from an argument could not be allocated.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
}

/// Shorthand for results of the core crate.
pub type CoreResult<T> = Result<T, CoreError>;

impl CoreError {
    /// An `InvalidArgument` error with a formatted message.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::InvalidArgument(msg.into())
    }

    /// An `Overflow` error naming the argument.
    pub fn overflow(arg: impl Into<String>) -> Self {
        Self::Overflow { arg: arg.into() }
    }
}
