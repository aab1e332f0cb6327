//! SPEC 2 / 10 sizing formulas and checks, against values computed by hand from the SPEC.

use flat_kvcache_core::num::int::{Int, IntArg};
use flat_kvcache_core::sizing::{
    compute_max_logical_pages_for_capture, compute_paged_cache_group_page_counts, group_specs_from_layer_types,
    hybrid_slab_group_size, layer_group_ids, publish_paged_cache_groups, validate_flat_scheduler_config,
    validation_applies, GroupSpec, LabelItem, LayerTypesArg, PageCountArgs, SchedulerFacts, SpecArg, Text, WindowEntry,
    WindowsArg, FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION,
};
use flat_kvcache_core::CoreError;

const FULL: &str = FULL_ATTENTION;
const SLIDING: &str = SLIDING_ATTENTION;
const LINEAR: &str = LINEAR_ATTENTION;

fn labels(labels: &[&str]) -> LayerTypesArg {
    LayerTypesArg::labels(labels)
}

fn int(v: i64) -> IntArg {
    IntArg::from(v)
}

fn huge(bytes: &[u8]) -> IntArg {
    IntArg::Int(Int::from_magnitude_le_bytes(false, bytes))
}

fn two_pow_64() -> IntArg {
    huge(&[0, 0, 0, 0, 0, 0, 0, 0, 1])
}

fn spec(group_id: &str, retention: &str, rows: i64, stride: i64, window: Option<i64>, family: &str) -> SpecArg {
    SpecArg {
        group_id: group_id.to_owned(),
        retention: Text::from(retention),
        rows_per_page: int(rows),
        entry_stride_tokens: int(stride),
        sliding_window_tokens: window.map(int),
        family: Text::from(family),
    }
}

fn full(rows: i64) -> SpecArg {
    spec("f", "full_history", rows, 1, None, "history")
}

fn state(rows: i64) -> SpecArg {
    spec("s", "full_history", rows, 1, None, "state")
}

fn sliding(rows: i64, window: i64) -> SpecArg {
    spec("w", "sliding_window", rows, 1, Some(window), "history")
}

/// B, S, T, C, N, D, M.
#[allow(clippy::many_single_char_names, reason = "the SPEC's names for the arguments")]
fn args(b: i64, s: i64, t: i64, c: i64, n: i64, d: i64, m: i64) -> PageCountArgs {
    PageCountArgs {
        max_live_requests: int(b),
        max_scheduled_tokens: int(s),
        max_total_tokens: int(t),
        max_context_len: int(c),
        decode_input_tokens: int(n),
        overlap_schedule_depth: int(d),
        safety_margin: int(m),
    }
}

fn counts(specs: &[SpecArg], args: &PageCountArgs) -> Result<Vec<u64>, CoreError> {
    compute_paged_cache_group_page_counts(specs, args)
}

fn message<T: std::fmt::Debug>(result: Result<T, CoreError>) -> String {
    result.unwrap_err().to_string()
}

// --- grouping ---------------------------------------------------------------------------------

#[test]
fn group_ids_are_labels_unless_several_windows() {
    let types = labels(&[SLIDING, SLIDING, FULL, LINEAR]);
    assert_eq!(
        layer_group_ids(&types, &WindowsArg::broadcast(8)).unwrap(),
        [SLIDING, SLIDING, FULL, LINEAR]
    );
    let windows = WindowsArg::per_layer(&[Some(8), Some(16), None, Some(0)]);
    assert_eq!(
        layer_group_ids(&types, &windows).unwrap(),
        ["sliding_attention_8", "sliding_attention_16", FULL, LINEAR]
    );
    // Repeating one window is still one group.
    let windows = WindowsArg::per_layer(&[Some(8), Some(8), Some(-3), None]);
    assert_eq!(
        layer_group_ids(&types, &windows).unwrap(),
        [SLIDING, SLIDING, FULL, LINEAR]
    );
    assert!(layer_group_ids(&labels(&[]), &WindowsArg::None).unwrap().is_empty());
}

#[test]
fn huge_windows_give_exact_group_ids() {
    // 2**64 = 18446744073709551616
    let windows = WindowsArg::PerLayer(vec![WindowEntry::Int(two_pow_64()), WindowEntry::Int(int(8))]);
    assert_eq!(
        layer_group_ids(&labels(&[SLIDING, SLIDING]), &windows).unwrap(),
        ["sliding_attention_18446744073709551616", "sliding_attention_8"]
    );
}

#[test]
fn grouping_errors_follow_the_contract() {
    let unknown = layer_group_ids(&labels(&[FULL, "mamba"]), &WindowsArg::None);
    assert_eq!(
        message(unknown),
        "unknown layer_type 'mamba' at layer 1; expected one of full_attention, sliding_attention, linear_attention, chunked_attention"
    );
    assert_eq!(
        message(layer_group_ids(&LayerTypesArg::Str, &WindowsArg::None)),
        "layer_types must be a sequence of str, not str"
    );
    let not_str = LayerTypesArg::Items(vec![LabelItem::Str(FULL.into()), LabelItem::Other("int".into())]);
    assert_eq!(
        layer_group_ids(&not_str, &WindowsArg::None),
        Err(CoreError::Type("layer_types[1] must be a str, not int".into()))
    );
    let sliding_full = labels(&[SLIDING, FULL]);
    for refused in ["str", "bool", "float"] {
        let err = layer_group_ids(&sliding_full, &WindowsArg::Refused(refused.into()));
        assert_eq!(
            message(err),
            format!("sliding_window_tokens must be None, an int or a per-layer sequence, not {refused}")
        );
    }
    assert_eq!(
        message(layer_group_ids(&sliding_full, &WindowsArg::per_layer(&[Some(8)]))),
        "sliding_window_tokens has 1 entries but layer_types has 2"
    );
    let junk = WindowsArg::PerLayer(vec![WindowEntry::Int(int(8)), WindowEntry::Refused("str".into())]);
    assert_eq!(
        message(layer_group_ids(&sliding_full, &junk)),
        "sliding_window_tokens[1] must be None or an int, not str"
    );
    assert_eq!(
        message(layer_group_ids(&sliding_full, &WindowsArg::per_layer(&[None, None]))),
        "layer 0 (sliding_attention) needs a positive sliding window, got None"
    );
    assert_eq!(
        message(layer_group_ids(&sliding_full, &WindowsArg::broadcast(0))),
        "layer 0 (sliding_attention) needs a positive sliding window, got 0"
    );
    assert_eq!(
        message(layer_group_ids(
            &sliding_full,
            &WindowsArg::per_layer(&[Some(8), Some(4)])
        )),
        "layer 1 is labelled full_attention but carries sliding window 4; mislabeled layer_type?"
    );
    // An int window is broadcast to sliding layers only: full layers simply get None.
    assert_eq!(
        layer_group_ids(&labels(&[FULL, LINEAR]), &WindowsArg::broadcast(-5)).unwrap(),
        [FULL, LINEAR]
    );
    // Labels are checked before the window argument.
    let both_bad = layer_group_ids(&labels(&["x"]), &WindowsArg::Refused("str".into()));
    assert!(message(both_bad).starts_with("unknown layer_type 'x'"));
}

#[test]
fn specs_follow_first_appearance() {
    let types = labels(&[SLIDING, FULL, LINEAR, SLIDING, FULL]);
    let specs = group_specs_from_layer_types(&types, &WindowsArg::broadcast(4096), &int(16)).unwrap();
    let expected = [
        (SLIDING, "sliding_window", Some(4096), "history"),
        (FULL, "full_history", None, "history"),
        (LINEAR, "full_history", None, "state"),
    ];
    assert_eq!(specs.len(), expected.len());
    for (spec, (gid, retention, window, family)) in specs.iter().zip(expected) {
        assert_eq!(
            spec,
            &GroupSpec {
                group_id: gid.to_owned(),
                retention,
                rows_per_page: Int::from(16u64),
                entry_stride_tokens: 1,
                sliding_window_tokens: window.map(|w: u64| Int::from(w)),
                family,
            }
        );
    }
    assert_eq!(
        message(group_specs_from_layer_types(&types, &WindowsArg::None, &int(0))),
        "page_size must be > 0, got 0"
    );
    // page_size is checked before the layers.
    assert_eq!(
        message(group_specs_from_layer_types(
            &labels(&["x"]),
            &WindowsArg::None,
            &IntArg::Bool
        )),
        "page_size must be an int, not bool"
    );
    // A page size or window the specs carry is handed back exactly, whatever its size.
    let exact = Int::from(1u128 << 64);
    assert_eq!(
        group_specs_from_layer_types(&labels(&[]), &WindowsArg::None, &two_pow_64()),
        Ok(Vec::new())
    );
    let specs = group_specs_from_layer_types(&labels(&[FULL]), &WindowsArg::None, &two_pow_64()).unwrap();
    assert_eq!(specs[0].rows_per_page, exact);
    let windows = WindowsArg::PerLayer(vec![WindowEntry::Int(two_pow_64())]);
    let specs = group_specs_from_layer_types(&labels(&[SLIDING]), &windows, &int(16)).unwrap();
    assert_eq!(specs[0].sliding_window_tokens, Some(exact));
}

// --- page counts ------------------------------------------------------------------------------

#[test]
fn page_counts_match_the_spec_formulas() {
    // P = 16, B = 4, S = 512, T = 1000, C = 4096, N = 1, D = 0, M = 0.
    let base = args(4, 512, 1000, 4096, 1, 0, 0);
    // full: ceil(1000/16) + 4 + 0 + 1 = 63 + 5 = 68
    assert_eq!(counts(&[full(16)], &base).unwrap(), [68]);
    // state: min(2*4 + 1000//16 + 1, 68) = min(71, 68) = 68
    assert_eq!(counts(&[state(16)], &base).unwrap(), [68]);
    // sliding W = 4096: 4 * ceil(min(4095, 4096)/16) + ceil(min(512, 1000)/16) + 4 + 1
    //   = 4 * 256 + 32 + 5 = 1061
    assert_eq!(counts(&[sliding(16, 4096)], &base).unwrap(), [1061]);
    // W = 1: max(W-1, 0) = 0 resident pages: 0 + 32 + 5 = 37
    assert_eq!(counts(&[sliding(16, 1)], &base).unwrap(), [37]);
    // C caps the resident window: W = 10**6, C = 100: 4 * ceil(100/16) + 32 + 5 = 28 + 37 = 65
    assert_eq!(
        counts(&[sliding(16, 1_000_000)], &args(4, 512, 1000, 100, 1, 0, 0)).unwrap(),
        [65]
    );
    // T caps the step: S = 5000 > T = 1000: 4 * 256 + ceil(1000/16) + 5 = 1024 + 63 + 5 = 1092
    assert_eq!(
        counts(&[sliding(16, 4096)], &args(4, 5000, 1000, 4096, 1, 0, 0)).unwrap(),
        [1092]
    );
}

#[test]
fn state_count_is_capped_by_the_full_history_count() {
    // B = 0, T = 1000, P = 16: full = 63 + 0 + 1 = 64, state = 0 + 62 + 1 = 63.
    let a = args(0, 0, 1000, 0, 1, 0, 0);
    assert_eq!(counts(&[full(16), state(16)], &a).unwrap(), [64, 63]);
}

#[test]
fn overlap_and_margin_add_protected_pages() {
    // D = 1, N = 2, P = 16: protected = 4 * ceil(2/16) = 4; M = 3.
    let a = args(4, 512, 1000, 4096, 2, 1, 3);
    // full: 63 + 4 + 4 + 1 + 3 = 75
    // state: min(8 + 62 + 4 + 1 + 3 = 78, 75) = 75
    // sliding: 1024 + 32 + 4 + 4 + 1 + 3 = 1068
    assert_eq!(
        counts(&[full(16), state(16), sliding(16, 4096)], &a).unwrap(),
        [75, 75, 1068]
    );
    // N = 40 > P: protected = 4 * ceil(40/16) = 12; full: 63 + 4 + 12 + 1 + 3 = 83
    assert_eq!(counts(&[full(16)], &args(4, 512, 1000, 4096, 40, 1, 3)).unwrap(), [83]);
    // D = 0 protects nothing whatever N is.
    assert_eq!(counts(&[full(16)], &args(4, 512, 1000, 4096, 40, 0, 3)).unwrap(), [71]);
}

#[test]
fn raw_is_the_exact_signed_product() {
    // rows 4, stride 4: raw 16 (same as rows 16).
    let a = args(4, 512, 1000, 4096, 1, 0, 0);
    assert_eq!(
        counts(&[spec("g", "full_history", 4, 4, None, "history")], &a).unwrap(),
        [68]
    );
    // Two negatives give a positive raw, which is accepted.
    assert_eq!(
        counts(&[spec("g", "full_history", -4, -4, None, "history")], &a).unwrap(),
        [68]
    );
    assert_eq!(
        message(counts(&[spec("g", "full_history", -4, 4, None, "history")], &a)),
        "group g: rows_per_page * entry_stride_tokens must be > 0, got -16"
    );
    // A negative raw beyond u64 is printed exactly: -(2**64) * 3.
    let big = SpecArg {
        rows_per_page: IntArg::Int(Int::from_magnitude_le_bytes(true, &[0, 0, 0, 0, 0, 0, 0, 0, 1])),
        entry_stride_tokens: int(3),
        ..full(1)
    };
    assert_eq!(
        message(counts(&[big], &a)),
        "group f: rows_per_page * entry_stride_tokens must be > 0, got -55340232221128654848"
    );
}

#[test]
fn page_count_errors_follow_the_contract() {
    let ok = args(1, 1, 1, 1, 1, 0, 0);
    let names = [
        "max_live_requests",
        "max_scheduled_tokens",
        "max_total_tokens",
        "max_context_len",
        "decode_input_tokens",
        "safety_margin",
    ];
    let with = |k: usize, value: IntArg| {
        let mut a = ok.clone();
        *match k {
            0 => &mut a.max_live_requests,
            1 => &mut a.max_scheduled_tokens,
            2 => &mut a.max_total_tokens,
            3 => &mut a.max_context_len,
            4 => &mut a.decode_input_tokens,
            _ => &mut a.safety_margin,
        } = value;
        a
    };
    for (k, name) in names.iter().enumerate() {
        assert_eq!(
            message(counts(&[], &with(k, int(-1)))),
            format!("{name} must be >= 0, got -1")
        );
        assert_eq!(
            counts(&[], &with(k, IntArg::Bool)),
            Err(CoreError::Type(format!("{name} must be an int, not bool")))
        );
    }
    assert_eq!(
        message(counts(&[], &args(1, 1, 1, 1, 1, 2, 0))),
        "overlap_schedule_depth must be 0 or 1, got 2"
    );
    assert_eq!(
        message(counts(&[], &args(1, 1, 1, 1, 0, 1, 0))),
        "overlap_schedule_depth > 0 needs decode_input_tokens > 0"
    );
    // Argument checks come before spec checks; M is checked before D.
    assert_eq!(
        message(counts(&[full(0)], &args(1, 1, 1, 1, 1, 7, -1))),
        "safety_margin must be >= 0, got -1"
    );
    assert_eq!(
        message(counts(&[full(1), sliding(16, 0)], &ok)),
        "group w: sliding_window retention needs a positive sliding_window_tokens, got 0"
    );
    let no_window = SpecArg {
        sliding_window_tokens: None,
        ..sliding(16, 8)
    };
    assert_eq!(
        message(counts(&[no_window], &ok)),
        "group w: sliding_window retention needs a positive sliding_window_tokens, got None"
    );
    let bool_window = SpecArg {
        sliding_window_tokens: Some(IntArg::Bool),
        ..sliding(16, 8)
    };
    assert_eq!(
        counts(&[bool_window], &ok),
        Err(CoreError::Type(
            "group w: sliding_window_tokens must be an int, not bool".into()
        ))
    );
    let ring = spec("r", "ring", 16, 1, None, "history");
    assert_eq!(message(counts(&[ring], &ok)), "group r: unknown retention 'ring'");
    // Raw is checked before the retention.
    let ring = spec("r", "ring", 0, 1, None, "history");
    assert!(message(counts(&[ring], &ok)).contains("rows_per_page * entry_stride_tokens"));
    // A retention that is not a str never matches.
    let other = SpecArg {
        retention: Text::Other("full_history".into()),
        ..full(16)
    };
    assert_eq!(
        message(counts(&[other], &ok)),
        "group f: unknown retention 'full_history'"
    );
}

#[test]
fn page_counts_overflow_names_the_arguments() {
    // An argument the count does not use may be of any size: C for a full-history group.
    let mut a = args(0, 0, 0, 0, 0, 0, 0);
    a.max_context_len = two_pow_64();
    assert_eq!(counts(&[full(16)], &a), Ok(vec![1]));
    assert_eq!(counts(&[], &a), Ok(Vec::new()));
    assert!(matches!(counts(&[full(0)], &a), Err(CoreError::InvalidArgument(_))));
    // T = u64::MAX, raw = 1, B = 1: u64::MAX + 1 + 1 does not fit.
    let mut a = args(1, 0, 0, 0, 0, 0, 0);
    a.max_total_tokens = IntArg::from(u64::MAX);
    let err = counts(&[full(1)], &a).unwrap_err();
    assert!(matches!(err, CoreError::Overflow { .. }));
    assert!(err.to_string().contains("max_total_tokens"), "{err}");
    // raw beyond u64 only divides: ceil(0 / 2**80) = 0, so B + 1 = 1 page.
    let big = spec("g", "full_history", 1 << 40, 1 << 40, None, "history");
    assert_eq!(counts(&[big], &args(0, 0, 0, 0, 0, 0, 0)), Ok(vec![1]));
    // M beyond u64 always reaches the count.
    let mut a = args(0, 0, 0, 0, 0, 0, 0);
    a.safety_margin = two_pow_64();
    let err = counts(&[full(16)], &a).unwrap_err();
    assert!(matches!(err, CoreError::Overflow { .. }));
    assert!(err.to_string().contains("safety_margin"), "{err}");
}

/// `2**bits` as an argument.
fn pow2(bits: u32) -> IntArg {
    let mut bytes = vec![0u8; usize::try_from(bits / 8).unwrap() + 1];
    *bytes.last_mut().unwrap() = 1 << (bits % 8);
    huge(&bytes)
}

#[test]
fn page_counts_accept_huge_inputs_whose_count_fits() {
    // C = 2**64 beyond every window: min(W - 1, C) = W - 1 = 7, so 2 * ceil(7/4) + ceil(5/4) + 2 + 1.
    let mut a = args(2, 5, 10, 0, 1, 0, 0);
    a.max_context_len = two_pow_64();
    assert_eq!(counts(&[sliding(4, 8)], &a), Ok(vec![9]));
    // T = 2**200 only through min(S, T) in a sliding group: ceil(5/4) + 1 = 3 with B = 0.
    let mut a = args(0, 5, 0, 0, 1, 0, 0);
    a.max_total_tokens = pow2(200);
    assert_eq!(counts(&[sliding(4, 8)], &a), Ok(vec![3]));
    // ... but a full-history group needs ceil(T / raw): not representable.
    let err = counts(&[full(4)], &a).unwrap_err();
    assert!(err.to_string().contains("max_total_tokens"), "{err}");
    // S = 2**100 with T = 40: min(S, T) = T; B * ceil(7/4) + ceil(40/4) + B + 1 = 2 + 10 + 1 + 1.
    let mut a = args(1, 0, 40, 8, 1, 0, 0);
    a.max_scheduled_tokens = pow2(100);
    assert_eq!(counts(&[sliding(4, 8)], &a), Ok(vec![14]));
    // B = 0 times a resident history of 2**200 / 1 pages.
    let mut a = args(0, 0, 0, 0, 1, 0, 0);
    a.max_context_len = pow2(200);
    let window = SpecArg {
        sliding_window_tokens: Some(pow2(200)),
        ..sliding(1, 1)
    };
    assert_eq!(counts(std::slice::from_ref(&window), &a), Ok(vec![1]));
    // With B = 1 that history is really needed and does not fit.
    a.max_live_requests = int(1);
    assert!(matches!(counts(&[window], &a), Err(CoreError::Overflow { .. })));
    // N = 2**200 with D = 0 is unused; with D = 1 and B = 0 it is multiplied by zero.
    let mut a = args(0, 0, 0, 0, 0, 0, 0);
    a.decode_input_tokens = pow2(200);
    assert_eq!(counts(&[full(16), state(16)], &a), Ok(vec![1, 1]));
    a.overlap_schedule_depth = int(1);
    assert_eq!(counts(&[full(16), state(16)], &a), Ok(vec![1, 1]));
    // ... and with B = 1 it divides a huge raw: ceil(2**200 / 2**190) = 1024 protected pages.
    a.max_live_requests = int(1);
    let raw = SpecArg {
        rows_per_page: pow2(190),
        ..full(1)
    };
    assert_eq!(counts(&[raw], &a), Ok(vec![1 + 1024 + 1]));
    // Huge raw and huge T: ceil(2**200 / 2**190) = 1024, 2**200 // 2**190 = 1024.
    let mut a = args(1, 0, 0, 0, 1, 0, 0);
    a.max_total_tokens = pow2(200);
    let state_raw = SpecArg {
        rows_per_page: pow2(190),
        ..state(1)
    };
    assert_eq!(counts(&[state_raw], &a), Ok(vec![1024 + 1 + 1]));
    // State with B = 2**64: 2B + ... does not fit, the full-history count does not either.
    let mut a = args(0, 0, 0, 0, 1, 0, 0);
    a.max_live_requests = two_pow_64();
    assert!(matches!(counts(&[state(1)], &a), Err(CoreError::Overflow { .. })));
}

#[test]
fn state_count_fits_when_only_the_uncapped_formula_overflows() {
    // B = 2**62, T = 2**63, raw = 1: state = 2**63 + 2**63 + 1 overflows u64, full =
    // 2**63 + 2**62 + 1 fits and is the result.
    let mut a = args(0, 0, 0, 0, 0, 0, 0);
    a.max_live_requests = IntArg::from(1u64 << 62);
    a.max_total_tokens = IntArg::from(1u64 << 63);
    assert_eq!(counts(&[state(1)], &a).unwrap(), [(1u64 << 63) + (1u64 << 62) + 1]);
}

#[test]
fn huge_windows_are_capped_by_the_context() {
    // W = 2**64 (beyond u64) is exact: min(W - 1, C) = C = 100. 4 * ceil(100/16) + 32 + 5 = 65.
    let huge_window = SpecArg {
        sliding_window_tokens: Some(two_pow_64()),
        ..sliding(16, 1)
    };
    assert_eq!(counts(&[huge_window], &args(4, 512, 1000, 100, 1, 0, 0)).unwrap(), [65]);
}

#[test]
fn thirty_two_bit_inputs_never_overflow() {
    let m = i64::from(i32::MAX);
    let a = args(m, m, m, m, m, 1, m);
    let specs = [full(1), state(1), sliding(1, m)];
    assert!(counts(&specs, &a).is_ok());
}

// --- publication ------------------------------------------------------------------------------

#[test]
fn publication_uses_defaults_and_clamps_s() {
    let published = publish_paged_cache_groups(
        &labels(&[SLIDING, FULL]),
        &WindowsArg::broadcast(4096),
        &int(16),
        &int(4),
        &int(-7),
        &int(1000),
        &int(4096),
    )
    .unwrap();
    if !flat_kvcache_core::FLAT_KVCACHE {
        assert_eq!(published, None);
        return;
    }
    let (specs, counts) = published.unwrap();
    assert_eq!(specs.len(), 2);
    // S = max(0, -7) = 0: sliding 4 * 256 + 0 + 4 + 1 = 1029; full 63 + 4 + 1 = 68.
    assert_eq!(counts, [1029, 68]);
    // Empty layer_types stands for one full-attention layer.
    let (specs, counts) = publish_paged_cache_groups(
        &labels(&[]),
        &WindowsArg::None,
        &int(16),
        &int(4),
        &int(0),
        &int(1000),
        &int(0),
    )
    .unwrap()
    .unwrap();
    assert_eq!(specs.len(), 1);
    assert_eq!(specs[0].group_id, FULL);
    assert_eq!(counts, [68]);
    // S is type-checked before B.
    let err = publish_paged_cache_groups(
        &labels(&[FULL]),
        &WindowsArg::None,
        &int(16),
        &int(-1),
        &IntArg::Other("float".into()),
        &int(0),
        &int(0),
    );
    assert_eq!(
        err,
        Err(CoreError::Type("max_scheduled_tokens must be an int, got float".into()))
    );
}

// --- capture width ----------------------------------------------------------------------------

#[test]
fn capture_width_covers_the_horizon() {
    let c = |spec: &SpecArg, ctx: i64, n: i64, d: i64| {
        compute_max_logical_pages_for_capture(spec, &int(ctx), &int(n), &int(d))
    };
    // full: ceil((4096 + 1) / 16) = 257
    assert_eq!(c(&full(16), 4096, 1, 0), Ok(257));
    // full, D = 1, N = 8: ceil((4096 + 16) / 16) = 257
    assert_eq!(c(&full(16), 4096, 8, 1), Ok(257));
    // full, C = 4080 (= 255 pages), N = 1: ceil(4081 / 16) = 256
    assert_eq!(c(&full(16), 4080, 1, 0), Ok(256));
    // sliding W = 1024, C = 4096, N = 1, D = 1: ceil((1024 + 2) / 16) + 1 = 65 + 1 = 66
    assert_eq!(c(&sliding(16, 1024), 4096, 1, 1), Ok(66));
    // sliding, C < W: ceil((100 + 1) / 16) + 1 = 7 + 1 = 8
    assert_eq!(c(&sliding(16, 1024), 100, 1, 0), Ok(8));
    assert_eq!(message(c(&full(16), -1, 1, 0)), "max_context_len must be >= 0, got -1");
    assert_eq!(message(c(&full(16), 1, 0, 0)), "max_tokens_per_req must be > 0, got 0");
    assert_eq!(
        message(c(&full(16), 1, 1, -1)),
        "overlap_schedule_depth must be 0 or 1, got -1"
    );
    assert_eq!(
        message(c(&full(0), 1, 1, 0)),
        "group f: rows_per_page * entry_stride_tokens must be > 0, got 0"
    );
    // C = u64::MAX, raw = 1: u64::MAX + 1 does not fit.
    let err = compute_max_logical_pages_for_capture(&full(1), &IntArg::from(u64::MAX), &int(1), &int(0));
    assert!(message(err).contains("max_context_len"));
    // C beyond u64 above a small window: min(W, C) = 8, ceil((8 + 1) / 16) + 1 = 2.
    let width = compute_max_logical_pages_for_capture(&sliding(16, 8), &two_pow_64(), &int(1), &int(0));
    assert_eq!(width, Ok(2));
    // A huge window and context over a huge raw: ceil((2**200 + 2) / 2**199) + 1 = 4.
    let spec = SpecArg {
        rows_per_page: pow2(199),
        sliding_window_tokens: Some(pow2(200)),
        ..sliding(1, 1)
    };
    assert_eq!(
        compute_max_logical_pages_for_capture(&spec, &pow2(200), &int(1), &int(1)),
        Ok(4)
    );
    // Full history over the same: ceil((2**200 + 1) / 2**199) = 3.
    let spec = SpecArg {
        rows_per_page: pow2(199),
        ..full(1)
    };
    assert_eq!(
        compute_max_logical_pages_for_capture(&spec, &pow2(200), &int(1), &int(0)),
        Ok(3)
    );
    // N = 2**64 with raw 1: the width itself does not fit.
    let err = compute_max_logical_pages_for_capture(&full(1), &int(0), &two_pow_64(), &int(0));
    assert!(message(err).contains("max_tokens_per_req"));
}

// --- slab pairing -----------------------------------------------------------------------------

#[test]
fn slab_pairing_needs_one_group_per_label_and_equal_counts() {
    let slab = |types: &[&str], windows: WindowsArg| hybrid_slab_group_size(&labels(types), &windows);
    if !flat_kvcache_core::FLAT_KVCACHE {
        assert_eq!(slab(&[SLIDING, FULL], WindowsArg::broadcast(8)), None);
        return;
    }
    assert_eq!(
        slab(&[SLIDING, FULL, SLIDING, FULL], WindowsArg::broadcast(1024)),
        Some(2)
    );
    assert_eq!(
        slab(
            &[SLIDING, FULL, SLIDING, FULL],
            WindowsArg::per_layer(&[Some(8), None, Some(8), Some(0)])
        ),
        Some(2)
    );
    assert_eq!(slab(&[SLIDING, FULL, FULL], WindowsArg::broadcast(1024)), None);
    assert_eq!(slab(&[FULL, FULL], WindowsArg::None), None);
    assert_eq!(slab(&[], WindowsArg::None), None);
    assert_eq!(slab(&[LINEAR, FULL], WindowsArg::None), None);
    assert_eq!(slab(&[SLIDING, LINEAR, FULL], WindowsArg::broadcast(8)), None);
    // Several windows: more groups than labels.
    assert_eq!(
        slab(
            &[SLIDING, SLIDING, FULL, FULL],
            WindowsArg::per_layer(&[Some(8), Some(16), None, None])
        ),
        None
    );
    // Whatever the grouping refuses gives None (SPEC 12.6).
    assert_eq!(slab(&[SLIDING, FULL], WindowsArg::Refused("bool".into())), None);
    assert_eq!(slab(&[SLIDING, FULL], WindowsArg::per_layer(&[Some(8), Some(8)])), None);
    assert_eq!(slab(&[SLIDING, FULL], WindowsArg::broadcast(0)), None);
    assert_eq!(slab(&[SLIDING, "x"], WindowsArg::broadcast(8)), None);
    assert_eq!(hybrid_slab_group_size(&LayerTypesArg::Str, &WindowsArg::None), None);
    // A huge window is fine: it is compared exactly.
    assert_eq!(
        hybrid_slab_group_size(&labels(&[SLIDING, FULL]), &WindowsArg::Int(two_pow_64())),
        Some(1)
    );
}

// --- validation -------------------------------------------------------------------------------

fn facts() -> SchedulerFacts {
    SchedulerFacts {
        backend: "Backend".into(),
        kv_pool: "Pool".into(),
        uses_paged_cache_groups: true,
        uses_flat_cache_groups: true,
        flat_spec_capable: true,
        speculative_algorithm: None,
        num_groups: 2,
    }
}

#[test]
fn validation_checks_run_in_order() {
    assert!(!validation_applies(false));
    assert_eq!(validation_applies(true), flat_kvcache_core::FLAT_KVCACHE);
    assert_eq!(validate_flat_scheduler_config(&facts()), Ok(()));

    let paged_not_flat = SchedulerFacts {
        uses_flat_cache_groups: false,
        speculative_algorithm: Some("DFLASH".into()),
        num_groups: 0,
        ..facts()
    };
    assert_eq!(
        message(validate_flat_scheduler_config(&paged_not_flat)),
        "flat KV cache: backend Backend uses paged cache groups but does not consume flat per-group tables (kv_pool Pool)"
    );
    let not_capable = SchedulerFacts {
        flat_spec_capable: false,
        speculative_algorithm: Some("dflash".into()),
        ..facts()
    };
    assert_eq!(
        message(validate_flat_scheduler_config(&not_capable)),
        "flat KV cache: speculative algorithm dflash needs a flat-spec-capable backend; Backend is not (kv_pool Pool)"
    );
    let dflash = SchedulerFacts {
        speculative_algorithm: Some("DFlash".into()),
        ..facts()
    };
    assert_eq!(
        message(validate_flat_scheduler_config(&dflash)),
        "flat KV cache: speculative algorithm DFLASH is not supported (backend Backend, kv_pool Pool)"
    );
    let single_table = SchedulerFacts {
        uses_paged_cache_groups: false,
        uses_flat_cache_groups: false,
        num_groups: 3,
        ..facts()
    };
    assert_eq!(
        message(validate_flat_scheduler_config(&single_table)),
        "flat KV cache: 3 paged cache groups but backend Backend does not consume flat per-group tables; the \
         single-table fallback would serve one group's pages to every layer and silently corrupt KV (kv_pool Pool)"
    );
    let one_group = SchedulerFacts {
        num_groups: 1,
        ..single_table.clone()
    };
    assert_eq!(validate_flat_scheduler_config(&one_group), Ok(()));
    let none = SchedulerFacts {
        num_groups: 0,
        ..facts()
    };
    let err = validate_flat_scheduler_config(&none).unwrap_err();
    assert!(matches!(err, CoreError::Config(_)));
    assert_eq!(
        err.to_string(),
        "flat KV cache: at least one paged cache group is required; state-only pools publish none (backend \
         Backend, kv_pool Pool)"
    );
}
