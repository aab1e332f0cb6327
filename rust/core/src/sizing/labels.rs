//! The vocabulary of the sizing API: layer labels, group retentions and families, the kind of
//! a layer, and the check that every label is a known one.

use crate::error::{CoreError, CoreResult};

/// Layer label of a full-attention layer.
pub const FULL_ATTENTION: &str = "full_attention";
/// Layer label of a sliding-window attention layer.
pub const SLIDING_ATTENTION: &str = "sliding_attention";
/// Layer label of a linear-attention (state) layer.
pub const LINEAR_ATTENTION: &str = "linear_attention";
/// Layer label of a chunked local attention layer (a token attends its own chunk).
pub const CHUNKED_ATTENTION: &str = "chunked_attention";
/// Retention of a group that keeps every page.
pub const FULL_HISTORY: &str = "full_history";
/// Retention of a group that keeps the pages inside its window.
pub const SLIDING_WINDOW: &str = "sliding_window";
/// Retention of a group that keeps the pages of each request's current chunk.
pub const CHUNKED_WINDOW: &str = "chunked_window";
/// Family of a K/V history group.
pub const HISTORY: &str = "history";
/// Family of a recurrent-state group.
pub const STATE: &str = "state";

const KNOWN_LABELS: &str = "full_attention, sliding_attention, linear_attention, chunked_attention";

/// The kind of a layer, from its label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// `full_attention`: keeps all history.
    Full,
    /// `sliding_attention`: keeps the last `W - 1` tokens.
    Sliding,
    /// `linear_attention`: a constant-size recurrent state.
    Linear,
    /// `chunked_attention`: keeps the tokens of the current chunk of `C` (its window entry).
    Chunked,
}

impl LayerKind {
    /// The kind of a known label, or None.
    pub fn from_label(label: &str) -> Option<Self> {
        match label {
            FULL_ATTENTION => Some(Self::Full),
            SLIDING_ATTENTION => Some(Self::Sliding),
            LINEAR_ATTENTION => Some(Self::Linear),
            CHUNKED_ATTENTION => Some(Self::Chunked),
            _ => None,
        }
    }

    /// The label of this kind.
    pub fn label(self) -> &'static str {
        match self {
            Self::Full => FULL_ATTENTION,
            Self::Sliding => SLIDING_ATTENTION,
            Self::Linear => LINEAR_ATTENTION,
            Self::Chunked => CHUNKED_ATTENTION,
        }
    }

    /// The retention of the groups of this kind.
    pub fn retention(self) -> &'static str {
        match self {
            Self::Full | Self::Linear => FULL_HISTORY,
            Self::Sliding => SLIDING_WINDOW,
            Self::Chunked => CHUNKED_WINDOW,
        }
    }

    /// True for the kinds whose layers carry a window entry (a sliding window, or a chunk).
    pub fn is_windowed(self) -> bool {
        matches!(self, Self::Sliding | Self::Chunked)
    }

    /// True for state labels (`STATE_LAYER_TYPES`).
    pub fn is_state(self) -> bool {
        self == Self::Linear
    }

    /// The family of the groups of this kind.
    pub fn family(self) -> &'static str {
        if self.is_state() {
            STATE
        } else {
            HISTORY
        }
    }
}

/// A value that should be a `str`, as the bindings saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Text {
    /// A `str` (or subclass): compared by value.
    Str(String),
    /// Anything else, never equal to a label; holds `str(value)` for messages.
    Other(String),
}

impl Text {
    /// True when this is the str `s`.
    pub fn is(&self, s: &str) -> bool {
        matches!(self, Self::Str(v) if v == s)
    }

    /// The text shown in messages (`str(value)`).
    pub fn text(&self) -> &str {
        match self {
            Self::Str(v) | Self::Other(v) => v,
        }
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Self::Str(s.to_owned())
    }
}

/// Every label must be a known one.
pub(super) fn known_kinds(labels: &[String]) -> CoreResult<Vec<LayerKind>> {
    labels
        .iter()
        .enumerate()
        .map(|(i, label)| {
            LayerKind::from_label(label).ok_or_else(|| {
                CoreError::invalid(format!(
                    "unknown layer_type '{label}' at layer {i}; expected one of {KNOWN_LABELS}"
                ))
            })
        })
        .collect()
}
