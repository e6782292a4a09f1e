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

/// Message data for `--json` documents: data that is a JSON document comes back as that
/// JSON (an object stays an object, a JSON string a string), anything else as text.
pub fn data_json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or_else(|_| serde_json::Value::String(text(bytes)))
}

/// Unix milliseconds as an RFC 3339 UTC timestamp with milliseconds
/// (`2026-12-03T10:25:36.123Z`); `None` before 1970.
pub fn rfc3339_utc(unix_ms: i64) -> Option<String> {
    const MS_PER_DAY: i64 = 86_400_000;
    if unix_ms < 0 {
        return None;
    }
    let days = unix_ms / MS_PER_DAY;
    let ms_of_day = unix_ms % MS_PER_DAY;
    // Days since 1970-01-01 to a proleptic Gregorian date, counting in 400-year eras that
    // start on March 1st (so the leap day is the last day of a year).
    let shifted = days + 719_468;
    let era = shifted / 146_097;
    let day_of_era = shifted - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1000 % 60,
        ms_of_day % 1000
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339_utc(0).as_deref(), Some("1970-01-01T00:00:00.000Z"));
        assert_eq!(
            rfc3339_utc(951_782_400_123).as_deref(),
            Some("2000-02-29T00:00:00.123Z")
        );
        assert_eq!(
            rfc3339_utc(1_796_293_536_000).as_deref(),
            Some("2026-12-03T10:25:36.000Z")
        );
        assert_eq!(rfc3339_utc(-1), None);
    }

    #[test]
    fn json_data_comes_back_as_json_and_text_as_a_string() {
        assert_eq!(
            data_json(br#"{"type":"heartbeat","term":3}"#),
            serde_json::json!({"type": "heartbeat", "term": 3})
        );
        assert_eq!(data_json(br#""quoted""#), serde_json::json!("quoted"));
        assert_eq!(data_json(b"plain text"), serde_json::json!("plain text"));
    }

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
