//! Scheduler configuration validation (SPEC 10): the checks of
//! `validate_flat_scheduler_config` on facts the bindings resolved.

use crate::error::{CoreError, CoreResult};

/// What `validate_flat_scheduler_config` needs to know, resolved by the bindings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerFacts {
    /// `type(resolved_backend).__name__`.
    pub backend: String,
    /// `type(kv_pool).__name__`.
    pub kv_pool: String,
    /// `bool(getattr(backend, "uses_paged_cache_groups", False))`.
    pub uses_paged_cache_groups: bool,
    /// `bool(getattr(backend, "uses_flat_cache_groups", False))`.
    pub uses_flat_cache_groups: bool,
    /// `bool(getattr(backend, "flat_spec_capable", True))`.
    pub flat_spec_capable: bool,
    /// `str(speculative_algorithm)`, or None when it is falsy.
    pub speculative_algorithm: Option<String>,
    /// `len(paged_cache_groups)` (0 for None).
    pub num_groups: usize,
}

/// The error for a `full_attn_backend` chain that comes back to a backend already seen.
pub fn backend_cycle_error() -> CoreError {
    CoreError::Config("attn_backend full_attn_backend chain has a cycle".to_owned())
}

/// Whether `validate_flat_scheduler_config` checks anything: not when `flat_kvcache_ext` is
/// false, and never without the `flat` feature (SPEC 10). Only then are the facts resolved.
pub fn validation_applies(flat_kvcache_ext: bool) -> bool {
    flat_kvcache_ext && crate::FLAT_KVCACHE
}

/// The five checks of `validate_flat_scheduler_config` on resolved facts, in the contract's
/// order (call it when [`validation_applies`]).
pub fn validate_flat_scheduler_config(facts: &SchedulerFacts) -> CoreResult<()> {
    let (b, p) = (&facts.backend, &facts.kv_pool);
    let fail = |msg: String| Err(CoreError::Config(format!("flat KV cache: {msg}")));
    if facts.uses_paged_cache_groups && !facts.uses_flat_cache_groups {
        return fail(format!(
            "backend {b} uses paged cache groups but does not consume flat per-group tables (kv_pool {p})"
        ));
    }
    if let Some(algorithm) = &facts.speculative_algorithm {
        if !facts.flat_spec_capable {
            return fail(format!(
                "speculative algorithm {algorithm} needs a flat-spec-capable backend; {b} is not (kv_pool {p})"
            ));
        }
        if algorithm.to_uppercase() == "DFLASH" {
            return fail(format!(
                "speculative algorithm DFLASH is not supported (backend {b}, kv_pool {p})"
            ));
        }
    }
    if facts.num_groups > 1 && !facts.uses_flat_cache_groups {
        return fail(format!(
            "{} paged cache groups but backend {b} does not consume flat per-group tables; the single-table \
             fallback would serve one group's pages to every layer and silently corrupt KV (kv_pool {p})",
            facts.num_groups
        ));
    }
    if facts.num_groups == 0 {
        return fail(format!(
            "at least one paged cache group is required; state-only pools publish none (backend {b}, kv_pool {p})"
        ));
    }
    Ok(())
}
