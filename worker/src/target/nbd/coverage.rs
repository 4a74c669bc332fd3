//! Which bytes of a READ an NBD structured reply has covered, so that a READ whose
//! chunks overlap, repeat or leave a gap fails rather than return stale bytes.

/// The most separate parts of a READ a structured reply may have covered at once
/// (chunks that touch merge into one part, so a server sending them in order, or in
/// reverse, keeps one).
const MAX_COVERED_PARTS: usize = 16;

/// Which bytes of a READ a structured reply has covered: disjoint parts, merged where
/// they touch. A byte covered twice (overlapping or repeated chunks, which the
/// protocol forbids) cannot be trusted to hold either chunk's data, and a sum of
/// lengths would count it twice and call a READ with a gap whole.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Coverage {
    /// `[start, end)` within the READ, sorted, `parts[..n]`.
    parts: [(u32, u32); MAX_COVERED_PARTS],
    n: usize,
    /// A chunk overlapped another, or came too scattered to follow.
    broken: bool,
}

impl Coverage {
    /// Covers `start..start + len` (inside the READ); a part already covered breaks it.
    pub(super) fn add(&mut self, start: u32, len: u32) {
        if len == 0 || self.broken {
            return;
        }
        let end = start + len;
        let parts = &self.parts[..self.n];
        if parts.iter().any(|&(s, e)| start < e && s < end) {
            self.broken = true;
            return;
        }
        // Where it goes, and whether it touches its neighbours.
        let at = parts.partition_point(|&(s, _)| s < start);
        let joins_before = at > 0 && parts[at - 1].1 == start;
        let joins_after = at < self.n && parts[at].0 == end;
        match (joins_before, joins_after) {
            (true, true) => {
                self.parts[at - 1].1 = self.parts[at].1;
                self.parts.copy_within(at + 1..self.n, at);
                self.n -= 1;
            }
            (true, false) => self.parts[at - 1].1 = end,
            (false, true) => self.parts[at].0 = start,
            (false, false) if self.n == MAX_COVERED_PARTS => self.broken = true,
            (false, false) => {
                self.parts.copy_within(at..self.n, at + 1);
                self.parts[at] = (start, end);
                self.n += 1;
            }
        }
    }

    /// Every byte of a READ of `len` covered exactly once.
    pub(super) fn whole(&self, len: u32) -> bool {
        !self.broken && (len == 0 || (self.n == 1 && self.parts[0] == (0, len)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coverage_merges_touching_parts_in_any_order_and_breaks_on_overlap() {
        let cover = |parts: &[(u32, u32)]| {
            let mut c = Coverage::default();
            parts.iter().for_each(|&(start, len)| c.add(start, len));
            c
        };
        assert!(cover(&[(0, 4096)]).whole(4096));
        assert!(cover(&[(0, 1024), (1024, 3072)]).whole(4096), "in order");
        assert!(cover(&[(3072, 1024), (0, 1024), (2048, 1024), (1024, 1024)]).whole(4096));
        assert!(!cover(&[(0, 1024), (2048, 2048)]).whole(4096), "a gap");
        assert!(!cover(&[(0, 2048), (1024, 2048), (3072, 1024)]).whole(4096), "an overlap");
        assert!(!cover(&[(0, 2048), (0, 2048), (2048, 2048)]).whole(4096), "a repeat");
        assert!(!cover(&[(0, 4096), (4095, 1)]).whole(4096), "one byte twice");
        assert!(cover(&[]).whole(0) && !cover(&[]).whole(512));
        // Every other 512-byte piece first (more separate parts than followed), then
        // the rest: refused rather than guessed at.
        let scattered: Vec<(u32, u32)> = (0..40).map(|i| (i * 1024, 512)).collect();
        let mut c = cover(&scattered);
        (0..40).for_each(|i| c.add(i * 1024 + 512, 512));
        assert!(!c.whole(40 * 1024));
        // As many as are followed, then filled: whole.
        let mut c = cover(&(0..16).map(|i| (i * 1024, 512)).collect::<Vec<_>>());
        (0..16).for_each(|i| c.add(i * 1024 + 512, 512));
        assert!(c.whole(16 * 1024), "{c:?}");
    }
}
