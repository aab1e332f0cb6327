//! Criterion benches of the page engine's hot paths (targets in benches/README.md):
//! pool allocate+free per page, 16-token page hashing, a 256-page full-attention prefix match,
//! a decode step for 256 requests on a full + sliding-window model (+ block tables), and the
//! same step through the token-level API, addressed by slot (`schedule` +
//! `write_block_tables_in` into caller buffers).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use flat_kvcache_core::engine::coordinator::{GroupSpec, PrefixMatch};
use flat_kvcache_core::engine::group::GroupKind;
use flat_kvcache_core::engine::hash::{hash_page, hash_pages, ContentHash, GroupKey};
use flat_kvcache_core::engine::ids::{RequestId, RequestIdRef};
use flat_kvcache_core::engine::pool::BlockPool;
use flat_kvcache_core::engine::tokens::Prompt;
use flat_kvcache_core::engine::FlatCache;
use flat_kvcache_core::engine::TableOut;

const PAGE: u64 = 16;

fn tokens(n: u32, seed: u32) -> Vec<u32> {
    (0..n)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 151_936)
        .collect()
}

fn bench_pool(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool");
    for n in [1usize, 16, 256] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(format!("allocate_free_{n}_pages"), |b| {
            let mut pool: BlockPool<GroupKey> = BlockPool::new(65_536, true).unwrap();
            let mut out: Vec<u32> = Vec::with_capacity(n);
            let mut ids: Vec<u64> = Vec::with_capacity(n);
            b.iter(|| {
                out.clear();
                assert!(pool.allocate_into(&mut out, black_box(n)));
                ids.clear();
                ids.extend(out.iter().map(|&p| u64::from(p)));
                pool.free(&ids).unwrap();
            });
        });
    }
    group.finish();
}

fn bench_hash(c: &mut Criterion) {
    let mut group = c.benchmark_group("hash");
    let toks = tokens(16 * 4096, 1);
    group.throughput(Throughput::Elements(4096));
    group.bench_function("hash_pages_16_tokens_x4096", |b| {
        b.iter(|| hash_pages::<&str>(black_box(&toks), 16, &[], &[]).unwrap());
    });
    group.throughput(Throughput::Elements(1));
    let prior = [7u8; 32];
    group.bench_function("hash_page_16_tokens", |b| {
        b.iter(|| hash_page::<&str>(black_box(&toks[..16]), black_box(&prior), &[]).unwrap());
    });
    group.finish();
}

fn full_spec() -> GroupSpec {
    GroupSpec {
        group_id: "full".into(),
        kind: GroupKind::Full,
        page_size: PAGE,
    }
}

fn swa_spec(window: u64) -> GroupSpec {
    GroupSpec {
        group_id: "swa".into(),
        kind: GroupKind::SlidingWindow { window },
        page_size: PAGE,
    }
}

fn bench_match(c: &mut Criterion) {
    let mut group = c.benchmark_group("match");
    let hashes = hash_pages::<&str>(&tokens(256 * 16, 3), 16, &[], &[]).unwrap();
    let mut cache = FlatCache::new(vec![full_spec()], 4096, true).unwrap();
    let req = RequestIdRef::Int(0);
    assert!(cache.acquire(req, 256 * PAGE).unwrap());
    cache.register(req, &hashes, 0, None).unwrap();
    cache.free(req).unwrap();
    assert_eq!(cache.match_prefix(&hashes).unwrap().num_hit_pages, vec![256]);
    group.bench_function("full_attention_256_pages", |b| {
        b.iter(|| cache.match_prefix(black_box(&hashes)).unwrap());
    });
    let mut hybrid = FlatCache::new(vec![full_spec(), swa_spec(1024)], 8192, true).unwrap();
    assert!(hybrid.acquire(req, 256 * PAGE).unwrap());
    hybrid.register(req, &hashes, 0, None).unwrap();
    hybrid.free(req).unwrap();
    group.bench_function("full_plus_sliding_256_pages", |b| {
        b.iter(|| hybrid.match_prefix(black_box(&hashes)).unwrap());
    });
    group.finish();
}

/// 256 requests with a 2048-token prompt on a full + sliding-window (W = 1024) model.
struct DecodeFixture {
    cache: FlatCache,
    ids: Vec<RequestId>,
    hashes: Vec<Vec<ContentHash>>,
    computed: u64,
}

const REQUESTS: usize = 256;
const PROMPT: u64 = 2048;
const STEPS_PER_ROUND: u64 = 512;

impl DecodeFixture {
    fn new() -> Self {
        let pages = REQUESTS as u64 * (PROMPT + STEPS_PER_ROUND + PAGE) / PAGE * 2 + 1;
        let mut fixture = Self {
            cache: FlatCache::new(vec![full_spec(), swa_spec(1024)], pages, true).unwrap(),
            ids: (0..REQUESTS)
                .map(|r| RequestId::Int(i64::try_from(r).unwrap()))
                .collect(),
            hashes: (0..REQUESTS)
                .map(|r| {
                    let t = tokens(
                        u32::try_from(PROMPT + STEPS_PER_ROUND).unwrap(),
                        u32::try_from(r).unwrap(),
                    );
                    hash_pages::<&str>(&t, 16, &[], &[]).unwrap()
                })
                .collect(),
            computed: 0,
        };
        fixture.admit();
        fixture
    }

    /// Free everything and prefill every request's prompt (plus the first decode slot).
    fn admit(&mut self) {
        for id in &self.ids {
            let req = id.as_ref();
            if self.cache.has_request(req) {
                self.cache.free(req).unwrap();
            }
            assert!(self
                .cache
                .prefill_first_chunk(req, &PrefixMatch::empty(2), PROMPT)
                .unwrap());
        }
        self.computed = PROMPT;
    }

    /// One decode step of every request (one token each), then the batch's block tables.
    fn step(&mut self) {
        self.decode_all();
        let refs: Vec<RequestIdRef<'_>> = self.ids.iter().map(RequestId::as_ref).collect();
        black_box(self.cache.block_tables(&refs).unwrap());
    }

    /// One decode step of every request (one token each).
    fn decode_all(&mut self) {
        let computed = self.computed;
        let slot = computed / PAGE;
        for (id, hashes) in self.ids.iter().zip(&self.hashes) {
            // Register the page completed by the previous step, if any.
            let new: &[ContentHash] = if computed % PAGE == 0 {
                let i = usize::try_from(slot - 1).unwrap();
                &hashes[i..=i]
            } else {
                &[]
            };
            let first = if new.is_empty() { slot } else { slot - 1 };
            assert!(self.cache.decode_step(id.as_ref(), new, first, 1, computed).unwrap());
        }
        self.computed += 1;
    }
}

fn bench_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    let mut fixture = DecodeFixture::new();
    group.bench_function("step_256_requests_full_plus_swa", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                if fixture.computed >= PROMPT + STEPS_PER_ROUND {
                    fixture.admit();
                }
                let start = Instant::now();
                fixture.step();
                total += start.elapsed();
            }
            total
        });
    });
    group.bench_function("decode_only_256_requests_full_plus_swa", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                if fixture.computed >= PROMPT + STEPS_PER_ROUND {
                    fixture.admit();
                }
                let start = Instant::now();
                fixture.decode_all();
                total += start.elapsed();
            }
            total
        });
    });
    group.bench_function("block_tables_256_requests", |b| {
        let refs: Vec<RequestIdRef<'_>> = fixture.ids.iter().map(RequestId::as_ref).collect();
        b.iter(|| black_box(fixture.cache.block_tables(&refs).unwrap()));
    });
    group.bench_function("admit_256_requests_2048_tokens", |b| {
        b.iter_batched(|| (), |()| fixture.admit(), BatchSize::PerIteration);
    });
    group.finish();
}

/// 256 token-level requests (2048-token prompts, full + sliding W = 1024) decoding one token
/// per step: one `append_tokens`, then one `schedule` and one `write_block_tables_in` into
/// two `[256, COLS]` buffers, all by slot, as a scheduler loop would.
struct TokenStepFixture {
    cache: FlatCache,
    ids: Vec<String>,
    /// The slot of each request (0..256: each new request takes the lowest free slot).
    slots: Vec<u64>,
    ones: Vec<u64>,
    sampled: Vec<u32>,
    full: Vec<i32>,
    swa: Vec<i32>,
    steps_left: u64,
    rounds: u32,
}

/// Capture width of a 2048 + 256-token context (`ceil((C + 1) / P)`).
const COLS: usize = 145;
const TOKEN_STEPS: u64 = 256;

impl TokenStepFixture {
    fn new() -> Self {
        let pages = REQUESTS as u64 * (PROMPT + TOKEN_STEPS + PAGE) / PAGE * 2 + 1;
        let mut fixture = Self {
            cache: FlatCache::new(vec![full_spec(), swa_spec(1024)], pages, true).unwrap(),
            ids: (0..REQUESTS).map(|r| format!("req-{r}")).collect(),
            slots: Vec::with_capacity(REQUESTS),
            ones: vec![1; REQUESTS],
            sampled: vec![7; REQUESTS],
            full: vec![0; REQUESTS * COLS],
            swa: vec![0; REQUESTS * COLS],
            steps_left: 0,
            rounds: 0,
        };
        fixture.admit();
        fixture
    }

    /// Finish every request and add a fresh prompt for each, prefilled in one batch.
    fn admit(&mut self) {
        self.cache.finish(&self.slots).unwrap();
        self.slots.clear();
        for (r, id) in self.ids.iter().enumerate() {
            let req = RequestIdRef::Str(id);
            let seed = self.rounds * 1000 + u32::try_from(r).unwrap();
            let prompt = Prompt::new(tokens(u32::try_from(PROMPT).unwrap(), seed), Vec::new(), PAGE).unwrap();
            let (slot, hit) = self.cache.add_request(req, prompt, true).unwrap();
            assert_eq!((slot, hit), (r, 0));
            self.slots.push(u64::try_from(slot).unwrap());
        }
        let got = self.cache.schedule(&self.slots, &vec![PROMPT; REQUESTS], 0).unwrap();
        assert!(got.iter().all(|&ok| ok));
        // Register the prefill's pages (at c = 2048) as part of admission, untimed.
        let got = self.cache.schedule(&self.slots, &vec![0; REQUESTS], 0).unwrap();
        assert!(got.iter().all(|&ok| ok));
        self.steps_left = TOKEN_STEPS;
        self.rounds += 1;
    }

    /// Start a new round when this one has run its steps (untimed).
    fn ensure_room(&mut self) {
        if self.steps_left == 0 {
            self.admit();
        }
        self.steps_left -= 1;
    }

    /// Hand every request one sampled token, in one call.
    fn append(&mut self) {
        self.cache.append_tokens(&self.slots, &self.sampled, None).unwrap();
    }

    /// The timed part: one batch schedule and the two groups' tables into the buffers.
    fn step(&mut self) {
        let got = self.cache.schedule(&self.slots, &self.ones, 0).unwrap();
        assert!(got.iter().all(|&ok| ok));
        let mut outs = [
            TableOut {
                data: &mut self.full,
                rows: REQUESTS,
                cols: COLS,
            },
            TableOut {
                data: &mut self.swa,
                rows: REQUESTS,
                cols: COLS,
            },
        ];
        self.cache.write_block_tables_in(&self.slots, &mut outs).unwrap();
    }
}

fn bench_token_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("token_step");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    let mut fixture = TokenStepFixture::new();
    group.bench_function("schedule_plus_write_tables_256_requests", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                fixture.ensure_room();
                fixture.append();
                let start = Instant::now();
                fixture.step();
                total += start.elapsed();
            }
            total
        });
    });
    group.bench_function("append_tokens_256_requests", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                fixture.ensure_room();
                let start = Instant::now();
                fixture.append();
                total += start.elapsed();
                fixture.step();
            }
            total
        });
    });
    // The same tables written by id (the page-level call) and by slot.
    group.bench_function("write_block_tables_256_requests", |b| {
        let refs: Vec<RequestIdRef<'_>> = fixture.ids.iter().map(|s| RequestIdRef::Str(s)).collect();
        let (mut full, mut swa) = (fixture.full.clone(), fixture.swa.clone());
        b.iter(|| {
            let mut outs = [
                TableOut {
                    data: &mut full,
                    rows: REQUESTS,
                    cols: COLS,
                },
                TableOut {
                    data: &mut swa,
                    rows: REQUESTS,
                    cols: COLS,
                },
            ];
            fixture.cache.write_block_tables(&refs, &mut outs).unwrap();
        });
    });
    group.bench_function("write_block_tables_in_256_requests", |b| {
        let (mut full, mut swa) = (fixture.full.clone(), fixture.swa.clone());
        b.iter(|| {
            let mut outs = [
                TableOut {
                    data: &mut full,
                    rows: REQUESTS,
                    cols: COLS,
                },
                TableOut {
                    data: &mut swa,
                    rows: REQUESTS,
                    cols: COLS,
                },
            ];
            fixture.cache.write_block_tables_in(&fixture.slots, &mut outs).unwrap();
        });
    });
    group.finish();
}

criterion_group!(
    benches,
    bench_pool,
    bench_hash,
    bench_match,
    bench_decode,
    bench_token_step
);
criterion_main!(benches);
