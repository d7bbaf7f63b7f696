//! Table tests for every rule of the page walk and of range lists.

use umbp_plan::{check_ranges, PageFragment, PageWalk, WalkError};

const PS: u64 = 4096;

/// Walks and collects, so each case can assert what was emitted.
fn walk(
    pages: &[u64],
    page_size: u64,
    size: u64,
    offset: u64,
    len: u64,
) -> (Result<(), WalkError>, Vec<PageFragment>) {
    let mut out = Vec::new();
    let result = PageWalk::new(pages, page_size, size).and_then(|w| {
        w.walk(offset, len, 1000, |f| {
            out.push(f);
            Ok::<(), WalkError>(())
        })
    });
    (result, out)
}

fn frag(tier_offset: u64, dst_offset: u64, len: u64) -> PageFragment {
    PageFragment { tier_offset, dst_offset, len }
}

#[test]
fn a_range_splits_at_page_boundaries_into_scattered_pages() {
    // Pages 0, 1, 2 of the object sit at tier offsets 40960, 8192, 65536.
    let pages = [40960, 8192, 65536];
    let (r, out) = walk(&pages, PS, 3 * PS, 100, 2 * PS);
    assert_eq!(r, Ok(()));
    // 100 .. 4096 of page 0, all of page 1, 0 .. 100 of page 2; destinations follow on.
    assert_eq!(
        out,
        vec![
            frag(40960 + 100, 1000, 3996),
            frag(8192, 1000 + 3996, 4096),
            frag(65536, 1000 + 8092, 100)
        ]
    );
}

#[test]
fn the_short_last_page_is_clamped() {
    // 2.5 pages: the last page holds 2048 bytes.
    let pages = [0, 8192, 16384];
    let (r, out) = walk(&pages, PS, 2 * PS + 2048, 4096, PS + 2048);
    assert_eq!(r, Ok(()));
    assert_eq!(out, vec![frag(8192, 1000, 4096), frag(16384, 5096, 2048)]);
}

#[test]
fn a_range_inside_one_page_is_one_fragment() {
    let (r, out) = walk(&[12288], PS, PS, 10, 20);
    assert_eq!(r, Ok(()));
    assert_eq!(out, vec![frag(12298, 1000, 20)]);
}

#[test]
fn refusals_emit_nothing() {
    let pages = [0, 4096, 8192];
    let size = 3 * PS;
    // (name, pages, page size, object size, range offset, range length, expected error)
    type Case<'a> = (&'a str, &'a [u64], u64, u64, u64, u64, WalkError);
    let cases: Vec<Case> = vec![
        ("zero length", &pages, PS, size, 0, 0, WalkError::ZeroLength),
        (
            "offset past the end",
            &pages,
            PS,
            size,
            size + 5,
            1,
            WalkError::OffsetPastEnd { offset: size + 5, size },
        ),
        (
            "offset at the end",
            &pages,
            PS,
            size,
            size,
            1,
            WalkError::OffsetPastEnd { offset: size, size },
        ),
        (
            "range one byte past the end",
            &pages,
            PS,
            size,
            0,
            size + 1,
            WalkError::RangePastEnd { offset: 0, len: size + 1, size },
        ),
        (
            "range past the end from inside",
            &pages,
            PS,
            size,
            size - 10,
            11,
            WalkError::RangePastEnd { offset: size - 10, len: 11, size },
        ),
        (
            "range length overflows",
            &pages,
            PS,
            size,
            10,
            u64::MAX,
            WalkError::RangePastEnd { offset: 10, len: u64::MAX, size },
        ),
        (
            "too few pages",
            &pages[..2],
            PS,
            size,
            0,
            1,
            WalkError::PageCountMismatch { pages: 2, expected: 3 },
        ),
        (
            "one page too many",
            &pages,
            PS,
            2 * PS,
            0,
            1,
            WalkError::PageCountMismatch { pages: 3, expected: 2 },
        ),
        (
            "one page too many for a short last page",
            &pages,
            PS,
            2 * PS - 100,
            0,
            1,
            WalkError::PageCountMismatch { pages: 3, expected: 2 },
        ),
        ("empty page list", &[], PS, 0, 0, 1, WalkError::EmptyPageList),
        ("zero page size", &pages, 0, size, 0, 1, WalkError::ZeroPageSize),
        (
            "page offset overflows",
            &[0, u64::MAX - 100, 8192],
            PS,
            size,
            0,
            size,
            WalkError::Overflow,
        ),
    ];
    for (name, pages, page_size, size, offset, len, expected) in cases {
        let (r, out) = walk(pages, page_size, size, offset, len);
        assert_eq!(r, Err(expected), "{name}");
        assert!(out.is_empty(), "{name}: emitted {out:?}");
    }
}

#[test]
fn a_destination_offset_that_overflows_is_refused_before_emitting() {
    let pages = [0, 4096];
    let walk = PageWalk::new(&pages, PS, 2 * PS).unwrap();
    let mut emitted = 0;
    let r = walk.walk(0, 2 * PS, u64::MAX - 10, |_| {
        emitted += 1;
        Ok::<(), WalkError>(())
    });
    assert_eq!(r, Err(WalkError::Overflow));
    assert_eq!(emitted, 0);
}

#[test]
fn a_refusal_from_the_callback_stops_the_walk() {
    #[derive(Debug, PartialEq)]
    enum Stop {
        Refused,
        Walk(WalkError),
    }
    impl From<WalkError> for Stop {
        fn from(e: WalkError) -> Self {
            Stop::Walk(e)
        }
    }
    let pages = [0, 4096, 8192, 12288];
    let walk = PageWalk::new(&pages, PS, 4 * PS).unwrap();
    let mut seen = Vec::new();
    let r = walk.walk(0, 4 * PS, 0, |f| {
        seen.push(f.tier_offset);
        if seen.len() == 2 {
            Err(Stop::Refused)
        } else {
            Ok(())
        }
    });
    assert_eq!(r, Err(Stop::Refused));
    assert_eq!(seen, vec![0, 4096], "nothing is emitted after the refusal");
}

#[test]
fn range_lists_must_be_sorted_disjoint_and_inside() {
    let size = 100;
    assert_eq!(check_ranges([(0, 10), (10, 20), (50, 50)], size), Ok(()));
    assert_eq!(check_ranges([], size), Ok(()));
    assert_eq!(check_ranges([(0, 10), (5, 10)], size), Err(WalkError::RangesOverlap { index: 1 }));
    assert_eq!(check_ranges([(20, 10), (0, 10)], size), Err(WalkError::RangesOverlap { index: 1 }));
    assert_eq!(check_ranges([(0, 0)], size), Err(WalkError::ZeroLength));
    assert_eq!(
        check_ranges([(90, 11)], size),
        Err(WalkError::RangePastEnd { offset: 90, len: 11, size })
    );
    assert_eq!(check_ranges([(100, 1)], size), Err(WalkError::OffsetPastEnd { offset: 100, size }));
    assert_eq!(
        check_ranges([(1, u64::MAX)], size),
        Err(WalkError::RangePastEnd { offset: 1, len: u64::MAX, size })
    );
}
