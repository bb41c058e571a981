//! Weight storage on transparent huge pages.
//!
//! A decode step streams every weight matrix once per token. On 4 KiB pages that is a TLB
//! miss every 4 KiB (a two-level page walk under a hypervisor); on the project's 2-vCPU KVM
//! machine it cost about a seventh of a decode step. The CPU backend therefore keeps the
//! matrices it multiplies in [`HugeBytes`]: 64-byte aligned slices carved from large
//! anonymous mappings that are aligned to 2 MiB and advised `MADV_HUGEPAGE` before their
//! first write. Where the mapping or the advice is refused (another OS, THP disabled) the
//! same bytes live on ordinary pages; only the speed differs.
//!
//! The slices come from one process-wide arena: chunks of [`CHUNK`] bytes, a larger request
//! getting a chunk of its own. A chunk is unmapped when its last slice is dropped.

use std::sync::{Arc, Mutex};

/// Bytes per shared chunk.
const CHUNK: usize = 32 << 20;
/// The huge-page size the mappings are aligned to.
const HUGE_PAGE: usize = 2 << 20;
/// Alignment of every slice (a cache line, and the kernels' vector loads).
const ALIGN: usize = 64;

struct Chunk {
    /// Owns the zeroed memory (a mapping, or a vector where mapping failed); only `base` is
    /// used after construction.
    _store: Box<dyn Send + Sync>,
    base: *mut u8,
    len: usize,
}

// SAFETY: the memory is only reached through `HugeBytes`, whose ranges never overlap; each is
// written once (while it is still exclusively owned) and only read afterwards.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Chunk {
    fn new(len: usize) -> Chunk {
        match memmap2::MmapMut::map_anon(len + HUGE_PAGE) {
            Ok(mut map) => {
                let p = map.as_mut_ptr();
                let skip = p.align_offset(HUGE_PAGE);
                #[cfg(target_os = "linux")]
                if let Err(e) = map.advise_range(memmap2::Advice::HugePage, skip, len) {
                    tracing::debug!("huge pages refused for weight storage: {e}");
                }
                // SAFETY: `skip < HUGE_PAGE`, so `skip + len` lies inside the mapping.
                let base = unsafe { p.add(skip) };
                Chunk {
                    _store: Box::new(map),
                    base,
                    len,
                }
            }
            Err(e) => {
                tracing::debug!("anonymous mapping refused ({e}); weight storage on the heap");
                let mut v = vec![0u8; len + ALIGN];
                let skip = v.as_mut_ptr().align_offset(ALIGN);
                // SAFETY: `skip < ALIGN`, inside the vector.
                let base = unsafe { v.as_mut_ptr().add(skip) };
                Chunk {
                    _store: Box::new(v),
                    base,
                    len,
                }
            }
        }
    }
}

/// A chunk being filled and its first free byte.
type Filling = Option<(Arc<Chunk>, usize)>;

/// The shared chunk being filled.
static CURRENT: Mutex<Filling> = Mutex::new(None);

/// An immutable, 64-byte aligned byte buffer on huge pages where the system allows.
pub struct HugeBytes {
    chunk: Arc<Chunk>,
    off: usize,
    len: usize,
}

impl HugeBytes {
    /// `len` bytes, first set by `fill` (handed zeroed memory).
    pub fn with(len: usize, fill: impl FnOnce(&mut [u8])) -> HugeBytes {
        let (chunk, off) = reserve(len);
        // SAFETY: `off..off + len` lies inside the chunk and no other `HugeBytes` covers it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(chunk.base.add(off), len) };
        fill(bytes);
        HugeBytes { chunk, off, len }
    }

    /// A copy of `src`.
    pub fn copy_of(src: &[u8]) -> HugeBytes {
        HugeBytes::with(src.len(), |b| b.copy_from_slice(src))
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range was reserved for this value and is no longer written.
        unsafe { std::slice::from_raw_parts(self.chunk.base.add(self.off), self.len) }
    }
}

impl AsRef<[u8]> for HugeBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// A chunk and offset for `len` bytes: from the shared chunk when they fit in it, else from
/// a new chunk (which becomes the shared one when it is of the shared size).
fn reserve(len: usize) -> (Arc<Chunk>, usize) {
    let len = len.max(1);
    if len > CHUNK / 4 {
        return (Arc::new(Chunk::new(len.next_multiple_of(HUGE_PAGE))), 0);
    }
    let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((chunk, used)) = cur.as_mut() {
        let off = used.next_multiple_of(ALIGN);
        if off + len <= chunk.len {
            *used = off + len;
            return (chunk.clone(), off);
        }
    }
    let chunk = Arc::new(Chunk::new(CHUNK));
    *cur = Some((chunk.clone(), len));
    (chunk, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_aligned_disjoint_and_keep_their_bytes() {
        let small: Vec<HugeBytes> = (0..40u8)
            .map(|i| HugeBytes::with(100 + i as usize, |b| b.fill(i)))
            .collect();
        let big = HugeBytes::copy_of(&vec![7u8; CHUNK / 2]);
        for (i, s) in small.iter().enumerate() {
            assert_eq!(s.as_slice().as_ptr() as usize % ALIGN, 0);
            assert_eq!(s.as_slice().len(), 100 + i);
            assert!(s.as_slice().iter().all(|&b| b == i as u8));
        }
        assert!(big.as_slice().iter().all(|&b| b == 7));
        assert_eq!(HugeBytes::with(0, |_| {}).as_slice().len(), 0);
    }
}
