//! The CPU worker pool: low-latency fork-join over a fixed set of threads.
//!
//! Decoding one token of a small model runs a few hundred parallel regions of tens of
//! microseconds each, so waking sleeping threads for every region would cost more than the
//! work. Workers here spin on an epoch counter for a short while after each job (staying hot
//! through a decode step) and only then park on a condition variable. The calling thread
//! always takes part in its own job. A job is published under a mutex and withdrawn under it
//! before `for_each` returns, so no worker can touch a job after its closure is gone.
//!
//! A task that panics does not take the pool down: the panic is caught where the task ran
//! (worker or caller), the job still completes and is withdrawn, and the first panic is then
//! resumed on the calling thread. Workers keep serving later jobs.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(200);

type Task<'a> = &'a (dyn Fn(usize) + Sync);

struct Slot {
    /// The job's closure, lifetime-erased; `Some` only while its `for_each` runs.
    job: Option<Task<'static>>,
    tasks: usize,
    /// Workers currently inside the job.
    active: usize,
}

struct Shared {
    slot: Mutex<Slot>,
    wake: Condvar,
    epoch: AtomicU64,
    next: AtomicUsize,
    done: AtomicUsize,
    shutdown: AtomicBool,
    /// The first panic of the current job's tasks, resumed by the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

thread_local! {
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Worker threads for the CPU backend.
pub struct CpuPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    /// Serialises callers from different threads.
    caller: Mutex<()>,
}

impl CpuPool {
    /// A pool of `threads` workers in total, the caller included (0 = one per core).
    pub fn new(threads: usize) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot {
                job: None,
                tasks: 0,
                active: 0,
            }),
            wake: Condvar::new(),
            epoch: AtomicU64::new(0),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panic: Mutex::new(None),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let s = shared.clone();
            match std::thread::Builder::new()
                .name(format!("dflash-cpu-{i}"))
                .spawn(move || worker(&s))
            {
                Ok(w) => workers.push(w),
                Err(e) => {
                    tracing::warn!(
                        "the OS refused worker thread {i} ({e}); running with {i} threads"
                    );
                    break;
                }
            }
        }
        let threads = workers.len() + 1;
        Self {
            shared,
            workers,
            threads,
            caller: Mutex::new(()),
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` (kept for API symmetry with device backends that need a context).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Calls `f(t)` for every task `t < tasks`, spread over the workers; returns when all ran.
    pub fn for_each(&self, tasks: usize, f: impl Fn(usize) + Sync + Send) {
        if tasks <= 1 || self.threads == 1 || IN_JOB.with(Cell::get) {
            (0..tasks).for_each(f);
            return;
        }
        let _one_caller = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let task: Task<'_> = &f;
        // SAFETY: the job is withdrawn (and every worker has left it) before this returns,
        // so the erased reference never outlives `f`.
        let task: Task<'static> = unsafe { std::mem::transmute(task) };
        {
            let mut slot = s.slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.job = Some(task);
            slot.tasks = tasks;
            s.next.store(0, Ordering::Relaxed);
            s.done.store(0, Ordering::Relaxed);
            s.epoch.fetch_add(1, Ordering::Release);
        }
        s.wake.notify_all();
        IN_JOB.with(|c| c.set(true));
        run_tasks(s, task, tasks);
        IN_JOB.with(|c| c.set(false));
        while s.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        loop {
            let mut slot = s.slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.job = None;
            if slot.active == 0 {
                break;
            }
            drop(slot);
            std::hint::spin_loop();
        }
        let panicked = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }
}

fn run_tasks(s: &Shared, task: Task<'_>, tasks: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            break;
        }
        // A panicking task still counts as done, so the job ends and is withdrawn.
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| task(i))) {
            s.panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(p);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    IN_JOB.with(|c| c.set(true));
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                let slot = s.slot.lock().unwrap_or_else(|e| e.into_inner());
                if s.epoch.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Relaxed) {
                    drop(s.wake.wait_timeout(slot, Duration::from_millis(100)));
                }
            } else {
                std::hint::spin_loop();
            }
        }
        let (task, tasks) = {
            let mut slot = s.slot.lock().unwrap_or_else(|e| e.into_inner());
            seen = s.epoch.load(Ordering::Acquire);
            match slot.job {
                Some(t) => {
                    slot.active += 1;
                    (t, slot.tasks)
                }
                None => continue,
            }
        };
        run_tasks(s, task, tasks);
        s.slot.lock().unwrap_or_else(|e| e.into_inner()).active -= 1;
    }
}

impl Drop for CpuPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _slot = self.shared.slot.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = CpuPool::new(3);
        for tasks in [0usize, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.for_each(tasks, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn nested_calls_run_inline_and_workers_survive_idle_periods() {
        let pool = CpuPool::new(2);
        let total = AtomicUsize::new(0);
        pool.for_each(4, |_| {
            pool.for_each(3, |_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        std::thread::sleep(Duration::from_millis(5));
        pool.for_each(5, |_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 17);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_keeps_working() {
        let pool = CpuPool::new(2);
        for bad in [0usize, 5] {
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.for_each(8, |i| {
                    if i == bad {
                        panic!("task {i} fails");
                    }
                    // Keep the others busy long enough for a worker to take some.
                    std::thread::sleep(Duration::from_micros(200));
                });
            }));
            let msg = r.expect_err("the panic must reach the caller");
            assert_eq!(
                msg.downcast_ref::<String>().unwrap(),
                &format!("task {bad} fails")
            );
        }
        let total = AtomicUsize::new(0);
        pool.for_each(16, |_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 16);
    }

    #[test]
    fn callers_on_several_threads_are_serialised() {
        let pool = Arc::new(CpuPool::new(2));
        let total = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (p, t) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        p.for_each(8, |_| {
                            t.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(total.load(Ordering::Relaxed), 3200);
    }
}
