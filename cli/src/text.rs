//! Text shown to a person that came from someone else — labels, commands,
//! owners, details, hints, matched lines, coordinator names — is printed with
//! its control characters escaped, so a label cannot move the cursor, clear
//! the screen, retitle the terminal or hide text from whoever reads it.
//!
//! Only the text views use it: `--json` output stays JSON (its encoder
//! escapes control characters already), and a task's own output (`logs`, a
//! final output) is printed as the task wrote it, like `cat`.

use std::borrow::Cow;
use std::fmt::Write as _;

/// `s` with every control character (C0, DEL, C1) and every bidirectional
/// formatting character escaped: `\n`, `\r`, `\t` stay readable, the rest
/// become `\u{…}`. Text without any is returned as it is; text with some
/// also has its backslashes doubled, so an escape can be told from text
/// that spells one.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            c if needs_escape(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Control characters, and the Unicode bidirectional marks, embeddings,
/// overrides and isolates that reorder what a terminal shows.
fn needs_escape(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_shown_as_it_is() {
        for s in ["", "echo hi", "étape 1 — 日本語", r"C:\path", "tab-free"] {
            assert!(matches!(printable(s), Cow::Borrowed(_)), "{s:?}");
        }
    }

    #[test]
    fn control_and_reordering_characters_are_escaped() {
        assert_eq!(printable("a\nb\tc"), "a\\nb\\tc");
        assert_eq!(printable("\x1b[2J\x1b]0;owned\x07"), "\\u{1b}[2J\\u{1b}]0;owned\\u{7}");
        assert_eq!(printable("x\u{7f}\u{9b}y"), "x\\u{7f}\\u{9b}y");
        assert_eq!(printable("abc\u{202e}fed"), "abc\\u{202e}fed");
        // Once escaping, a backslash is doubled: `\n` typed by a user stays
        // distinguishable from an escaped newline.
        assert_eq!(printable("\\n\n"), "\\\\n\\n");
    }

    #[test]
    fn nothing_escaped_holds_a_control_character() {
        let all: String = (0u32..0x3000).filter_map(char::from_u32).collect();
        let shown = printable(&all);
        assert!(!shown.chars().any(needs_escape), "an escape leaked a control character");
    }
}
