//! The guest's serial console: program output and the harness's marker lines.
//!
//! The guest's `/init` prints `UBLKD-VM:<nonce>:<KIND>:<value>` markers (see
//! [`crate::initramfs::INIT_SCRIPT`]), each after an empty line. A marker counts only as
//! a whole line (a trailing `\r` from the tty aside) with this run's nonce: kernel
//! warnings interleave with program output on the console, and a line that merely
//! contains a marker, or a marker with another nonce (a forged one, or one from a log a
//! test prints), is program output. [`ConsoleParser`] turns console bytes, in chunks of
//! any size, into [`Event`]s: output lines (with `\r\n` turned into `\n`, and without
//! the empty line `/init` prints before each marker) and markers.

/// Every marker line starts with this.
pub const MARKER_PREFIX: &str = "UBLKD-VM:";

/// A marker line from the guest's `/init`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    /// Setup before the command failed at this step (the boot may be retried).
    SetupFailed(String),
    /// The guest is set up; carries its `uname -r`.
    Ready(String),
    /// `ublkd-vm guest-check` exited with this status (non-zero).
    CheckFailed(u8),
    /// The command exited with this status.
    Exit(u8),
}

/// Parses `line` (without its `\n`; a trailing `\r` is ignored) as a marker of the run
/// with `nonce`. Anything else, including a marker with another nonce or with text
/// around it, is `None`.
pub fn parse_marker(line: &[u8], nonce: &str) -> Option<Marker> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line = std::str::from_utf8(line).ok()?;
    let rest = line.strip_prefix(MARKER_PREFIX)?.strip_prefix(nonce)?.strip_prefix(':')?;
    let (kind, value) = rest.split_once(':')?;
    let status = || value.parse::<u8>().ok();
    match kind {
        "SETUP-FAILED" => Some(Marker::SetupFailed(value.to_owned())),
        "READY" if !value.is_empty() => Some(Marker::Ready(value.to_owned())),
        "CHECK-FAILED" => status().map(Marker::CheckFailed),
        "EXIT" => status().map(Marker::Exit),
        _ => None,
    }
}

/// What the console said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// One line of output, ending in `\n` (unless it was the unterminated last line).
    Output(Vec<u8>),
    /// A marker of this run.
    Marker(Marker),
}

/// Splits console bytes into lines and recognises this run's markers.
#[derive(Debug)]
pub struct ConsoleParser {
    nonce: String,
    partial: Vec<u8>,
    held_blank: bool,
}

impl ConsoleParser {
    /// A parser for the run with `nonce`.
    pub fn new(nonce: &str) -> Self {
        Self { nonce: nonce.to_owned(), partial: Vec::new(), held_blank: false }
    }

    /// Feeds a chunk; returns the events of the lines it completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&rest[..nl]);
            rest = &rest[nl + 1..];
            let line = std::mem::take(&mut self.partial);
            self.line(line, true, &mut events);
        }
        self.partial.extend_from_slice(rest);
        events
    }

    /// The console ended: the unterminated rest is a last line.
    pub fn finish(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        if !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.line(line, false, &mut events);
        }
        if std::mem::take(&mut self.held_blank) {
            events.push(Event::Output(b"\n".to_vec()));
        }
        events
    }

    fn line(&mut self, mut line: Vec<u8>, terminated: bool, events: &mut Vec<Event>) {
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if line.is_empty() && terminated {
            // Maybe the empty line /init prints before a marker: hold it back.
            if std::mem::replace(&mut self.held_blank, true) {
                events.push(Event::Output(b"\n".to_vec()));
            }
            return;
        }
        if let Some(marker) = parse_marker(&line, &self.nonce) {
            self.held_blank = false;
            events.push(Event::Marker(marker));
            return;
        }
        if std::mem::take(&mut self.held_blank) {
            events.push(Event::Output(b"\n".to_vec()));
        }
        if terminated {
            line.push(b'\n');
        }
        events.push(Event::Output(line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONCE: &str = "5f0c2a9d13e4b871";

    fn feed_all(chunks: &[&[u8]]) -> Vec<Event> {
        let mut parser = ConsoleParser::new(NONCE);
        let mut events: Vec<Event> = chunks.iter().flat_map(|c| parser.feed(c)).collect();
        events.extend(parser.finish());
        events
    }

    fn out(s: &str) -> Event {
        Event::Output(s.as_bytes().to_vec())
    }

    #[test]
    fn whole_line_markers_are_recognised() {
        let m = |s: &str| parse_marker(s.as_bytes(), NONCE);
        assert_eq!(
            m("UBLKD-VM:5f0c2a9d13e4b871:READY:7.2.13+deb14-cloud-amd64"),
            Some(Marker::Ready("7.2.13+deb14-cloud-amd64".into()))
        );
        assert_eq!(m("UBLKD-VM:5f0c2a9d13e4b871:EXIT:7\r"), Some(Marker::Exit(7)));
        assert_eq!(m("UBLKD-VM:5f0c2a9d13e4b871:CHECK-FAILED:3"), Some(Marker::CheckFailed(3)));
        assert_eq!(
            m("UBLKD-VM:5f0c2a9d13e4b871:SETUP-FAILED:mount x"),
            Some(Marker::SetupFailed("mount x".into()))
        );
    }

    #[test]
    fn malformed_markers_are_not_markers() {
        let m = |s: &str| parse_marker(s.as_bytes(), NONCE);
        assert_eq!(m("UBLKD-VM:5f0c2a9d13e4b871:EXIT:256"), None);
        assert_eq!(m("UBLKD-VM:5f0c2a9d13e4b871:EXIT:"), None);
        assert_eq!(m("UBLKD-VM:5f0c2a9d13e4b871:READY:"), None);
        assert_eq!(m("UBLKD-VM:5f0c2a9d13e4b871:BOGUS:1"), None);
        assert_eq!(m("UBLKD-VM:5f0c2a9d13e4b871EXIT:1"), None);
    }

    #[test]
    fn forged_marker_with_wrong_nonce_is_output() {
        let events = feed_all(&[b"UBLKD-VM:0000000000000000:EXIT:0\r\n"]);
        assert_eq!(events, [out("UBLKD-VM:0000000000000000:EXIT:0\n")]);
    }

    #[test]
    fn marker_embedded_in_kernel_noise_is_output() {
        let line = "[    5.123456] ublk: warn UBLKD-VM:5f0c2a9d13e4b871:EXIT:0\n";
        assert_eq!(feed_all(&[line.as_bytes()]), [out(line)]);
        let trailing = "UBLKD-VM:5f0c2a9d13e4b871:EXIT:0[    5.2] UBSAN: array-index\n";
        assert_eq!(feed_all(&[trailing.as_bytes()]), [out(trailing)]);
    }

    #[test]
    fn marker_split_across_chunks_is_recognised_once_complete() {
        let mut parser = ConsoleParser::new(NONCE);
        assert_eq!(parser.feed(b"hello\r\nUBLKD-VM:5f0c2a9d"), [out("hello\n")]);
        assert_eq!(parser.feed(b"13e4b871:EX"), []);
        assert_eq!(parser.feed(b"IT:3\r"), []);
        assert_eq!(parser.feed(b"\nafter"), [Event::Marker(Marker::Exit(3))]);
        assert_eq!(parser.finish(), [out("after")]);
    }

    #[test]
    fn blank_line_before_marker_is_dropped_other_blanks_kept() {
        let events = feed_all(&[
            b"a\r\n\r\n\r\nb\r\nno newline\r\nUBLKD-VM:5f0c2a9d13e4b871:READY:7.2\r\n\r\n",
        ]);
        assert_eq!(
            events,
            [
                out("a\n"),
                out("\n"),
                out("\n"),
                out("b\n"),
                out("no newline\n"),
                Event::Marker(Marker::Ready("7.2".into())),
                out("\n"),
            ]
        );
        let events = feed_all(&[b"partial\n\nUBLKD-VM:5f0c2a9d13e4b871:EXIT:0\n"]);
        assert_eq!(events, [out("partial\n"), Event::Marker(Marker::Exit(0))]);
    }

    #[test]
    fn unterminated_last_line_is_flushed_and_may_be_a_marker() {
        assert_eq!(feed_all(&[b"tail"]), [out("tail")]);
        assert_eq!(
            feed_all(&[b"UBLKD-VM:5f0c2a9d13e4b871:EXIT:1"]),
            [Event::Marker(Marker::Exit(1))]
        );
    }
}
