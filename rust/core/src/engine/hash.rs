//! Content hashes and group keys (SPEC 4).
//!
//! A page's content hash chains over the previous page's hash:
//! `h_i = SHA-256(len(prior) | prior | len(tokens) | tokens.. [| len(extra) | (len(key) | key)..])`
//! with every integer a little-endian `u32`. Hashes are kept as raw 32-byte arrays here;
//! lowercase hex exists only at the Python boundary ([`to_hex`], [`parse_hex`]).
//!
//! A *group key* is a content hash plus the group index ([`GroupKey`]). Groups whose page is
//! `m` base pages wide fold each aligned run of `m` base hashes into one key ([`fold_run`]).

use std::hash::{Hash, Hasher};

use sha2::digest::generic_array::GenericArray;
use sha2::{Digest, Sha256};

use crate::error::{CoreError, CoreResult};

/// A raw SHA-256 content hash.
pub type ContentHash = [u8; 32];

/// A page key of one group: the (possibly folded) content hash and the group index.
///
/// As text it is the hash's 64 hex digits followed by the group as 8 hex digits (big-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupKey {
    /// The content hash (folded for groups wider than the base page).
    pub hash: ContentHash,
    /// The group index within its cache.
    pub group: u32,
}

impl Hash for GroupKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The hash is SHA-256 output, so its first 8 bytes are already uniformly spread; one
        // `write_u64` keeps the hash-map cost of a key at a single multiply with FxHasher.
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.hash[..8]);
        state.write_u64(u64::from_le_bytes(head) ^ u64::from(self.group).rotate_left(29));
    }
}

impl GroupKey {
    /// The key of `hash` in group `group`.
    pub fn new(hash: ContentHash, group: u32) -> Self {
        Self { hash, group }
    }

    /// The key as text: 64 lowercase hex digits of the hash, then the group as 8 hex digits.
    pub fn to_hex(&self) -> String {
        format!("{}{:08x}", to_hex(&self.hash), self.group)
    }
}

/// Hash a little-endian `u32` length field for `what`, or fail if `len` does not fit.
fn len_field(len: usize, what: &str) -> CoreResult<[u8; 4]> {
    u32::try_from(len)
        .map(u32::to_le_bytes)
        .map_err(|_| CoreError::invalid(format!("{what}: length {len} does not fit in u32")))
}

/// Feed `tokens` to the hasher as little-endian `u32`s, 64 at a time through a stack buffer.
fn update_tokens(hasher: &mut Sha256, tokens: &[u32]) {
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(64) {
        for (dst, tok) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&tok.to_le_bytes());
        }
        hasher.update(&buf[..chunk.len() * 4]);
    }
}

/// SHA-256 initial state (FIPS 180-4, 5.3.3).
const SHA256_INIT: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// Messages up to this many bytes are hashed in one shot from a stack buffer.
const ONE_SHOT_MAX: usize = 512 - 9;

/// SHA-256 of `buf[..len]`, padding in place (`buf` must hold the padded length, a multiple
/// of 64 at least `len + 9`) and running the raw block function: no streaming buffer, which is
/// most of the cost for the ~100-byte messages of a 16-token page.
fn sha256_one_shot(buf: &mut [u8], len: usize) -> ContentHash {
    let total = (len + 9).div_ceil(64) * 64;
    buf[len] = 0x80;
    buf[len + 1..total - 8].fill(0);
    // len < 512 here, so the bit length fits easily.
    buf[total - 8..total].copy_from_slice(&(len as u64 * 8).to_be_bytes());
    let mut state = SHA256_INIT;
    for block in buf[..total].chunks_exact(64) {
        sha2::compress256(&mut state, std::slice::from_ref(GenericArray::from_slice(block)));
    }
    let mut out = [0u8; 32];
    for (dst, word) in out.chunks_exact_mut(4).zip(state) {
        dst.copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// Appends bytes to a fixed stack buffer (capacity checked by the caller).
struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.buf[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
    }

    #[inline]
    fn put_hash(&mut self, hash: &ContentHash) {
        self.buf[self.at..self.at + 32].copy_from_slice(hash);
        self.at += 32;
    }

    /// Each token as 4 little-endian bytes, in one pass over the destination.
    #[inline]
    fn put_tokens(&mut self, tokens: &[u32]) {
        let end = self.at + tokens.len() * 4;
        for (dst, t) in self.buf[self.at..end].chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        self.at = end;
    }
}

/// The content hash of one page (SPEC 4 layout).
///
/// `prior` is the raw bytes of the previous page's hash (empty for the first page) and each
/// extra key is hashed as its byte length then its bytes (the UTF-8 of a string key). The
/// extra-key section is present only when `extra_keys` is non-empty.
pub fn hash_page<K: AsRef<[u8]>>(tokens: &[u32], prior: &[u8], extra_keys: &[K]) -> CoreResult<ContentHash> {
    let prior_len = len_field(prior.len(), "prior")?;
    let token_count = len_field(tokens.len(), "tokens")?;
    let extra_len: usize = if extra_keys.is_empty() {
        0
    } else {
        4 + extra_keys
            .iter()
            .map(|k| 4usize.saturating_add(k.as_ref().len()))
            .fold(0usize, usize::saturating_add)
    };
    // Saturating: any saturated length is far above ONE_SHOT_MAX and takes the streaming path.
    let len = (8 + prior.len())
        .saturating_add(tokens.len().saturating_mul(4))
        .saturating_add(extra_len);
    if len <= ONE_SHOT_MAX {
        let mut buf = [0u8; 512];
        let mut w = Writer { buf: &mut buf, at: 0 };
        w.put(&prior_len);
        // A chained page's prior is always a 32-byte hash: a fixed-size copy, not a memcpy call.
        if let Ok(hash) = <&ContentHash>::try_from(prior) {
            w.put_hash(hash);
        } else {
            w.put(prior);
        }
        w.put(&token_count);
        w.put_tokens(tokens);
        if !extra_keys.is_empty() {
            w.put(&len_field(extra_keys.len(), "extra_keys")?);
            for key in extra_keys {
                w.put(&len_field(key.as_ref().len(), "extra_keys")?);
                w.put(key.as_ref());
            }
        }
        return Ok(sha256_one_shot(&mut buf, len));
    }
    let mut hasher = Sha256::new();
    hasher.update(prior_len);
    hasher.update(prior);
    hasher.update(token_count);
    update_tokens(&mut hasher, tokens);
    if !extra_keys.is_empty() {
        hasher.update(len_field(extra_keys.len(), "extra_keys")?);
        for key in extra_keys {
            let key = key.as_ref();
            hasher.update(len_field(key.len(), "extra_keys")?);
            hasher.update(key);
        }
    }
    Ok(hasher.finalize().into())
}

/// The chained content hashes of the full pages of `tokens` (a trailing partial page is ignored).
///
/// `h_0 = hash_page(page_0, prior, extra_keys)`, `h_i = hash_page(page_i, h_{i-1}, extra_keys)`.
pub fn hash_pages<K: AsRef<[u8]>>(
    tokens: &[u32],
    page_size: usize,
    prior: &[u8],
    extra_keys: &[K],
) -> CoreResult<Vec<ContentHash>> {
    if page_size == 0 {
        return Err(CoreError::invalid("page_size must be > 0, got 0"));
    }
    let mut out: Vec<ContentHash> = Vec::with_capacity(tokens.len() / page_size);
    for page in tokens.chunks_exact(page_size) {
        let next = match out.last() {
            Some(prev) => hash_page(page, prev, extra_keys)?,
            None => hash_page(page, prior, extra_keys)?,
        };
        out.push(next);
    }
    Ok(out)
}

/// Fold a run of base-page keys into one: `run = ""`, then `run = hash_page([], run, [key])`
/// for each key in order. `keys` are the byte strings hashed as extra keys (for content hashes,
/// their lowercase hex text; see [`fold_run`]).
pub fn fold_run_keys<K: AsRef<[u8]>>(keys: &[K]) -> CoreResult<Option<ContentHash>> {
    let mut run: Option<ContentHash> = None;
    for key in keys {
        let prior: &[u8] = run.as_ref().map_or(&[], |r| r.as_slice());
        run = Some(hash_page(&[], prior, std::slice::from_ref(key))?);
    }
    Ok(run)
}

/// Fold a run of raw base hashes into one group hash (each hash enters as its lowercase hex).
///
/// Same bytes as [`fold_run_keys`] over the hex texts, without building strings. An empty run
/// (never requested: folds are over `m >= 1` hashes) returns all zeros.
pub fn fold_run(run_of: &[ContentHash]) -> ContentHash {
    let mut run: Option<ContentHash> = None;
    // len(prior) | prior (0 or 32 bytes) | 0 tokens | 1 key | 64 | the hash's hex text
    let mut buf = [0u8; 128];
    for h in run_of {
        let mut w = Writer { buf: &mut buf, at: 0 };
        match &run {
            Some(prior) => {
                w.put(&32u32.to_le_bytes());
                w.put(prior);
            }
            None => w.put(&0u32.to_le_bytes()),
        }
        w.put(&0u32.to_le_bytes());
        w.put(&1u32.to_le_bytes());
        w.put(&64u32.to_le_bytes());
        let at = w.at;
        let mut text = [0u8; 64];
        hex_into(h, &mut text);
        buf[at..at + 64].copy_from_slice(&text);
        run = Some(sha256_one_shot(&mut buf, at + 64));
    }
    run.unwrap_or_default()
}

/// Number of leading base hashes a fold starting at base page `first_base` skips to reach the
/// next multiple of `m` (`m > 0`).
pub fn fold_skip(first_base: u64, m: u64) -> u64 {
    match first_base % m {
        0 => 0,
        r => m - r,
    }
}

/// Validate the fold arguments and return `(skip, runs)`: the base hashes skipped at the front
/// and the number of complete runs of `m` after them (`skip + runs * m <= len`).
pub fn fold_layout(len: usize, first_base: u64, m: u64) -> CoreResult<(usize, usize)> {
    if m == 0 {
        return Err(CoreError::invalid("m must be > 0, got 0"));
    }
    let skip = usize::try_from(fold_skip(first_base, m)).map_or(len, |s| s.min(len));
    let runs = usize::try_from(m).map_or(0, |m| (len - skip) / m);
    Ok((skip, runs))
}

/// Fold raw base hashes into group hashes (SPEC 4): `base[j]` is base page `first_base + j`;
/// complete aligned runs of `m` are folded and incomplete runs at either end dropped.
/// With `m == 1` the hashes are returned unchanged.
pub fn fold_hashes(base: &[ContentHash], first_base: u64, m: u64) -> CoreResult<Vec<ContentHash>> {
    let (skip, runs) = fold_layout(base.len(), first_base, m)?;
    if m == 1 {
        return Ok(base.to_vec());
    }
    // `runs > 0` implies `m <= len`, so `m` fits usize; with no runs there is nothing to fold.
    let Ok(width) = usize::try_from(m) else {
        return Ok(Vec::new());
    };
    Ok(base[skip..].chunks_exact(width).take(runs).map(fold_run).collect())
}

/// Lowercase hex text of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let text: Vec<u8> = bytes
        .iter()
        .flat_map(|b| [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 0xf)]])
        .collect();
    // Only ASCII digits were written.
    String::from_utf8(text).unwrap_or_default()
}

/// Write the 64 lowercase hex digits of `hash` into `out`.
pub fn hex_into(hash: &ContentHash, out: &mut [u8; 64]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, b) in out.chunks_exact_mut(2).zip(hash) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

/// Value of each ASCII byte as a hex digit, or 0xff.
const HEX_VALUE: [u8; 256] = {
    let mut table = [0xffu8; 256];
    let mut i = 0u8;
    while i < 10 {
        table[(b'0' + i) as usize] = i;
        i += 1;
    }
    let mut i = 0u8;
    while i < 6 {
        table[(b'a' + i) as usize] = 10 + i;
        table[(b'A' + i) as usize] = 10 + i;
        i += 1;
    }
    table
};

/// Decode one pair of hex digits.
#[inline]
fn hex_pair(hi: u8, lo: u8) -> Option<u8> {
    let (h, l) = (HEX_VALUE[usize::from(hi)], HEX_VALUE[usize::from(lo)]);
    if (h | l) & 0xf0 != 0 {
        None
    } else {
        Some(h << 4 | l)
    }
}

/// Parse hex text of even length (either case) into bytes; `None` if it is not hex.
pub fn parse_hex(text: &[u8]) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    text.chunks_exact(2).map(|p| hex_pair(p[0], p[1])).collect()
}

/// Decode 8 ASCII hex digits into 4 bytes, eight at a time in one `u64` (SWAR); `None` if
/// any byte is not a hex digit (with `LOWER_ONLY`, not a digit or `a`..`f`). Four times fewer
/// steps than a per-digit table walk, which dominated parsing content hashes at the Python
/// boundary.
#[inline]
fn hex8<const LOWER_ONLY: bool>(chunk: [u8; 8]) -> Option<[u8; 4]> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let x = u64::from_le_bytes(chunk);
    if x & HIGH != 0 {
        return None; // not ASCII
    }
    // Per byte (all < 0x80 now): the high bit of `b + 0x80 - a` is set iff `b >= a`, and
    // the sum stays below 0x100, so no carry crosses bytes.
    let ge = |v: u64, a: u64| v.wrapping_add((0x80 - a) * ONES) & HIGH;
    let digit = ge(x, 0x30) & !ge(x, 0x3a);
    // Setting bit 0x20 maps 'A'..'F' onto 'a'..'f'; only those two ranges land in 'a'..'f'.
    // Digits already have bit 0x20 set, so `lower` equals `x` on them.
    let lower = if LOWER_ONLY { x } else { x | (0x20 * ONES) };
    let alpha = ge(lower, 0x61) & !ge(lower, 0x67);
    if (digit | alpha) != HIGH {
        return None;
    }
    // Nibble per byte: the low 4 bits, plus 9 for letters ('a' = 0x61 -> 1 + 9 = 10).
    let nibbles = (lower & (0x0f * ONES)) + (alpha >> 7) * 9;
    // Byte 2k holds the high nibble and byte 2k+1 the low nibble of output byte k.
    let pairs = ((nibbles & 0x00ff_00ff_00ff_00ff) << 4) | ((nibbles >> 8) & 0x00ff_00ff_00ff_00ff);
    let packed = (pairs | (pairs >> 8)) & 0x0000_ffff_0000_ffff;
    let packed = (packed | (packed >> 16)) & 0xffff_ffff;
    let [b0, b1, b2, b3, ..] = packed.to_le_bytes();
    Some([b0, b1, b2, b3])
}

/// Parse exactly 64 hex digits into a raw hash (either case unless `LOWER_ONLY`).
#[inline]
fn parse_hash_impl<const LOWER_ONLY: bool>(text: &[u8]) -> Option<ContentHash> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (dst, src) in out.chunks_exact_mut(4).zip(text.chunks_exact(8)) {
        let mut chunk = [0u8; 8];
        chunk.copy_from_slice(src);
        dst.copy_from_slice(&hex8::<LOWER_ONLY>(chunk)?);
    }
    Some(out)
}

/// Parse exactly 64 hex digits (either case) into a raw hash; `None` otherwise.
pub fn parse_hash(text: &[u8]) -> Option<ContentHash> {
    parse_hash_impl::<false>(text)
}

/// Parse exactly 64 **lowercase** hex digits into a raw hash; `None` otherwise (uppercase
/// included). Content hashes given to the engine must be lowercase: folding hashes their
/// text, so two spellings of one hash would fold to different group keys.
pub fn parse_hash_lower(text: &[u8]) -> Option<ContentHash> {
    parse_hash_impl::<true>(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SPEC 4 input built by hand, field by field, then hashed with a fresh SHA-256.
    fn manual(tokens: &[u32], prior: &[u8], extra: &[&str]) -> ContentHash {
        let mut msg: Vec<u8> = Vec::new();
        msg.extend_from_slice(&u32::try_from(prior.len()).unwrap().to_le_bytes());
        msg.extend_from_slice(prior);
        msg.extend_from_slice(&u32::try_from(tokens.len()).unwrap().to_le_bytes());
        for t in tokens {
            msg.extend_from_slice(&t.to_le_bytes());
        }
        if !extra.is_empty() {
            msg.extend_from_slice(&u32::try_from(extra.len()).unwrap().to_le_bytes());
            for k in extra {
                msg.extend_from_slice(&u32::try_from(k.len()).unwrap().to_le_bytes());
                msg.extend_from_slice(k.as_bytes());
            }
        }
        Sha256::digest(&msg).into()
    }

    #[test]
    fn empty_page_matches_the_byte_layout() {
        // len(prior)=0, len(tokens)=0: the message is eight zero bytes.
        let expected: ContentHash = Sha256::digest([0u8; 8]).into();
        assert_eq!(hash_page::<&str>(&[], &[], &[]).unwrap(), expected);
    }

    #[test]
    fn layout_is_little_endian_u32_fields() {
        // Hand-written message for tokens [1, 0x01020304], prior [0xab, 0xcd], extra ["é"].
        let msg: Vec<u8> = vec![
            2, 0, 0, 0, 0xab, 0xcd, // len(prior), prior
            2, 0, 0, 0, 1, 0, 0, 0, 4, 3, 2, 1, // len(tokens), tokens
            1, 0, 0, 0, 2, 0, 0, 0, 0xc3, 0xa9, // count, len("é" utf-8), bytes
        ];
        let expected: ContentHash = Sha256::digest(&msg).into();
        assert_eq!(hash_page(&[1, 0x0102_0304], &[0xab, 0xcd], &["é"]).unwrap(), expected);
        assert_eq!(manual(&[1, 0x0102_0304], &[0xab, 0xcd], &["é"]), expected);
    }

    #[test]
    fn extra_keys_section_only_when_present() {
        let with_none = hash_page::<&str>(&[7, 8], &[], &[]).unwrap();
        let with_empty_key = hash_page(&[7, 8], &[], &[""]).unwrap();
        assert_ne!(with_none, with_empty_key);
        assert_eq!(with_empty_key, manual(&[7, 8], &[], &[""]));
    }

    #[test]
    fn one_shot_and_streaming_agree_at_every_length() {
        // Lengths around the one-shot limit and the 55/56-byte padding boundary of a block.
        for n in 0..140u32 {
            let tokens: Vec<u32> = (0..n).collect();
            for prior in [&[][..], &[1u8; 32][..], &[2u8; 5][..]] {
                assert_eq!(
                    hash_page::<&str>(&tokens, prior, &[]).unwrap(),
                    manual(&tokens, prior, &[])
                );
            }
            assert_eq!(
                hash_page(&tokens, &[], &["k", "é"]).unwrap(),
                manual(&tokens, &[], &["k", "é"])
            );
        }
        let long_key = "x".repeat(600);
        assert_eq!(
            hash_page(&[1], &[], &[&long_key]).unwrap(),
            manual(&[1], &[], &[&long_key])
        );
    }

    #[test]
    fn long_pages_cross_the_stack_buffer() {
        let tokens: Vec<u32> = (0..200).map(|i| i * 7919).collect();
        assert_eq!(hash_page::<&str>(&tokens, &[], &[]).unwrap(), manual(&tokens, &[], &[]));
    }

    #[test]
    fn pages_chain_and_drop_the_partial_tail() {
        let tokens: Vec<u32> = (0..10).collect();
        let hashes = hash_pages(&tokens, 4, &[9], &["lora"]).unwrap();
        assert_eq!(hashes.len(), 2);
        let h0 = manual(&[0, 1, 2, 3], &[9], &["lora"]);
        let h1 = manual(&[4, 5, 6, 7], &h0, &["lora"]);
        assert_eq!(hashes, vec![h0, h1]);
        assert!(hash_pages::<&str>(&tokens, 0, &[], &[]).is_err());
        assert!(hash_pages::<&str>(&tokens[..3], 4, &[], &[]).unwrap().is_empty());
    }

    #[test]
    fn fold_hashes_each_hash_as_its_hex_text() {
        let a = manual(&[1], &[], &[]);
        let b = manual(&[2], &[], &[]);
        let r0 = manual(&[], &[], &[&to_hex(&a)]);
        let r1 = manual(&[], &r0, &[&to_hex(&b)]);
        assert_eq!(fold_run(&[a, b]), r1);
        assert_eq!(fold_run_keys(&[to_hex(&a), to_hex(&b)]).unwrap(), Some(r1));
    }

    #[test]
    fn fold_drops_incomplete_runs_at_both_ends() {
        let hs: Vec<ContentHash> = (0..7).map(|i| manual(&[i], &[], &[])).collect();
        // first_base = 1, m = 3: skip 2 (to base page 3), then runs [3,4,5]; [6,7] is dropped.
        let folded = fold_hashes(&hs, 1, 3).unwrap();
        assert_eq!(folded, vec![fold_run(&hs[2..5])]);
        assert_eq!(
            fold_hashes(&hs, 0, 3).unwrap(),
            vec![fold_run(&hs[0..3]), fold_run(&hs[3..6])]
        );
        assert_eq!(fold_hashes(&hs, 5, 1).unwrap(), hs);
        assert!(fold_hashes(&hs[..2], 0, 3).unwrap().is_empty());
        assert!(fold_hashes(&hs, 0, 0).is_err());
        assert!(fold_hashes(&hs, u64::MAX, u64::MAX).unwrap().is_empty());
    }

    #[test]
    fn hex_round_trips_and_rejects_bad_text() {
        let h = manual(&[3], &[], &[]);
        let text = to_hex(&h);
        assert_eq!(text.len(), 64);
        assert_eq!(parse_hash(text.as_bytes()), Some(h));
        assert_eq!(parse_hash(text.to_uppercase().as_bytes()), Some(h));
        assert_eq!(parse_hash_lower(text.as_bytes()), Some(h));
        assert_eq!(parse_hash_lower(text.to_uppercase().as_bytes()), None);
        assert_eq!(parse_hash(&text.as_bytes()[..62]), None);
        let mut bad = text.into_bytes();
        bad[17] = b'g';
        assert_eq!(parse_hash(&bad), None);
        assert_eq!(parse_hex(b"0aFf"), Some(vec![0x0a, 0xff]));
        assert_eq!(parse_hex(b"abc"), None);
        assert_eq!(parse_hex(b""), Some(vec![]));
        assert_eq!(parse_hex(b"zz"), None);
        let mut buf = [0u8; 64];
        hex_into(&h, &mut buf);
        assert_eq!(&buf[..], to_hex(&h).as_bytes());
    }

    #[test]
    fn swar_hex_agrees_with_the_digit_table_for_every_byte_at_every_position() {
        let valid = b"0123456789abcdefABCDEF";
        for pos in 0..8 {
            for b in 0..=255u8 {
                let mut chunk = *b"0f1E2d3C";
                chunk[pos] = b;
                let expected = parse_hex(&chunk).map(|v| [v[0], v[1], v[2], v[3]]);
                assert_eq!(hex8::<false>(chunk), expected, "byte {b:#x} at {pos}");
                assert_eq!(expected.is_some(), valid.contains(&b));
                let lower = expected.filter(|_| !chunk.iter().any(u8::is_ascii_uppercase));
                assert_eq!(hex8::<true>(chunk), lower, "lowercase only: byte {b:#x} at {pos}");
            }
        }
        assert_eq!(hex8::<false>(*b"deadBEEF"), Some([0xde, 0xad, 0xbe, 0xef]));
        assert_eq!(hex8::<true>(*b"deadBEEF"), None);
        assert_eq!(hex8::<true>(*b"deadbeef"), Some([0xde, 0xad, 0xbe, 0xef]));
        assert_eq!(hex8::<false>(*b"00000000"), Some([0; 4]));
        assert_eq!(hex8::<false>(*b"ffffffff"), Some([0xff; 4]));
    }

    proptest::proptest! {
        #[test]
        fn hex_text_round_trips_in_either_case(bytes in proptest::array::uniform32(0u8..)) {
            let text = to_hex(&bytes);
            proptest::prop_assert_eq!(parse_hash(text.as_bytes()), Some(bytes));
            proptest::prop_assert_eq!(parse_hash(text.to_uppercase().as_bytes()), Some(bytes));
            proptest::prop_assert_eq!(parse_hash_lower(text.as_bytes()), Some(bytes));
            let upper = text.to_uppercase();
            let has_letter = upper.bytes().any(|b| b.is_ascii_uppercase());
            proptest::prop_assert_eq!(parse_hash_lower(upper.as_bytes()).is_none(), has_letter);
            proptest::prop_assert_eq!(parse_hex(text.as_bytes()), Some(bytes.to_vec()));
        }
    }

    #[test]
    fn group_key_text_appends_the_group_big_endian() {
        let key = GroupKey::new([0xab; 32], 0x0102_0a0b);
        let text = key.to_hex();
        assert_eq!(text.len(), 72);
        assert!(text.ends_with("01020a0b"));
        assert!(text.starts_with("abab"));
    }
}
