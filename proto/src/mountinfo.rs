//! The kernel's `/proc/PID/mountinfo` text: what both the supervisor (which disk is
//! mounted where, before a delete) and ublkd-csi (its volumes' mounts) read from it.

/// A mountinfo field with its octal escapes undone: the kernel writes a space, tab,
/// newline and backslash in a path as `\040`, `\011`, `\012` and `\134`. A backslash
/// not followed by three octal digits is kept as it is.
pub fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                // At most \377 from the kernel; anything larger is cut to a byte, not a panic.
                let v = d.iter().fold(0u32, |v, b| v * 8 + u32::from(b - b'0'));
                out.push(v as u8);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn octal_escapes_are_undone_and_lone_backslashes_kept() {
        assert_eq!(unescape("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape("a\\011b\\134c"), "a\tb\\c");
        assert_eq!(unescape("a\\9"), "a\\9");
        assert_eq!(unescape("a\\777"), "a\u{fffd}");
    }
}
