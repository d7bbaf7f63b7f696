//! The page walk: split a byte range of a paged object into page fragments.
//!
//! A pool stores each object as fixed-size pages scattered over a tier (a DRAM arena, an SSD
//! file). [`PageWalk`] holds one object's page list and checks it once; [`PageWalk::walk`] then
//! turns a range of the object into one [`PageFragment`] per page touched, each with the page's
//! offset in the tier and the offset inside the caller's destination. Everything is checked
//! before the first fragment is emitted, so a refused walk emits nothing.

use crate::WalkError;

/// One page's share of a range.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PageFragment {
    /// Offset of the first byte in the tier (page offset plus the offset inside the page).
    pub tier_offset: u64,
    /// Offset of the first byte in the caller's destination.
    pub dst_offset: u64,
    /// Number of bytes.
    pub len: u64,
}

/// One object's page list, checked against its stored size.
///
/// Holding a `PageWalk` guarantees: the page size is non-zero, the list is non-empty, it holds
/// exactly `ceil(size / page_size)` pages, and every page's tier offset plus its stored length
/// fits in 64 bits. A walk therefore does no per-page overflow checks.
#[derive(Copy, Clone, Debug)]
pub struct PageWalk<'a> {
    pages: &'a [u64],
    page_size: u64,
    size: u64,
}

impl<'a> PageWalk<'a> {
    /// Checks that `pages` (tier offsets of the object's pages, in object order) hold an object
    /// of `size` bytes in pages of `page_size` bytes. The last page may be short.
    pub fn new(pages: &'a [u64], page_size: u64, size: u64) -> Result<Self, WalkError> {
        if page_size == 0 {
            return Err(WalkError::ZeroPageSize);
        }
        if pages.is_empty() {
            return Err(WalkError::EmptyPageList);
        }
        let expected = size.div_ceil(page_size);
        if pages.len() as u64 != expected {
            return Err(WalkError::PageCountMismatch { pages: pages.len(), expected });
        }
        let last_len = size - (expected - 1) * page_size;
        let (last, full) = pages.split_last().ok_or(WalkError::EmptyPageList)?;
        if *last > u64::MAX - last_len || !all_at_most(full, u64::MAX - page_size) {
            return Err(WalkError::Overflow);
        }
        Ok(Self { pages, page_size, size })
    }

    /// The stored object size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The page size.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The page holding object byte `offset`, and the offset inside that page. Page sizes are
    /// powers of two in practice: a shift and a mask instead of a division.
    #[inline]
    fn locate(&self, offset: u64) -> (usize, u64) {
        if self.page_size.is_power_of_two() {
            let shift = self.page_size.trailing_zeros();
            ((offset >> shift) as usize, offset & (self.page_size - 1))
        } else {
            ((offset / self.page_size) as usize, offset % self.page_size)
        }
    }

    /// Whether every page that object bytes `offset .. offset + len` touch lies wholly (a full
    /// page size, even for a short last page) below tier offset `tier_len`. `false` for a range
    /// the walk would refuse.
    pub fn pages_within(&self, offset: u64, len: u64, tier_len: u64) -> bool {
        let Some(limit) = tier_len.checked_sub(self.page_size) else {
            return false;
        };
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= self.size => {
                let (first, _) = self.locate(offset);
                let (last, _) = self.locate(end - 1);
                all_at_most(&self.pages[first..=last], limit)
            }
            _ => false,
        }
    }

    /// Emits the page fragments of object bytes `offset .. offset + len`, destined for
    /// `dst_offset ..` in the caller's buffer, in object order. Refuses (emitting nothing) a
    /// zero length, an offset at or past the end, a range past the end, and destination offsets
    /// that overflow. An error returned by `emit` stops the walk and is returned as is.
    #[inline]
    pub fn walk<E: From<WalkError>>(
        &self,
        offset: u64,
        len: u64,
        dst_offset: u64,
        mut emit: impl FnMut(PageFragment) -> Result<(), E>,
    ) -> Result<(), E> {
        if len == 0 {
            return Err(WalkError::ZeroLength.into());
        }
        if offset >= self.size {
            return Err(WalkError::OffsetPastEnd { offset, size: self.size }.into());
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size => {}
            _ => return Err(WalkError::RangePastEnd { offset, len, size: self.size }.into()),
        }
        if dst_offset.checked_add(len).is_none() {
            return Err(WalkError::Overflow.into());
        }
        // `offset < size` and the page count matches the size, so `first` indexes the list and
        // the range ends inside the last page's stored bytes: the short last page clamps itself.
        let (first, mut in_page) = self.locate(offset);
        let mut remaining = len;
        let mut dst = dst_offset;
        for &page in &self.pages[first..] {
            let n = (self.page_size - in_page).min(remaining);
            // `new` checked that `page + stored length` fits, and `in_page + n` stays inside.
            emit(PageFragment { tier_offset: page + in_page, dst_offset: dst, len: n })?;
            dst += n;
            remaining -= n;
            if remaining == 0 {
                break;
            }
            in_page = 0;
        }
        debug_assert_eq!(remaining, 0, "a checked range ends inside the page list");
        Ok(())
    }
}

/// Whether every value is at most `limit`: a branch-free pass (random page offsets would make
/// a branch per page mispredict half the time).
fn all_at_most(values: &[u64], limit: u64) -> bool {
    !values.iter().fold(false, |above, &v| above | (v > limit))
}

/// Checks an object's read ranges, given as `(offset, len)`: each non-empty, inside an object of
/// `size` bytes, sorted by offset and disjoint.
pub fn check_ranges(
    ranges: impl IntoIterator<Item = (u64, u64)>,
    size: u64,
) -> Result<(), WalkError> {
    let mut previous_end = 0;
    for (index, (offset, len)) in ranges.into_iter().enumerate() {
        if len == 0 {
            return Err(WalkError::ZeroLength);
        }
        if offset >= size {
            return Err(WalkError::OffsetPastEnd { offset, size });
        }
        let end = match offset.checked_add(len) {
            Some(end) if end <= size => end,
            _ => return Err(WalkError::RangePastEnd { offset, len, size }),
        };
        if index > 0 && offset < previous_end {
            return Err(WalkError::RangesOverlap { index });
        }
        previous_end = end;
    }
    Ok(())
}
