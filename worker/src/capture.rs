//! What a shim does with its task's output ([`crate::shim`]): the pipe is
//! copied into the task's output file up to a cap, and for a `monitor` task
//! every line is matched against its pattern, the matching ones recorded in
//! the attempt's `matches` file.
//!
//! It never blocks the task: past the cap, and when the file cannot be
//! written, the pipe keeps draining and the bytes are counted as dropped.
//! It never follows a link planted at the output path
//! ([`tenure_machine::open_output_for_append`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use tenure_machine::attempt_files::AttemptFiles;
use tenure_protocol::messages::MatchedLine;

/// The task's output file. An earlier attempt's file is opened before the
/// task starts (and refused then if it is not a regular file); without one,
/// the file is created when the first byte arrives, so a task that writes
/// nothing costs no file, no inode and no syncs. A file that cannot be
/// created then (a link planted at its path, a full disk) drops the output,
/// counted, like a failed write.
pub(crate) enum OutputFile {
    Open(std::fs::File),
    NotYet(PathBuf),
    Failed,
}

impl OutputFile {
    pub(crate) fn prepare(path: &Path) -> std::io::Result<OutputFile> {
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(OutputFile::NotYet(path.to_path_buf())),
            Err(e) => Err(e),
            Ok(_) => tenure_machine::open_output_for_append(path).map(OutputFile::Open),
        }
    }

    /// The open file, created now if this is the first byte.
    fn file(&mut self) -> Option<&mut std::fs::File> {
        if let OutputFile::NotYet(path) = self {
            *self = match tenure_machine::open_output_for_append(path) {
                Ok(file) => OutputFile::Open(file),
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "shim cannot create the output file; output is dropped");
                    OutputFile::Failed
                }
            };
        }
        match self {
            OutputFile::Open(file) => Some(file),
            _ => None,
        }
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self.file() {
            Some(file) => file.write_all(bytes),
            None => Err(std::io::Error::other("no output file")),
        }
    }
}

/// Copies the pipe into the output file. Past `cap` bytes the pipe keeps
/// draining (the task never blocks on output) but bytes are dropped, counted,
/// and one notice is appended.
pub(crate) struct Pump {
    pub(crate) reader: Option<std::io::PipeReader>,
    output: OutputFile,
    cap: u64,
    matcher: Option<LineMatcher>,
    written: u64,
    dropped: u64,
    /// What one read takes: allocated, never zeroed, so a page of it is
    /// touched only when output fills it (a task that writes nothing costs
    /// the shim no page of it).
    buf: Vec<u8>,
}

/// Bytes one read of the pipe takes at most.
const READ_SIZE: usize = 64 * 1024;

impl Pump {
    pub(crate) fn new(reader: std::io::PipeReader, output: OutputFile, cap: u64, matcher: Option<LineMatcher>) -> Pump {
        Pump { reader: Some(reader), output, cap, matcher, written: 0, dropped: 0, buf: Vec::with_capacity(READ_SIZE) }
    }

    /// One read of what the pipe holds (it was ready); the end of the pipe
    /// closes it.
    pub(crate) fn step(&mut self) {
        let Some(reader) = self.reader.as_mut() else { return };
        self.buf.clear();
        let n = match rustix::io::read(&*reader, rustix::buffer::spare_capacity(&mut self.buf)) {
            Ok(0) => return self.close(),
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => return,
            Err(_) => return self.close(),
        };
        let buf = &self.buf;
        if let Some(m) = self.matcher.as_mut() {
            m.feed(&buf[..n]);
        }
        let room = self.cap.saturating_sub(self.written).min(n as u64) as usize;
        if room > 0 {
            if self.output.write_all(&buf[..room]).is_err() {
                self.dropped += room as u64;
            } else {
                self.written += room as u64;
            }
        }
        let over = (n - room) as u64;
        if over > 0 {
            if self.dropped == 0 {
                let notice =
                    format!("\n[tenure: output cap of {} bytes reached; further output is dropped]\n", self.cap);
                let _ = self.output.write_all(notice.as_bytes());
            }
            self.dropped += over;
        }
    }

    fn close(&mut self) {
        self.reader = None;
    }

    /// Ends matching and makes the output durable; written and dropped
    /// bytes, and whether there is an output file.
    pub(crate) fn finish(mut self) -> (u64, u64, bool) {
        if let Some(m) = self.matcher.as_mut() {
            m.end();
        }
        let file = match &self.output {
            OutputFile::Open(file) => Some(file),
            OutputFile::NotYet(_) | OutputFile::Failed => None,
        };
        if let Some(file) = file {
            let _ = file.sync_data();
        }
        (self.written, self.dropped, file.is_some())
    }
}

/// Bytes of one line kept for matching; the rest of a longer line is ignored.
const MAX_LINE_SCAN: usize = 64 * 1024;
/// Matched lines recorded per attempt; later ones are counted, not recorded.
const MAX_RECORDED_MATCHES: u64 = 100_000;

/// Finds the output lines of a `monitor` task that match its pattern and
/// appends each to the attempt's `matches` file (one JSON line, with the
/// line's offset in the output stream, so the leader can deduplicate).
pub(crate) struct LineMatcher {
    regex: regex::Regex,
    out: std::fs::File,
    line: Vec<u8>,
    line_start: u64,
    seen: u64,
    recorded: u64,
}

impl LineMatcher {
    pub(crate) fn new(pattern: &str, files: &AttemptFiles) -> Result<LineMatcher, String> {
        let regex = regex::Regex::new(pattern).map_err(|e| e.to_string())?;
        let out = files.open_matches_for_append().map_err(|e| format!("cannot open the matches file: {e}"))?;
        Ok(LineMatcher { regex, out, line: Vec::new(), line_start: 0, seen: 0, recorded: 0 })
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let (part, newline) = match bytes.iter().position(|b| *b == b'\n') {
                Some(i) => (&bytes[..i], true),
                None => (bytes, false),
            };
            let room = MAX_LINE_SCAN.saturating_sub(self.line.len()).min(part.len());
            self.line.extend_from_slice(&part[..room]);
            self.seen += part.len() as u64;
            bytes = &bytes[part.len()..];
            if newline {
                self.seen += 1;
                bytes = &bytes[1..];
                self.end();
            }
        }
    }

    /// Ends the current line (at a newline, or at the end of the output).
    fn end(&mut self) {
        let text = String::from_utf8_lossy(&self.line);
        let text = text.strip_suffix('\r').unwrap_or(&text);
        if !self.line.is_empty() && self.regex.is_match(text) && self.recorded < MAX_RECORDED_MATCHES {
            let matched = MatchedLine::new(self.line_start, text);
            if let Ok(mut json) = serde_json::to_vec(&matched) {
                json.push(b'\n');
                // One write per line: a reader never sees half of one.
                if self.out.write_all(&json).is_ok() {
                    self.recorded += 1;
                }
            }
        }
        self.line.clear();
        self.line_start = self.seen;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::messages::MAX_MATCH_LINE_BYTES;

    fn matched(pattern: &str, chunks: &[&[u8]]) -> Vec<MatchedLine> {
        let dir = tempfile::tempdir().unwrap();
        let files = AttemptFiles::new(dir.path().to_path_buf());
        let mut m = LineMatcher::new(pattern, &files).unwrap();
        for c in chunks {
            m.feed(c);
        }
        m.end();
        files.read_matches(0, 1000).unwrap().0
    }

    #[test]
    fn lines_match_across_reads_with_their_stream_offsets() {
        let got = matched("ERR", &[b"ok\nERR one", b"\nfine\r\nan ERR\r\n", b"last ERR"]);
        let got: Vec<(u64, &str)> = got.iter().map(|l| (l.offset, l.text.as_str())).collect();
        assert_eq!(got, [(3, "ERR one"), (17, "an ERR"), (25, "last ERR")]);
    }

    #[test]
    fn long_lines_are_cut_and_binary_is_tolerated() {
        let long = format!("{}ERR", "x".repeat(MAX_MATCH_LINE_BYTES * 2));
        let got = matched("^x+ERR$", &[long.as_bytes(), b"\n\xff\xfeERR\n"]);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].text.len(), MAX_MATCH_LINE_BYTES);
        assert_eq!(matched("ERR$", &[b"\xffERR\n"]).len(), 1);
        assert!(matched("nothing", &[b"a\nb\n"]).is_empty());
    }

    fn pump(output: OutputFile, cap: u64, chunks: &[&[u8]]) -> (u64, u64, bool) {
        let (reader, mut writer) = std::io::pipe().unwrap();
        let mut pump = Pump::new(reader, output, cap, None);
        for chunk in chunks {
            writer.write_all(chunk).unwrap();
            pump.step();
        }
        drop(writer);
        pump.step();
        assert!(pump.reader.is_none(), "the end of the pipe closes it");
        pump.finish()
    }

    #[test]
    fn a_task_that_writes_nothing_gets_no_output_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.out");
        let output = OutputFile::prepare(&path).unwrap();
        assert_eq!(pump(output, 100, &[]), (0, 0, false));
        assert!(!path.exists());
    }

    #[test]
    fn the_first_byte_creates_the_file_and_a_later_attempt_appends_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.out");
        let output = OutputFile::prepare(&path).unwrap();
        assert_eq!(pump(output, 100, &[b"one\n"]), (4, 0, true));
        let output = OutputFile::prepare(&path).unwrap();
        assert!(matches!(output, OutputFile::Open(_)), "an earlier attempt's file is opened at once");
        assert_eq!(pump(output, 100, &[b"two\n"]), (4, 0, true));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\n");
    }

    #[test]
    fn past_the_cap_bytes_are_dropped_with_one_notice() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.out");
        let output = OutputFile::prepare(&path).unwrap();
        assert_eq!(pump(output, 5, &[b"abc", b"defgh", b"ij"]), (5, 5, true));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("abcde\n[tenure: output cap of 5 bytes reached"), "{text}");
        assert_eq!(text.matches("output cap").count(), 1, "{text}");
    }

    #[test]
    fn a_link_at_the_output_path_is_refused_before_or_dropped_after_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let path = dir.path().join("t.out");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        // Planted before the task starts: the attempt is refused.
        assert!(OutputFile::prepare(&path).is_err());
        // Planted after the start, before the first byte: the output is dropped.
        std::fs::remove_file(&path).unwrap();
        let output = OutputFile::prepare(&path).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        assert_eq!(pump(output, 100, &[b"overwrite\n"]), (0, 10, false));
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    }
}
