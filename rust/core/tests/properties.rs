//! Property tests: exact integers against native arithmetic, and invariants of the SPEC 2 / 3
//! formulas over random inputs.

use flat_kvcache_core::num::int::{Int, IntArg};
use flat_kvcache_core::sizing::plan::{
    component_args, plan_component_tensors, plan_tensors, solve_page_geometry, ComponentSpec,
};
use flat_kvcache_core::sizing::{
    compute_max_logical_pages_for_capture, compute_paged_cache_group_page_counts, hybrid_slab_group_size,
    layer_group_ids, LayerTypesArg, PageCountArgs, SpecArg, Text, WindowsArg,
};
use proptest::prelude::*;

fn spec(retention: &str, rows: u64, stride: u64, window: Option<u64>, family: &str) -> SpecArg {
    SpecArg {
        group_id: "g".into(),
        retention: Text::from(retention),
        rows_per_page: IntArg::from(rows),
        entry_stride_tokens: IntArg::from(stride),
        sliding_window_tokens: window.map(IntArg::from),
        family: Text::from(family),
    }
}

/// B, S, T, C, N, D, M.
#[allow(clippy::many_single_char_names, reason = "the SPEC's names for the arguments")]
fn count_args(v: [u64; 7]) -> PageCountArgs {
    let [b, s, t, c, n, d, m] = v;
    PageCountArgs {
        max_live_requests: IntArg::from(b),
        max_scheduled_tokens: IntArg::from(s),
        max_total_tokens: IntArg::from(t),
        max_context_len: IntArg::from(c),
        decode_input_tokens: IntArg::from(n),
        overlap_schedule_depth: IntArg::from(d),
        safety_margin: IntArg::from(m),
    }
}

fn i31() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..64, 0u64..(1 << 31), Just((1u64 << 31) - 1)]
}

proptest! {
    #[test]
    fn int_matches_i128(a in any::<i64>(), b in any::<i64>()) {
        let (x, y) = (Int::from(a), Int::from(b));
        prop_assert_eq!(x.to_string(), a.to_string());
        prop_assert_eq!(x.cmp(&y), a.cmp(&b));
        prop_assert_eq!(x.mul(&y).to_i128(), Some(i128::from(a) * i128::from(b)));
        prop_assert_eq!(x.to_u64(), u64::try_from(a).ok());
        prop_assert_eq!(x.is_positive(), a > 0);
        let back = Int::from_magnitude_le_bytes(x.is_negative(), &x.magnitude_le_bytes());
        prop_assert_eq!(back, x);
    }

    #[test]
    fn int_products_beyond_128_bits_are_exact(a in any::<u128>(), b in any::<u128>(), c in 1u64..) {
        // (a * b) * c == a * (b * c), and dividing the decimal text checks nothing wrapped:
        // compare against u128 whenever the product fits.
        let (x, y, z) = (Int::from(a), Int::from(b), Int::from(c));
        prop_assert_eq!(x.mul(&y).mul(&z), x.mul(&y.mul(&z)));
        if let Some(p) = a.checked_mul(b) {
            prop_assert_eq!(x.mul(&y).to_string(), p.to_string());
        } else {
            prop_assert!(x.mul(&y) > Int::from(u128::MAX));
        }
    }

    #[test]
    fn page_counts_never_overflow_below_2_pow_31(
        v in proptest::array::uniform7(i31()),
        rows in 1u64..(1 << 31),
        window in 1u64..(1 << 31),
        overlap in any::<bool>(),
    ) {
        let mut v = v;
        v[4] = v[4].max(1);
        v[5] = u64::from(overlap);
        let specs = [
            spec("full_history", rows, 1, None, "history"),
            spec("full_history", rows, 1, None, "state"),
            spec("sliding_window", rows, 1, Some(window), "history"),
        ];
        let counts = compute_paged_cache_group_page_counts(&specs, &count_args(v));
        prop_assert!(counts.is_ok(), "{:?}", counts);
    }

    #[test]
    fn page_counts_are_monotonic_and_state_is_capped(
        v in proptest::array::uniform7(0u64..5000),
        rows in 1u64..300,
        window in 1u64..10_000,
        grow in 0usize..7,
    ) {
        let mut v = v;
        v[5] %= 2;
        v[4] = v[4].max(1);
        let specs = [
            spec("full_history", rows, 1, None, "history"),
            spec("full_history", rows, 1, None, "state"),
            spec("sliding_window", rows, 1, Some(window), "history"),
        ];
        let before = compute_paged_cache_group_page_counts(&specs, &count_args(v)).unwrap();
        // Every count has the null page and one page per live request at least.
        for &count in &before {
            prop_assert!(count > v[0] + v[6]);
        }
        prop_assert!(before[1] <= before[0]);
        if grow != 5 {
            let mut more = v;
            more[grow] += 1;
            let after = compute_paged_cache_group_page_counts(&specs, &count_args(more)).unwrap();
            for (a, b) in before.iter().zip(&after) {
                prop_assert!(a <= b);
            }
        }
    }

    #[test]
    fn capture_width_covers_context_plus_horizon(
        c in 0u64..100_000,
        n in 1u64..64,
        d in 0u64..2,
        rows in 1u64..300,
        window in 1u64..100_000,
    ) {
        let horizon = (d + 1) * n;
        let arg = |v: u64| IntArg::from(v);
        let full = compute_max_logical_pages_for_capture(
            &spec("full_history", rows, 1, None, "history"), &arg(c), &arg(n), &arg(d)).unwrap();
        prop_assert!(full * rows >= c + horizon);
        prop_assert!((full - 1) * rows < c + horizon);
        let sliding = compute_max_logical_pages_for_capture(
            &spec("sliding_window", rows, 1, Some(window), "history"), &arg(c), &arg(n), &arg(d)).unwrap();
        prop_assert!((sliding - 1) * rows >= window.min(c) + horizon);
        prop_assert!(sliding <= full + 1);
    }

    #[test]
    fn slab_size_is_the_common_label_count(
        kinds in proptest::collection::vec(0usize..2, 0..12),
        window in 1i64..5000,
    ) {
        let labels: Vec<&str> = kinds.iter().map(|&k| ["full_attention", "sliding_attention"][k]).collect();
        let types = LayerTypesArg::labels(&labels);
        let windows = WindowsArg::broadcast(window);
        prop_assert!(layer_group_ids(&types, &windows).is_ok());
        let full = kinds.iter().filter(|&&k| k == 0).count() as u64;
        let sliding = kinds.len() as u64 - full;
        let expected = (full == sliding && full > 0).then_some(full);
        if flat_kvcache_core::FLAT_KVCACHE {
            prop_assert_eq!(hybrid_slab_group_size(&types, &windows), expected);
        } else {
            prop_assert_eq!(hybrid_slab_group_size(&types, &windows), None);
        }
    }

    #[test]
    fn plans_fit_the_budget(
        sizes in proptest::collection::vec((0usize..3, 0usize..4, 1u64..512), 1..8),
        block in 1u64..64,
        budget in 0u64..(1 << 40),
    ) {
        let specs: Vec<ComponentSpec> = sizes
            .iter()
            .map(|&(group, layer, bytes)| ComponentSpec {
                group_id: format!("g{group}"),
                layer: group * 10 + layer,
                component: "kv".into(),
                bytes_per_slot: Int::from(bytes),
                const_bytes: Int::zero(),
            })
            .collect();
        let comps = component_args(&specs);
        let arg = |v: u64| IntArg::from(v);
        for plan in [
            plan_component_tensors(&comps, &arg(block), &arg(budget), &arg(0)),
            plan_tensors(&comps, &arg(block), &arg(budget)),
        ] {
            match plan {
                Ok(plan) => {
                    let g = plan.geometry;
                    prop_assert!(g.num_blocks >= 2);
                    prop_assert!(g.num_blocks * g.block_bytes <= budget);
                    prop_assert!((g.num_blocks + 1) * g.block_bytes > budget);
                    let total: u64 = plan.tensors.iter().map(|t| t.nbytes).sum();
                    prop_assert_eq!(total, g.num_blocks * g.block_bytes);
                }
                Err(err) => prop_assert!(err.to_string().contains("need at least 2")),
            }
        }
        // Per-token only: geometry keeps the block size.
        let geometry = solve_page_geometry(&comps, &arg(block), &arg(block)).unwrap();
        prop_assert_eq!(geometry.block_size, Int::from(block));
    }
}
