//! Byte sizes as people write them: `4096`, `512K`, `4G`, `1 TiB`.
//!
//! Shared by the config file (`size = "1G"`) and ublkctl (`-s 4G`) so both accept
//! the same spellings. Suffixes are binary (1K = 1024) and case-insensitive; an
//! optional `iB` after the letter is accepted (`4GiB`). Only whole numbers: `1.5G`
//! is refused rather than rounded.

/// Longest excerpt of the input an error message repeats, in characters.
const EXCERPT_CHARS: usize = 40;

/// Why a string is not a byte size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// The string is empty or only whitespace.
    #[error(
        "the size is empty; expected a whole number of bytes such as 4096, or one with a \
         K, M, G or T suffix such as 4G (1K = 1024)"
    )]
    Empty,
    /// The string does not start with a whole decimal number.
    #[error(
        "{input:?} is not a size; expected a whole number of bytes such as 4096, or one \
         with a K, M, G or T suffix such as 4G (1K = 1024)"
    )]
    NotANumber {
        /// The offending input (shortened if long).
        input: String,
    },
    /// The number is followed by letters that are not a known suffix.
    #[error(
        "{input:?} has an unknown suffix {suffix:?}; expected K, M, G or T, which are \
         binary (1K = 1024), optionally followed by iB"
    )]
    UnknownSuffix {
        /// The offending input (shortened if long).
        input: String,
        /// The suffix as written.
        suffix: String,
    },
    /// The size does not fit in 64 bits.
    #[error("{input:?} is too large; a size must be below 16777216T (2^64 bytes)")]
    Overflow {
        /// The offending input (shortened if long).
        input: String,
    },
}

/// Parses a byte size: a whole decimal number with an optional binary suffix.
///
/// Accepted: `4096`, `4K`, `4k`, `4KiB`, `4 G`, ` 1T ` (surrounding whitespace and
/// whitespace before the suffix are ignored). Refused: fractions, signs, hex, `KB`
/// (ambiguous between 1000 and 1024), and anything that overflows `u64`. Zero parses
/// as 0: whether zero is acceptable is the caller's rule (a device refuses it).
///
/// ```
/// use ublkd_config::parse_size;
///
/// assert_eq!(parse_size("4G"), Ok(4 << 30));
/// assert_eq!(parse_size("512"), Ok(512));
/// assert!(parse_size("1.5G").is_err());
/// ```
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let trimmed = s.trim();
    if trimmed.is_empty() {
        return Err(SizeError::Empty);
    }
    let digits_end = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, rest) = trimmed.split_at(digits_end);
    let suffix = rest.trim_start();
    if digits.is_empty() || !suffix.chars().all(|c| c.is_ascii_alphabetic()) {
        return Err(SizeError::NotANumber { input: excerpt(trimmed) });
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => {
            return Err(SizeError::UnknownSuffix {
                input: excerpt(trimmed),
                suffix: excerpt(suffix),
            });
        }
    };
    let overflow = || SizeError::Overflow { input: excerpt(trimmed) };
    // Only digits remain, so the one way `parse` fails is a number beyond u64.
    let number: u64 = digits.parse().map_err(|_| overflow())?;
    number.checked_mul(1u64 << shift).ok_or_else(overflow)
}

/// Formats a byte count with the largest binary suffix that divides it exactly
/// (`1073741824` → `1G`, `1536` → `1536`, `3072` → `3K`), so that
/// `parse_size(&format_size(n)) == Ok(n)` for every `n`.
pub fn format_size(bytes: u64) -> String {
    const SUFFIXES: [(u32, &str); 4] = [(40, "T"), (30, "G"), (20, "M"), (10, "K")];
    if bytes != 0 {
        for (shift, suffix) in SUFFIXES {
            if bytes.trailing_zeros() >= shift {
                return format!("{}{suffix}", bytes >> shift);
            }
        }
    }
    bytes.to_string()
}

/// The input as an error message repeats it: at most [`EXCERPT_CHARS`] characters.
fn excerpt(s: &str) -> String {
    match s.char_indices().nth(EXCERPT_CHARS) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_size_plain_number_is_bytes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("1"), Ok(1));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn parse_size_suffixes_are_binary() {
        assert_eq!(parse_size("1K"), Ok(1 << 10));
        assert_eq!(parse_size("3M"), Ok(3 << 20));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size("0G"), Ok(0));
    }

    #[test]
    fn parse_size_suffixes_ignore_case_and_accept_ib() {
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("1KiB"), Ok(1024));
        assert_eq!(parse_size("1gib"), Ok(1 << 30));
        assert_eq!(parse_size("1TIB"), Ok(1 << 40));
    }

    #[test]
    fn parse_size_ignores_surrounding_whitespace_and_before_suffix() {
        assert_eq!(parse_size("  4G  "), Ok(4 << 30));
        assert_eq!(parse_size("\t512\n"), Ok(512));
        assert_eq!(parse_size("4 G"), Ok(4 << 30));
        assert_eq!(parse_size("1 KiB"), Ok(1024));
    }

    #[test]
    fn parse_size_overflow_is_an_error_not_a_wrap() {
        // 2^64 bytes: the digits alone overflow.
        assert!(matches!(parse_size("18446744073709551616"), Err(SizeError::Overflow { .. })));
        // The suffix multiplication overflows: 16777216T = 2^64.
        assert!(matches!(parse_size("16777216T"), Err(SizeError::Overflow { .. })));
        assert_eq!(parse_size("16777215T"), Ok(16_777_215 << 40));
        assert!(matches!(
            parse_size("99999999999999999999999999999G"),
            Err(SizeError::Overflow { .. })
        ));
    }

    #[test]
    fn parse_size_refuses_garbage() {
        for input in ["G", "abc", "-1", "+1", "1.5G", "0x10", "1_000", "1G1", "1 G B", "1,024", "½"]
        {
            assert!(
                matches!(parse_size(input), Err(SizeError::NotANumber { .. })),
                "{input:?} gave {:?}",
                parse_size(input)
            );
        }
    }

    #[test]
    fn parse_size_refuses_unknown_and_decimal_looking_suffixes() {
        for input in ["1KB", "1kb", "1P", "1E", "4Gb", "1bytes", "1B"] {
            assert!(
                matches!(parse_size(input), Err(SizeError::UnknownSuffix { .. })),
                "{input:?} gave {:?}",
                parse_size(input)
            );
        }
    }

    #[test]
    fn parse_size_empty_and_blank_are_empty() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert_eq!(parse_size("   "), Err(SizeError::Empty));
    }

    #[test]
    fn size_error_messages_say_what_is_accepted() {
        let message = parse_size("4X").map_err(|e| e.to_string());
        assert_eq!(
            message,
            Err("\"4X\" has an unknown suffix \"X\"; expected K, M, G or T, which are binary \
                 (1K = 1024), optionally followed by iB"
                .to_owned())
        );
        let message = parse_size("lots").map_err(|e| e.to_string());
        assert!(matches!(&message, Err(m) if m.contains("\"lots\" is not a size")));
    }

    #[test]
    fn size_error_shortens_long_inputs() {
        let long = "x".repeat(10_000);
        let Err(SizeError::NotANumber { input }) = parse_size(&long) else {
            panic!("expected NotANumber");
        };
        assert_eq!(input.chars().count(), EXCERPT_CHARS + 1);
    }

    #[test]
    fn format_size_uses_largest_exact_suffix_and_round_trips() {
        assert_eq!(format_size(0), "0");
        assert_eq!(format_size(512), "512");
        assert_eq!(format_size(1536), "1536");
        assert_eq!(format_size(3072), "3K");
        assert_eq!(format_size(1 << 30), "1G");
        assert_eq!(format_size(1 << 63), "8388608T");
        for n in [0, 1, 1023, 1024, 4096, 1 << 40, u64::MAX, (1 << 63) + 4096] {
            assert_eq!(parse_size(&format_size(n)), Ok(n));
        }
    }
}
