//! SPEC 3 memory plan, against values computed by hand from the SPEC.

use flat_kvcache_core::num::int::{Int, IntArg};
use flat_kvcache_core::sizing::plan::{
    component_args, components_from_layers, equalized_block_size, occurrence_index, plan_component_tensors,
    plan_tensors, solve_page_geometry, state_const_bytes, BlockGeometry, ComponentArg, ComponentSpec, LayerBinding,
    ShapeArg, StateComponentsArg, StateItemArg,
};
use flat_kvcache_core::sizing::{LabelItem, LayerTypesArg, WindowsArg};
use flat_kvcache_core::CoreError;

const FULL: &str = "full_attention";
const SLIDING: &str = "sliding_attention";
const LINEAR: &str = "linear_attention";

fn int(v: i64) -> IntArg {
    IntArg::from(v)
}

fn comp(group_id: &str, layer: usize, component: &str, bytes_per_slot: u64, const_bytes: u64) -> ComponentSpec {
    ComponentSpec {
        group_id: group_id.to_owned(),
        layer,
        component: component.to_owned(),
        bytes_per_slot: Int::from(bytes_per_slot),
        const_bytes: Int::from(const_bytes),
    }
}

fn args(specs: &[ComponentSpec]) -> Vec<ComponentArg> {
    component_args(specs)
}

fn state(items: &[(&str, i64)]) -> StateComponentsArg {
    StateComponentsArg::Items(
        items
            .iter()
            .map(|&(name, nbytes)| StateItemArg {
                name: LabelItem::Str(name.to_owned()),
                repr: format!("'{name}'"),
                nbytes: int(nbytes),
            })
            .collect(),
    )
}

fn message<T: std::fmt::Debug>(result: Result<T, CoreError>) -> String {
    result.unwrap_err().to_string()
}

fn binding(slot: usize, group: usize, component: usize, layer: u64, nbytes: u64, offset: u64) -> LayerBinding {
    LayerBinding {
        slot,
        group_source: group,
        component_source: component,
        layer: Int::from(layer),
        nbytes_per_block: nbytes,
        row_offset: offset,
    }
}

#[test]
fn occurrence_index_counts_earlier_layers_with_the_same_label() {
    let types = LayerTypesArg::labels(&[FULL, SLIDING, FULL, LINEAR, SLIDING, "other", FULL]);
    assert_eq!(occurrence_index(&types).unwrap(), [0, 0, 1, 0, 1, 0, 2]);
    assert!(occurrence_index(&LayerTypesArg::labels::<&str>(&[]))
        .unwrap()
        .is_empty());
    assert!(occurrence_index(&LayerTypesArg::Str).is_err());
}

#[test]
fn state_const_bytes_is_prod_shape_times_itemsize() {
    let dims = |dims: &[i64]| ShapeArg::Dims(dims.iter().map(|&d| int(d)).collect());
    // conv state [4, 3, 8] of bf16: 96 * 2 = 192
    assert_eq!(state_const_bytes(&dims(&[4, 3, 8]), &int(2)), Ok(192));
    assert_eq!(state_const_bytes(&dims(&[]), &int(4)), Ok(4));
    // A zero dimension gives 0 even next to one beyond u64.
    let zero_and_huge = ShapeArg::Dims(vec![int(0), IntArg::Int(Int::from(u128::MAX))]);
    assert_eq!(state_const_bytes(&zero_and_huge, &int(2)), Ok(0));
    assert_eq!(
        message(state_const_bytes(&dims(&[4, -1]), &int(2))),
        "shape[1] must be >= 0, got -1"
    );
    assert_eq!(
        message(state_const_bytes(&dims(&[4]), &int(0))),
        "itemsize must be > 0, got 0"
    );
    // Dimensions are checked before itemsize.
    assert_eq!(
        message(state_const_bytes(&dims(&[-2]), &int(0))),
        "shape[0] must be >= 0, got -2"
    );
    assert_eq!(
        state_const_bytes(&ShapeArg::NotSequence("int".into()), &int(2)),
        Err(CoreError::Type("shape must be a sequence of ints, not int".into()))
    );
    let err = state_const_bytes(&dims(&[1 << 40, 1 << 40]), &int(1)).unwrap_err();
    assert!(matches!(err, CoreError::Overflow { .. }), "{err}");
}

#[test]
fn components_follow_the_layers() {
    let types = LayerTypesArg::labels(&[FULL, LINEAR, SLIDING]);
    let comps = components_from_layers(
        &types,
        &int(64),
        &state(&[("conv", 100), ("ssm", 2000)]),
        &WindowsArg::broadcast(8),
    )
    .unwrap();
    assert_eq!(
        comps,
        [
            comp(FULL, 0, "kv", 64, 0),
            comp(LINEAR, 1, "conv", 0, 100),
            comp(LINEAR, 1, "ssm", 0, 2000),
            comp(SLIDING, 2, "kv", 64, 0),
        ]
    );
    assert_eq!(
        message(components_from_layers(
            &types,
            &int(64),
            &StateComponentsArg::None,
            &WindowsArg::broadcast(8)
        )),
        "layer 1 (linear_attention) needs state_component_bytes"
    );
    assert_eq!(
        message(components_from_layers(
            &types,
            &int(64),
            &state(&[]),
            &WindowsArg::broadcast(8)
        )),
        "layer 1 (linear_attention) needs state_component_bytes"
    );
    assert_eq!(
        message(components_from_layers(&types, &int(0), &state(&[]), &WindowsArg::None)),
        "kv_bytes_per_slot must be > 0, got 0"
    );
    assert_eq!(
        message(components_from_layers(
            &types,
            &int(64),
            &state(&[("conv", -1)]),
            &WindowsArg::None
        )),
        "state_component_bytes['conv'] must be >= 0, got -1"
    );
    // The mapping is checked before the layers, whether or not a state layer uses it.
    let other_key = StateComponentsArg::Items(vec![StateItemArg {
        name: LabelItem::Other("int".into()),
        repr: "1".into(),
        nbytes: int(1),
    }]);
    assert_eq!(
        components_from_layers(&LayerTypesArg::labels(&["x"]), &int(64), &other_key, &WindowsArg::None),
        Err(CoreError::Type(
            "state_component_bytes keys must be str, not int".into()
        ))
    );
    // The sizes the components carry are the caller's own values, handed back exactly.
    let two_64 = Int::from(u128::from(u64::MAX) + 1);
    let only_full = LayerTypesArg::labels(&[FULL]);
    let kv = components_from_layers(
        &only_full,
        &IntArg::Int(two_64.clone()),
        &StateComponentsArg::None,
        &WindowsArg::None,
    )
    .unwrap();
    assert_eq!(kv[0].bytes_per_slot, two_64);
}

#[test]
fn geometry_grows_the_block_to_hold_the_largest_state_row() {
    let comps = args(&[
        comp(FULL, 0, "kv", 64, 0),
        comp(LINEAR, 1, "conv", 0, 100),
        comp(LINEAR, 1, "ssm", 0, 2000),
    ]);
    // max_linear = 64, max_const = 2100, needed = ceil(2100 / 64) = 33 > 16:
    // block = 16 * ceil(33 / 16) = 48, block_bytes = max(64 * 48, 2100) = 3072.
    assert_eq!(
        solve_page_geometry(&comps, &int(16), &int(16)),
        Ok(BlockGeometry {
            block_size: Int::from(48u64),
            block_bytes: 3072,
            num_blocks: 0
        })
    );
    // alignment 8: block = 8 * ceil(33 / 8) = 40.
    assert_eq!(
        solve_page_geometry(&comps, &int(16), &int(8)).unwrap().block_size,
        Int::from(40u64)
    );
    // A block already large enough stays: 64 >= 33, block_bytes = 64 * 64 = 4096.
    assert_eq!(
        solve_page_geometry(&comps, &int(64), &int(16)).unwrap(),
        BlockGeometry {
            block_size: Int::from(64u64),
            block_bytes: 4096,
            num_blocks: 0
        }
    );
    // The default alignment is the block size: 10 * ceil(33 / 10) = 40.
    assert_eq!(equalized_block_size(&comps, &int(10), None), Ok(Int::from(40u64)));
    assert_eq!(
        equalized_block_size(&comps, &int(10), Some(&int(4))),
        Ok(Int::from(36u64))
    );
    // Rows sum their components: two kv parts in one row give 128 bytes per slot.
    let two_parts = args(&[
        comp("g", 0, "k", 64, 0),
        comp("g", 0, "v", 64, 0),
        comp("h", 1, "kv", 32, 0),
    ]);
    assert_eq!(
        solve_page_geometry(&two_parts, &int(16), &int(16)).unwrap().block_bytes,
        2048
    );
    // No components: block_bytes 0.
    assert_eq!(
        solve_page_geometry(&[], &int(16), &int(16)),
        Ok(BlockGeometry {
            block_size: Int::from(16u64),
            block_bytes: 0,
            num_blocks: 0
        })
    );
}

#[test]
fn geometry_errors_follow_the_contract() {
    let mixed = args(&[comp("g", 0, "kv", 64, 0), comp("g", 0, "conv", 0, 10)]);
    assert_eq!(
        message(solve_page_geometry(&mixed, &int(16), &int(16))),
        "group g layer 0 mixes per-token and per-page components"
    );
    let const_only = args(&[comp("g", 0, "conv", 0, 10)]);
    assert_eq!(
        message(solve_page_geometry(&const_only, &int(16), &int(16))),
        "state components need at least one per-token (history) component to size pages"
    );
    assert_eq!(
        message(solve_page_geometry(&[], &int(0), &int(16))),
        "block_size must be > 0, got 0"
    );
    assert_eq!(
        message(solve_page_geometry(&[], &int(16), &int(-1))),
        "alignment must be > 0, got -1"
    );
    let mut bad = args(&[comp("g", 0, "kv", 64, 0)]);
    bad[0].bytes_per_slot = int(-3);
    assert_eq!(
        message(solve_page_geometry(&bad, &int(16), &int(16))),
        "components[0].bytes_per_slot must be >= 0, got -3"
    );
    bad[0].layer = IntArg::Bool;
    assert_eq!(
        solve_page_geometry(&bad, &int(16), &int(16)),
        Err(CoreError::Type("components[0].layer must be an int, not bool".into()))
    );
}

#[test]
fn component_plan_gives_one_tensor_per_component() {
    let comps = args(&[comp(FULL, 0, "kv", 64, 0), comp(SLIDING, 1, "kv", 32, 0)]);
    // rows 64 * 16 = 1024 and 32 * 16 = 512; 10_000 // 1536 = 6 blocks.
    let plan = plan_component_tensors(&comps, &int(16), &int(10_000), &int(0)).unwrap();
    assert_eq!(
        plan.geometry,
        BlockGeometry {
            block_size: Int::from(16u64),
            block_bytes: 1536,
            num_blocks: 6
        }
    );
    assert_eq!(plan.tensors.len(), 2);
    assert_eq!(plan.tensors[0].name, "full_attention.0.kv");
    assert_eq!(plan.tensors[0].nbytes, 6 * 1024);
    assert_eq!(plan.tensors[0].bindings, [binding(0, 0, 0, 0, 1024, 0)]);
    assert_eq!(plan.tensors[1].name, "sliding_attention.1.kv");
    assert_eq!(plan.tensors[1].nbytes, 6 * 512);
    assert_eq!(plan.tensors[1].bindings, [binding(1, 1, 1, 1, 512, 0)]);
    // reserved 464: 10_000 // 2000 = 5 blocks; block_bytes stays the sum of rows.
    let plan = plan_component_tensors(&comps, &int(16), &int(10_000), &int(464)).unwrap();
    assert_eq!(plan.geometry.num_blocks, 5);
    assert_eq!(plan.geometry.block_bytes, 1536);
    assert_eq!(
        message(plan_component_tensors(&comps, &int(16), &int(3071), &int(0))),
        "budget_bytes=3071 gives 1 blocks of 1536 bytes; need at least 2 (one is the null page)"
    );
    assert_eq!(
        message(plan_component_tensors(&[], &int(16), &int(3071), &int(0))),
        "budget_bytes=3071 gives 0 blocks of 0 bytes; need at least 2 (one is the null page)"
    );
    assert_eq!(
        message(plan_component_tensors(&comps, &int(16), &int(-1), &int(0))),
        "budget_bytes must be >= 0, got -1"
    );
    assert_eq!(
        message(plan_component_tensors(&comps, &int(16), &int(1), &int(-1))),
        "reserved_bytes_per_block must be >= 0, got -1"
    );
}

#[test]
fn a_row_sum_beyond_u64_is_still_the_exact_budget_error() {
    // Two rows of about 2**64 bytes: the divisor does not fit u64, the error prints it exactly.
    let comps = args(&[comp("g", 0, "kv", u64::MAX, 0), comp("g", 1, "kv", u64::MAX, 0)]);
    // rows = (2**64 - 1) * 2 each; sum = 4 * (2**64 - 1) = 73786976294838206460
    assert_eq!(
        message(plan_component_tensors(&comps, &int(2), &int(1000), &int(0))),
        "budget_bytes=1000 gives 0 blocks of 73786976294838206460 bytes; need at least 2 (one is the null page)"
    );
}

#[test]
fn slab_plan_shares_slot_j_between_the_jth_layers_of_every_group() {
    let comps = args(&[
        comp(FULL, 0, "kv", 64, 0),
        comp(SLIDING, 1, "kv", 64, 0),
        comp(FULL, 2, "kv", 64, 0),
        comp(SLIDING, 3, "kv", 64, 0),
    ]);
    // Two slots of max(1024, 1024) bytes: 10_000 // 2048 = 4 blocks.
    let plan = plan_tensors(&comps, &int(16), &int(10_000)).unwrap();
    assert_eq!(
        plan.geometry,
        BlockGeometry {
            block_size: Int::from(16u64),
            block_bytes: 2048,
            num_blocks: 4
        }
    );
    assert_eq!(plan.tensors.len(), 2);
    assert_eq!(plan.tensors[0].name, "slab0");
    assert_eq!(plan.tensors[0].nbytes, 4096);
    // Bindings in group order; the group's id comes from its first component.
    assert_eq!(
        plan.tensors[0].bindings,
        [binding(0, 0, 0, 0, 1024, 0), binding(0, 1, 1, 1, 1024, 0)]
    );
    assert_eq!(
        plan.tensors[1].bindings,
        [binding(1, 0, 2, 2, 1024, 0), binding(1, 1, 3, 3, 1024, 0)]
    );
}

#[test]
fn slab_rows_pack_components_at_increasing_offsets() {
    let comps = args(&[
        comp(FULL, 0, "kv", 64, 0),
        comp(LINEAR, 1, "conv", 0, 100),
        comp(LINEAR, 1, "ssm", 0, 300),
        comp(FULL, 2, "kv", 64, 0),
    ]);
    // slot 0: max(full row 1024, linear row 100 + 300 = 400) = 1024; slot 1: 1024.
    // 5000 // 2048 = 2 blocks.
    let plan = plan_tensors(&comps, &int(16), &int(5000)).unwrap();
    assert_eq!(plan.geometry.block_bytes, 2048);
    assert_eq!(plan.geometry.num_blocks, 2);
    assert_eq!(
        plan.tensors[0].bindings,
        [
            binding(0, 0, 0, 0, 1024, 0),
            binding(0, 1, 1, 1, 100, 0),
            binding(0, 1, 2, 1, 300, 100),
        ]
    );
    assert_eq!(plan.tensors[1].bindings, [binding(1, 0, 3, 2, 1024, 0)]);
    assert_eq!(plan.tensors[1].nbytes, 2048);
    assert_eq!(
        message(plan_tensors(&comps, &int(16), &int(4095))),
        "budget_bytes=4095 gives 1 blocks of 2048 bytes; need at least 2 (one is the null page)"
    );
    assert_eq!(
        message(plan_tensors(&[], &int(16), &int(4095))),
        "budget_bytes=4095 gives 0 blocks of 0 bytes; need at least 2 (one is the null page)"
    );
}
