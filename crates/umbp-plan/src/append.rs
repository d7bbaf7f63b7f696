//! Appending to a `Vec` through its spare capacity: what the builder's range loop writes its
//! segments with.
//!
//! `Vec::push` checks the capacity and may call the allocator, so a loop that pushes keeps the
//! vector's pointer and length in memory rather than registers. Filling blank slots first and
//! writing them in place avoids that, but the fill itself cost 6 to 11 instructions per slot
//! (callgrind, the Kimi-K3 restore plan at 64 KiB pages: a `memset` from a static block, or
//! `resize`), a third of what the rest of a page costs. [`append`] reserves once and hands the
//! loop [`Slots`], which write the spare capacity in order (a pointer comparison per write, no
//! call), and commits exactly the slots written.

#![allow(unsafe_code)] // One block: committing the slots written.

use std::mem::MaybeUninit;

/// The spare capacity of a vector, written front to back by [`push`](Self::push).
///
/// Nothing here panics: a push past the room is recorded, and [`append`] panics after the
/// writer returns. A loop with no panicking call in it can keep its state in registers; one
/// with a panicking bounds check must store it before every write.
pub(crate) struct Slots<'a, T> {
    /// The slots not written yet, in order.
    free: std::slice::IterMut<'a, MaybeUninit<T>>,
    /// The value in the last slot written.
    last: Option<&'a mut T>,
    /// All the slots, written or not.
    room: usize,
    /// A push found no slot left.
    overflowed: bool,
}

impl<T> Slots<'_, T> {
    /// Writes the next slot; past the room [`append`] reserved, records the overflow instead
    /// (and `append` panics).
    #[inline(always)]
    pub(crate) fn push(&mut self, value: T) {
        match self.free.next() {
            Some(slot) => self.last = Some(slot.write(value)),
            None => self.overflowed = true,
        }
    }

    /// The last value written, if any.
    #[inline(always)]
    pub(crate) fn last_mut(&mut self) -> Option<&mut T> {
        self.last.as_deref_mut()
    }

    /// How many slots were written.
    fn written(&self) -> usize {
        self.room - self.free.len()
    }
}

/// Reserves room for `room` more values, lets `write` fill slots through [`Slots`] (which it
/// hands back), and appends what it wrote, in order. If `write` panics, or pushes more values
/// than the spare capacity holds (at least `room`), the vector keeps its old length (and
/// `append` panics).
///
/// The slots go to `write` by value, so that a loop holding them can keep them in registers.
#[inline(always)]
pub(crate) fn append<T>(
    vec: &mut Vec<T>,
    room: usize,
    write: impl for<'s> FnOnce(Slots<'s, T>) -> Slots<'s, T>,
) {
    vec.reserve(room);
    let spare = vec.spare_capacity_mut();
    let room = spare.len();
    let slots = write(Slots { free: spare.iter_mut(), last: None, room, overflowed: false });
    assert!(!slots.overflowed, "append: more values than the room reserved");
    let written = slots.written();
    // SAFETY: `Slots::push` writes the spare capacity front to back, one slot per value, and
    // `written` counts the slots it took; so the first `len + written` elements, all within
    // the capacity, are initialized.
    unsafe { vec.set_len(vec.len() + written) };
}

#[cfg(test)]
mod tests {
    use super::append;

    #[test]
    fn appends_exactly_what_was_written() {
        let mut v = vec![1u64, 2];
        append(&mut v, 4, |mut slots| {
            assert_eq!(slots.last_mut(), None);
            slots.push(3);
            slots.push(4);
            *slots.last_mut().unwrap() += 10;
            slots.push(5);
            assert_eq!(slots.last_mut().copied(), Some(5));
            slots
        });
        assert_eq!(v, [1, 2, 3, 14, 5]);
        append(&mut v, 3, |slots| slots);
        assert_eq!(v, [1, 2, 3, 14, 5]);
    }

    #[test]
    fn a_panicking_writer_leaves_the_vector_as_it_was() {
        let mut v = vec![String::from("kept")];
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            append(&mut v, 1, |mut slots| {
                slots.push(String::from("leaked, never dropped twice"));
                panic!("writer fails");
            })
        }));
        assert!(caught.is_err());
        assert_eq!(v, ["kept"]);
        // The value written before the panic sits past the length, intact and never dropped:
        // dropping it here is its only drop (Miri, which reports leaks, would catch a second).
        let leaked = &mut v.spare_capacity_mut()[0];
        // SAFETY: `Slots::push` wrote the first spare slot before the writer panicked, and
        // `append` kept the old length, so the slot holds an initialized `String` nothing else
        // owns or drops.
        unsafe {
            assert_eq!(leaked.assume_init_ref(), "leaked, never dropped twice");
            leaked.assume_init_drop();
        }
    }

    #[test]
    fn writing_past_the_reserved_room_panics_instead_of_overflowing() {
        let mut v: Vec<u8> = Vec::new();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            append(&mut v, 2, |mut slots| {
                for b in 0..=u8::MAX {
                    slots.push(b);
                }
                slots
            })
        }));
        assert!(caught.is_err());
        assert!(v.is_empty());
    }
}
