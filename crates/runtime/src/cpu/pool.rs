//! The CPU worker pool: fork-join over a fixed set of threads.
//!
//! A whole forward pass runs inside [`CpuPool::install`], so the ops it calls split their work
//! with [`CpuPool::for_each`] on threads that are already awake.

use rayon::prelude::*;

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
pub struct SyncPtr<T>(pub *mut T);

// SAFETY: the pointer is only a carrier; every user writes disjoint ranges.
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    #[inline(always)]
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// Worker threads for the CPU backend.
pub struct CpuPool {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl CpuPool {
    /// A pool of `threads` workers (0 = one per available core).
    pub fn new(threads: usize) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("dflash-cpu-{i}"))
            .build()
            .expect("the OS refused to start worker threads");
        Self { pool, threads }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on a pool thread (a no-op hop when already inside the pool).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Calls `f(t)` for every task `t < tasks`, spread over the workers; returns when all ran.
    pub fn for_each(&self, tasks: usize, f: impl Fn(usize) + Sync + Send) {
        if tasks <= 1 || self.threads == 1 {
            (0..tasks).for_each(f);
        } else {
            self.pool
                .install(|| (0..tasks).into_par_iter().with_max_len(1).for_each(f));
        }
    }
}
