//! The calls of [`FlatCache`](super::FlatCache), one concern per file, each an `impl` block on
//! the cache (the struct and its request slab are defined in the parent module):
//!
//! - `page`: the page-level protocol (claim, acquire, register, reclaim, free, the step
//!   calls) and the per-request readers by id or slot (SPEC 7, 8);
//! - `token`: requests that own their tokens, named by slot (add, admit, append, schedule,
//!   finish, preempt; SPEC 8, 9, 12.4);
//! - `admission`: capped prefix probes, admission cost, reserves and budget (SPEC 9);
//! - [`tables`]: flat block tables, returned or written into caller buffers (SPEC 8, 10);
//! - [`rows`]: persistent block-table rows updated by deltas;
//! - `state`: the read and write state slots of a step (SPEC 13.4);
//! - `host`: the host tier's transfers as the cache's calls (loads tied to requests);
//! - [`stats`]: metrics and the event log;
//! - `invariants`: the SPEC 1 bookkeeping checks.

mod admission;
mod host;
mod invariants;
mod page;
pub mod rows;
mod state;
pub mod stats;
pub mod tables;
mod token;
