//! The VM's allocator. A decision allocates and frees a few dozen small
//! blocks (keys, sets, reports, header values); dlmalloc spent about a
//! quarter of a c1 decision's wasm instructions on them (BENCHMARKS.md,
//! instructions per decision), so blocks of up to [`MAX`] bytes are recycled
//! through per-size free lists in front of the system's (wasi-libc's dlmalloc).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;

/// Size step of the classes; also the alignment every class block has.
const STEP: usize = 16;
/// Classes: 16, 32, …, 2048 bytes. Up to 2 KiB: a request's reports
/// outgrow 256 bytes at a few limits (c4's eight take 896 bytes); served
/// by dlmalloc, blocks of that size cost c4 1,094 more instructions and
/// a 429 with its problem body 239 more (measured when the charge also
/// kept a list of pending writes).
const CLASSES: usize = 128;
/// Largest block served from the free lists.
pub const MAX: usize = STEP * CLASSES;

/// Free lists (a freed block holds the next one's address) over [`System`].
/// A block of a class is always allocated from the system at the class's
/// full size and never handed back, so any block of a class fits any
/// request of it; the lists hold at most the VM's peak of small blocks.
pub struct Recycling {
    heads: UnsafeCell<[*mut u8; CLASSES]>,
}

// SAFETY: a proxy-wasm VM runs one thread (wasm32 without threads), and this
// type exists only in that build (the host layer is wasm32 only).
unsafe impl Sync for Recycling {}

impl Recycling {
    /// Empty lists.
    pub const fn new() -> Recycling {
        Recycling {
            heads: UnsafeCell::new([std::ptr::null_mut(); CLASSES]),
        }
    }
}

/// The class of `layout`, when the free lists serve it.
fn class(layout: &Layout) -> Option<usize> {
    let size = layout.size();
    (size > 0 && size <= MAX && layout.align() <= STEP).then(|| (size - 1) / STEP)
}

unsafe impl GlobalAlloc for Recycling {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class(&layout) else {
            return System.alloc(layout);
        };
        let heads = &mut *self.heads.get();
        let Some(head) = heads.get_mut(c) else {
            return System.alloc(layout);
        };
        if head.is_null() {
            return System.alloc(Layout::from_size_align_unchecked((c + 1) * STEP, STEP));
        }
        let block = *head;
        *head = *(block as *mut *mut u8);
        block
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(c) = class(&layout) else {
            return System.dealloc(ptr, layout);
        };
        let heads = &mut *self.heads.get();
        if let Some(head) = heads.get_mut(c) {
            *(ptr as *mut *mut u8) = *head;
            *head = ptr;
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = Layout::from_size_align_unchecked(new_size, layout.align());
        match (class(&layout), class(&new)) {
            // Both large: the system may grow it in place.
            (None, None) => System.realloc(ptr, layout, new_size),
            // Same class: the block already has room.
            (Some(a), Some(b)) if a == b => ptr,
            _ => {
                let to = self.alloc(new);
                if !to.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, to, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                to
            }
        }
    }
}

/// The VM's allocator.
#[global_allocator]
static ALLOCATOR: Recycling = Recycling::new();
