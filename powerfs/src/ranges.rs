//! Dirty byte ranges of one file since its last sync.
//!
//! Owns the set arithmetic only: merging written ranges and clipping them to a length. It must
//! never touch a file; the store copies the ranges this set names.

use std::collections::BTreeMap;

/// A set of half-open byte ranges `[start, end)`, kept merged: no two stored ranges touch or
/// overlap, so the set stays as small as the number of separate regions written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    /// start -> end, disjoint and non-adjacent.
    ranges: BTreeMap<u64, u64>,
}

impl RangeSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `[start, end)`; an empty range is ignored.
    pub fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let mut new_start = start;
        let mut new_end = end;
        // The range starting at or before `start` may reach into the new one.
        if let Some((&s, &e)) = self.ranges.range(..=start).next_back() {
            if e >= start {
                new_start = s;
                new_end = new_end.max(e);
                self.ranges.remove(&s);
            }
        }
        // Every range starting inside (or right at the end of) the new one is swallowed.
        let swallowed: Vec<(u64, u64)> = self.ranges.range(new_start..=new_end).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in swallowed {
            new_end = new_end.max(e);
            self.ranges.remove(&s);
        }
        self.ranges.insert(new_start, new_end);
    }

    /// The ranges in ascending order, each clipped to `len` (ranges wholly past `len` vanish).
    pub fn clipped(&self, len: u64) -> Vec<(u64, u64)> {
        self.ranges.iter().filter(|(&s, _)| s < len).map(|(&s, &e)| (s, e.min(len))).collect()
    }

    /// Whether nothing is recorded.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Total bytes covered.
    #[cfg(test)]
    pub fn covered(&self) -> u64 {
        self.ranges.iter().map(|(s, e)| e - s).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::RangeSet;

    fn set(ranges: &[(u64, u64)]) -> RangeSet {
        let mut s = RangeSet::new();
        for &(a, b) in ranges {
            s.insert(a, b);
        }
        s
    }

    #[test]
    fn disjoint_ranges_stay_apart() {
        assert_eq!(set(&[(10, 20), (0, 5)]).clipped(u64::MAX), vec![(0, 5), (10, 20)]);
    }

    #[test]
    fn overlapping_and_adjacent_ranges_merge() {
        assert_eq!(set(&[(0, 5), (5, 10)]).clipped(u64::MAX), vec![(0, 10)]);
        assert_eq!(set(&[(3, 8), (0, 4)]).clipped(u64::MAX), vec![(0, 8)]);
        assert_eq!(set(&[(0, 2), (4, 6), (8, 10), (1, 9)]).clipped(u64::MAX), vec![(0, 10)]);
        assert_eq!(set(&[(0, 100), (10, 20)]).clipped(u64::MAX), vec![(0, 100)]);
    }

    #[test]
    fn empty_range_is_ignored() {
        assert!(set(&[(5, 5), (7, 3)]).is_empty());
    }

    #[test]
    fn clipping_drops_and_shortens() {
        let s = set(&[(0, 10), (20, 30), (40, 50)]);
        assert_eq!(s.clipped(25), vec![(0, 10), (20, 25)]);
        assert_eq!(s.covered(), 30);
    }
}
