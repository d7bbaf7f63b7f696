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
/// Holding a `PageWalk` guarantees: the page size is non-zero, the list is non-empty and it
/// holds exactly `ceil(size / page_size)` pages. Whether a page's tier offset plus its stored
/// length fits in 64 bits is checked by each walk, for the pages that walk touches, before it
/// emits anything.
#[derive(Copy, Clone, Debug)]
pub struct PageWalk<'a> {
    pages: &'a [u64],
    page_size: u64,
    size: u64,
    /// `log2(page_size)` for a power of two (as page sizes are in practice), so that locating
    /// a byte is a shift and a mask; `u32::MAX` otherwise.
    shift: u32,
}

/// A range of an object that passed the walk's range rules: the pages it touches (`first ..=
/// last`) and where it starts inside the first one.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Span {
    first: usize,
    last: usize,
    in_page: u64,
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
        let shift = if page_size.is_power_of_two() { page_size.trailing_zeros() } else { u32::MAX };
        Ok(Self { pages, page_size, size, shift })
    }

    /// The stored object size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The page size.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The page holding object byte `offset`, and the offset inside that page.
    #[inline]
    fn locate(&self, offset: u64) -> (usize, u64) {
        if self.shift != u32::MAX {
            ((offset >> self.shift) as usize, offset & (self.page_size - 1))
        } else {
            ((offset / self.page_size) as usize, offset % self.page_size)
        }
    }

    /// Applies the range rules: non-empty, starting before the end, ending at or before it,
    /// destination offsets that fit in 64 bits.
    #[inline]
    pub(crate) fn span(&self, offset: u64, len: u64, dst_offset: u64) -> Result<Span, WalkError> {
        if len == 0 {
            return Err(WalkError::ZeroLength);
        }
        if offset >= self.size {
            return Err(WalkError::OffsetPastEnd { offset, size: self.size });
        }
        let end = match offset.checked_add(len) {
            Some(end) if end <= self.size => end,
            _ => return Err(WalkError::RangePastEnd { offset, len, size: self.size }),
        };
        if dst_offset.checked_add(len).is_none() {
            return Err(WalkError::Overflow);
        }
        // `offset < end <= size` and the page count matches the size: both index the list.
        let (first, in_page) = self.locate(offset);
        let (last, _) = self.locate(end - 1);
        Ok(Span { first, last, in_page })
    }

    /// Whether every page of the span starts at or below `limit`, which must be below 2^63.
    ///
    /// One branch-free pass that vectorizes with plain SSE2 (which has no unsigned 64-bit
    /// compare): for `limit < 2^63`, bit 63 of `p | (limit - p)` (wrapping) is set exactly when
    /// `p > limit`. A `p` at or below `limit` has the bit clear and so has `limit - p`, which
    /// lies in `0 .. 2^63`; a larger `p` either has it set itself or is below 2^63, and then
    /// `limit - p` wraps to at least `2^64 - 2^63 + 1`.
    #[inline]
    pub(crate) fn pages_at_most(&self, span: &Span, limit: u64) -> bool {
        debug_assert!(limit < 1 << 63);
        let bits = self.pages[span.first..=span.last]
            .iter()
            .fold(0, |bits, &p| bits | p | limit.wrapping_sub(p));
        bits >> 63 == 0
    }

    /// Whether a page of the span ends past `u64::MAX`: [`pages_at_most`](Self::pages_at_most)
    /// clears nearly every span in one pass, and the exact rule decides the rest.
    #[inline]
    pub(crate) fn overflows(&self, span: &Span) -> bool {
        let safe = (u64::MAX - self.page_size).min(i64::MAX as u64);
        !self.pages_at_most(span, safe) && self.overflows_exactly(span)
    }

    /// The exact overflow rule for the span's pages: each page's stored length (the last page
    /// of the object possibly short) added to its tier offset.
    #[cold]
    fn overflows_exactly(&self, span: &Span) -> bool {
        let last_len = self.size - (self.pages.len() as u64 - 1) * self.page_size;
        (span.first..=span.last).any(|i| {
            let len = if i + 1 == self.pages.len() { last_len } else { self.page_size };
            self.pages[i].checked_add(len).is_none()
        })
    }

    /// The span's fragments, in order; the caller has checked the span and its pages.
    #[inline]
    pub(crate) fn fragments(&self, span: &Span, len: u64, dst_offset: u64) -> SpanPages<'_> {
        SpanPages {
            pages: self.pages[span.first..=span.last].iter(),
            page_size: self.page_size,
            in_page: span.in_page,
            remaining: len,
            dst: dst_offset,
        }
    }

    /// The tier offsets of the span's pages after its first, and the length of the span's
    /// fragment in its last page (every page between is whole).
    #[inline]
    pub(crate) fn later_pages(&self, span: &Span, len: u64) -> (&[u64], u64) {
        let later = &self.pages[span.first + 1..=span.last];
        let first_len = (self.page_size - span.in_page).min(len);
        let middle = (later.len() as u64).saturating_sub(1) * self.page_size;
        (later, len - first_len - middle)
    }

    /// Emits the span's fragments; the caller has checked the span and its pages.
    #[inline]
    pub(crate) fn emit<E>(
        &self,
        span: &Span,
        len: u64,
        dst_offset: u64,
        emit: impl FnMut(PageFragment) -> Result<(), E>,
    ) -> Result<(), E> {
        self.fragments(span, len, dst_offset).try_for_each(emit)
    }

    /// Emits the page fragments of object bytes `offset .. offset + len`, destined for
    /// `dst_offset ..` in the caller's buffer, in object order. Refuses (emitting nothing) a
    /// zero length, an offset at or past the end, a range past the end, destination offsets
    /// that overflow, and a touched page whose tier offset plus stored length overflows. An
    /// error returned by `emit` stops the walk and is returned as is.
    #[inline]
    pub fn walk<E: From<WalkError>>(
        &self,
        offset: u64,
        len: u64,
        dst_offset: u64,
        emit: impl FnMut(PageFragment) -> Result<(), E>,
    ) -> Result<(), E> {
        let span = self.span(offset, len, dst_offset)?;
        if self.overflows(&span) {
            return Err(WalkError::Overflow.into());
        }
        self.emit(&span, len, dst_offset, emit)
    }
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

/// The page fragments of one checked span ([`PageWalk::fragments`]).
pub(crate) struct SpanPages<'a> {
    pages: std::slice::Iter<'a, u64>,
    page_size: u64,
    /// Offset of the next fragment in its page: the span's offset in its first page, then 0.
    in_page: u64,
    remaining: u64,
    dst: u64,
}

impl Iterator for SpanPages<'_> {
    type Item = PageFragment;

    #[inline]
    fn next(&mut self) -> Option<PageFragment> {
        let &page = self.pages.next()?;
        // The range ends inside the last page's stored bytes: a short last page clamps itself,
        // and `page + in_page + n` fits (the span's pages passed the overflow rule).
        let n = (self.page_size - self.in_page).min(self.remaining);
        let fragment =
            PageFragment { tier_offset: page + self.in_page, dst_offset: self.dst, len: n };
        self.dst += n;
        self.remaining -= n;
        self.in_page = 0;
        Some(fragment)
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.pages.size_hint()
    }
}

impl ExactSizeIterator for SpanPages<'_> {}
