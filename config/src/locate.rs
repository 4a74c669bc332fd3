//! Key paths (`device[2].queue_depth`) and where they are in the text.
//!
//! toml reports a byte span; people want the key and the line. [`path_at`] turns a span
//! into the key that holds it, [`span_of`] turns a key path back into a span so that
//! errors found after parsing (a size that is not a multiple of the block size) point
//! at a line too.

use std::fmt;
use std::ops::Range;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::Location;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// A key's path from the document root, displayed as `device[2].queue_depth`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KeyPath(Vec<Segment>);

impl KeyPath {
    pub(crate) fn root() -> Self {
        Self::default()
    }

    /// This path extended by a table key.
    pub(crate) fn key(&self, key: &str) -> Self {
        let mut path = self.clone();
        path.0.push(Segment::Key(key.to_owned()));
        path
    }

    /// This path extended by an array index.
    pub(crate) fn index(&self, index: usize) -> Self {
        let mut path = self.clone();
        path.0.push(Segment::Index(index));
        path
    }

    pub(crate) fn is_root(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, segment) in self.0.iter().enumerate() {
            match segment {
                Segment::Key(key) if i == 0 => write!(f, "{key}")?,
                Segment::Key(key) => write!(f, ".{key}")?,
                Segment::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// The innermost key whose key or value covers byte `offset`; the root if none does.
pub(crate) fn path_at(doc: &DeTable<'_>, offset: usize) -> KeyPath {
    let mut path = KeyPath::root();
    find_in_table(doc, offset, &mut path);
    path
}

fn covers(span: &Range<usize>, offset: usize) -> bool {
    span.contains(&offset) || (span.is_empty() && span.start == offset)
}

fn find_in_table(table: &DeTable<'_>, offset: usize, path: &mut KeyPath) -> bool {
    for (key, value) in table.iter() {
        path.0.push(Segment::Key(key.get_ref().to_string()));
        if covers(&key.span(), offset) || find_in_value(value, offset, path) {
            return true;
        }
        path.0.pop();
    }
    false
}

/// Searches the children first: a table's own span may be only its `[header]`.
fn find_in_value(value: &Spanned<DeValue<'_>>, offset: usize, path: &mut KeyPath) -> bool {
    let found = match value.get_ref() {
        DeValue::Table(table) => find_in_table(table, offset, path),
        DeValue::Array(array) => array.iter().enumerate().any(|(index, item)| {
            path.0.push(Segment::Index(index));
            let found = find_in_value(item, offset, path);
            if !found {
                path.0.pop();
            }
            found
        }),
        _ => false,
    };
    found || covers(&value.span(), offset)
}

/// The span of `path`'s key (or array element), or of its longest prefix present in
/// the text: a value inherited from `[defaults]` points at its `[[device]]` header.
pub(crate) fn span_of(doc: &DeTable<'_>, path: &KeyPath) -> Option<Range<usize>> {
    let mut best = None;
    let mut table = Some(doc);
    let mut value: Option<&Spanned<DeValue<'_>>> = None;
    for segment in &path.0 {
        let next = match segment {
            Segment::Key(key) => {
                let Some((k, v)) = table.and_then(|t| t.get_key_value(key.as_str())) else {
                    break;
                };
                best = Some(k.span());
                v
            }
            Segment::Index(index) => {
                let Some(item) = value.and_then(|v| v.get_ref().as_array()?.get(*index)) else {
                    break;
                };
                best = Some(item.span());
                item
            }
        };
        value = Some(next);
        table = next.get_ref().as_table();
    }
    best
}

/// Line and column (both from 1, column in characters) of byte `offset` in `text`.
pub(crate) fn location(text: &str, offset: usize) -> Location {
    let offset = offset.min(text.len());
    let before = text.as_bytes().get(..offset).unwrap_or_default();
    let line_start = before.iter().rposition(|&b| b == b'\n').map_or(0, |newline| newline + 1);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let column =
        text.get(line_start..offset).map_or(offset - line_start, |s| s.chars().count()) + 1;
    Location { line, column }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "[daemon]\nsocket = \"/x\"\n\n[[device]]\ntarget = \"null\"\n\n\
                        [[device]]\ntarget = \"loop\"\nsize = \"1G\"\n";

    fn doc() -> Option<Spanned<DeTable<'static>>> {
        DeTable::parse(TEXT).ok()
    }

    #[test]
    fn path_at_finds_keys_inside_array_of_tables() {
        let doc = doc().expect("test document parses");
        let offset = TEXT.find("size").expect("size is in the text");
        assert_eq!(path_at(doc.get_ref(), offset).to_string(), "device[1].size");
        let offset = TEXT.find("\"/x\"").expect("value is in the text");
        assert_eq!(path_at(doc.get_ref(), offset).to_string(), "daemon.socket");
    }

    #[test]
    fn span_of_falls_back_to_the_nearest_present_prefix() {
        let doc = doc().expect("test document parses");
        let size = KeyPath::root().key("device").index(1).key("size");
        let span = span_of(doc.get_ref(), &size).expect("size is present");
        assert_eq!(location(TEXT, span.start), Location { line: 9, column: 1 });
        let threads = KeyPath::root().key("device").index(0).key("threads");
        let span = span_of(doc.get_ref(), &threads).expect("device[0] is present");
        assert_eq!(location(TEXT, span.start).line, 4);
        assert_eq!(span_of(doc.get_ref(), &KeyPath::root().key("nothing")), None);
    }

    #[test]
    fn location_counts_characters_not_bytes() {
        assert_eq!(location("ab\né = 1", 6), Location { line: 2, column: 3 });
        assert_eq!(location("", 10), Location { line: 1, column: 1 });
    }
}
