//! The output contract: human text (tables, colour only on a terminal) or, with `--json`,
//! `{"status":"ok","data":...}` / `{"status":"error","code":...,"message":...}` documents.

use std::io::{IsTerminal, Write};

use serde_json::{Value, json};

use super::Failure;

/// Where and how a command prints.
#[derive(Debug, Clone, Copy)]
pub struct Output {
    pub json: bool,
    color: bool,
}

impl Output {
    pub fn new(json: bool) -> Output {
        // NO_COLOR (https://no-color.org) turns colour off even on a terminal.
        let color =
            !json && std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
        Output { json, color }
    }

    /// Prints a success: `data` as one JSON document, or the human text.
    pub fn ok(&self, data: Value, human: impl FnOnce() -> String) {
        if self.json {
            emit(&json!({"status": "ok", "data": data}).to_string());
        } else {
            let text = human();
            if !text.is_empty() {
                emit(text.trim_end_matches('\n'));
            }
        }
    }

    /// Prints a failure: an error document on stdout with `--json`, else one sentence on
    /// stderr.
    pub fn failure(&self, failure: &Failure) {
        if self.json {
            emit(&error_document(failure.code, &failure.message).to_string());
        } else {
            let mut stderr = std::io::stderr().lock();
            let _ = writeln!(stderr, "conclave: error: {}", failure.message);
        }
    }

    /// A status line for humans on stderr (never mixed into `--json` stdout).
    pub fn note(&self, text: &str) {
        if !self.json {
            let mut stderr = std::io::stderr().lock();
            let _ = writeln!(stderr, "{text}");
        }
    }

    pub fn bold(&self, text: &str) -> String {
        if self.color {
            format!("\x1b[1m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }

    pub fn green(&self, text: &str) -> String {
        if self.color {
            format!("\x1b[32m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }

    pub fn red(&self, text: &str) -> String {
        if self.color {
            format!("\x1b[31m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }

    /// An aligned table; the header in bold on a terminal. Cells may hold colour codes, which
    /// do not count towards the width.
    pub fn table(&self, headers: &[&str], rows: &[Vec<String>]) -> String {
        let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
        for row in rows {
            for (i, cell) in row.iter().enumerate() {
                if let Some(width) = widths.get_mut(i) {
                    *width = (*width).max(visible_len(cell));
                }
            }
        }
        let line = |cells: Vec<String>| {
            let mut text = String::new();
            for (i, cell) in cells.iter().enumerate() {
                let width = widths.get(i).copied().unwrap_or(0);
                if i + 1 == cells.len() {
                    text.push_str(cell);
                } else {
                    text.push_str(cell);
                    text.push_str(&" ".repeat(width.saturating_sub(visible_len(cell)) + 2));
                }
            }
            text.trim_end().to_string()
        };
        let mut text = line(headers.iter().map(|h| self.bold(h)).collect());
        for row in rows {
            text.push('\n');
            text.push_str(&line(row.clone()));
        }
        text
    }
}

/// `{"status":"error","code":...,"message":...}`.
pub fn error_document(code: &str, message: &str) -> Value {
    json!({"status": "error", "code": code, "message": message})
}

/// Writes one line to stdout and flushes it (streams are read line by line). A closed pipe
/// (`conclave watch ... | head -1`) ends the process quietly instead of panicking.
pub fn emit(text: &str) {
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{text}")
        .and_then(|_| stdout.flush())
        .is_err()
    {
        std::process::exit(0);
    }
}

fn visible_len(text: &str) -> usize {
    let mut len = 0;
    let mut in_escape = false;
    for c in text.chars() {
        if in_escape {
            in_escape = c != 'm';
        } else if c == '\x1b' {
            in_escape = true;
        } else {
            len += 1;
        }
    }
    len
}

/// Bytes as text: UTF-8 as is, anything else lossily (the JSON documents are text).
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_ignore_colour_codes() {
        let out = Output {
            json: false,
            color: false,
        };
        let table = out.table(
            &["ID", "NAME"],
            &[
                vec!["1".into(), "alpha".into()],
                vec!["\x1b[32m22\x1b[0m".into(), "b".into()],
            ],
        );
        assert_eq!(table, "ID  NAME\n1   alpha\n\x1b[32m22\x1b[0m  b");
    }
}
