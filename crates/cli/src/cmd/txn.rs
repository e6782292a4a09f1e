//! `txn`: a transaction read from stdin in etcdctl's format.
//!
//! ```text
//! value("config/mode") = "slow"      <- compares, one per line
//!                                     <- blank line
//! put config/mode fast                <- operations run when every compare holds
//!                                     <- blank line
//! get config/mode                     <- operations run otherwise
//! ```
//!
//! Compare targets: `value`/`val`, `version`/`ver`, `create`/`c`, `mod`/`m`, `lease`; operators
//! `=`, `!=`, `<`, `>`. Operations: `put KEY VALUE [--lease=ID]`, `get KEY [--prefix]
//! [--rev=N] [--limit=N]`, `del KEY [--prefix]`; quote arguments with spaces.

use std::io::IsTerminal;

use clap::Args;
use conclave_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, Op, OpResponse, PutOptions, Txn, TxnResponse,
};
use serde_json::{Value, json};

use super::kv::{get_human, get_json, read_stdin};
use super::{CmdResult, Ctx, Failure, parse_lease_id};

/// Longest transaction text read from stdin (well above etcd's 1.5 MiB request limit, so the
/// server's `too_large` is what a big value meets).
pub const TXN_INPUT_BYTES_MAX: u64 = 4 * 1024 * 1024;

#[derive(Args, Debug)]
pub struct TxnArgs {}

/// A parsed transaction.
#[derive(Debug, Default)]
pub struct Parsed {
    pub compares: Vec<Compare>,
    pub success: Vec<Op>,
    pub failure: Vec<Op>,
}

pub async fn run(ctx: &Ctx, _args: TxnArgs) -> CmdResult {
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        ctx.out.note(
            "compares, a blank line, success requests (get, put, del), a blank line, failure \
             requests; end with Ctrl-D:",
        );
    }
    let input = read_stdin(TXN_INPUT_BYTES_MAX).await?;
    let input = String::from_utf8(input)
        .map_err(|_| Failure::invalid("the transaction on stdin is not UTF-8 text"))?;
    let parsed = parse(&input)?;
    let client = ctx.connect().await?;
    let answer = client
        .txn(
            Txn::new()
                .when(parsed.compares)
                .and_then(parsed.success)
                .or_else(parsed.failure),
        )
        .await?;
    ctx.out.ok(txn_json(&answer), || txn_human(&answer));
    Ok(0)
}

fn txn_json(answer: &TxnResponse) -> Value {
    json!({
        "succeeded": answer.succeeded,
        "revision": answer.revision,
        "responses": answer.responses.iter().map(op_json).collect::<Vec<_>>(),
    })
}

fn op_json(response: &OpResponse) -> Value {
    match response {
        OpResponse::Get(get) => json!({"get": get_json(get)}),
        OpResponse::Put(put) => json!({"put": {"revision": put.revision}}),
        OpResponse::Delete(del) => {
            json!({"delete": {"deleted": del.deleted, "revision": del.revision}})
        }
        OpResponse::Txn(txn) => json!({"txn": txn_json(txn)}),
    }
}

/// etcdctl's format: SUCCESS or FAILURE, a blank line, then each response.
fn txn_human(answer: &TxnResponse) -> String {
    let mut out = String::from(if answer.succeeded {
        "SUCCESS\n"
    } else {
        "FAILURE\n"
    });
    for response in &answer.responses {
        out.push('\n');
        match response {
            OpResponse::Get(get) => out.push_str(&get_human(get)),
            OpResponse::Put(_) => out.push_str("OK\n"),
            OpResponse::Delete(del) => out.push_str(&format!("{}\n", del.deleted)),
            OpResponse::Txn(txn) => out.push_str(&txn_human(txn)),
        }
    }
    out
}

/// Parses the three blank-line separated sections.
pub fn parse(input: &str) -> CmdResult<Parsed> {
    let mut parsed = Parsed::default();
    let mut section = 0;
    for (number, line) in input.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            // A blank line ends a section; blank lines before any content of the first
            // section are the empty compares section itself.
            section += 1;
            if section > 2 {
                break;
            }
            continue;
        }
        let at = |e: Failure| Failure::invalid(format!("line {}: {}", number + 1, e.message));
        match section {
            0 => parsed.compares.push(parse_compare(line).map_err(at)?),
            1 => parsed.success.push(parse_op(line).map_err(at)?),
            _ => parsed.failure.push(parse_op(line).map_err(at)?),
        }
    }
    Ok(parsed)
}

/// `value("key") = "v"`, `mod("key") > "3"` (numbers may be unquoted).
fn parse_compare(line: &str) -> CmdResult<Compare> {
    let (target, rest) = line.split_once('(').ok_or_else(|| {
        Failure::invalid(format!(
            "{line:?} is not a compare like value(\"key\") = \"v\""
        ))
    })?;
    let tokens = tokenize(rest)?;
    // tokenize sees `"key")` as the key followed by `)`.
    let (key, op, operand) = match tokens.as_slice() {
        [key, paren, op, operand] if paren == ")" => (key, op, operand),
        _ => {
            return Err(Failure::invalid(format!(
                "{line:?} is not a compare like value(\"key\") = \"v\""
            )));
        }
    };
    let op = match op.as_str() {
        "=" | "==" => CompareOp::Equal,
        "!=" => CompareOp::NotEqual,
        "<" => CompareOp::Less,
        ">" => CompareOp::Greater,
        other => {
            return Err(Failure::invalid(format!(
                "unknown compare operator {other:?} (use =, !=, < or >)"
            )));
        }
    };
    let number = |what: &str| {
        operand.parse::<i64>().map_err(|_| {
            Failure::invalid(format!("{what} compares need a number, not {operand:?}"))
        })
    };
    let key = key.as_bytes().to_vec();
    Ok(match target.trim() {
        "value" | "val" => Compare::value(key, op, operand.as_bytes().to_vec()),
        "version" | "ver" => Compare::version(key, op, number("version")?),
        "create" | "c" => Compare::create_revision(key, op, number("create revision")?),
        "mod" | "m" => Compare::mod_revision(key, op, number("mod revision")?),
        "lease" => Compare::lease(key, op, parse_lease_id(operand)?),
        other => {
            return Err(Failure::invalid(format!(
                "unknown compare target {other:?} (use value, version, create, mod or lease)"
            )));
        }
    })
}

fn parse_op(line: &str) -> CmdResult<Op> {
    let tokens = tokenize(line)?;
    let (verb, rest) = tokens
        .split_first()
        .ok_or_else(|| Failure::invalid("empty operation"))?;
    let mut positional = Vec::new();
    let mut prefix = false;
    let mut lease = 0;
    let mut rev = 0;
    let mut limit = 0;
    for token in rest {
        let (flag, value) = match token.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag, Some(value)),
            _ => (token.as_str(), None),
        };
        let int = |value: Option<&str>| -> CmdResult<i64> {
            value
                .and_then(|v| v.parse::<i64>().ok())
                .filter(|v| *v >= 0)
                .ok_or_else(|| Failure::invalid(format!("{flag} needs =N with N >= 0")))
        };
        match flag {
            "--prefix" => prefix = true,
            "--lease" => {
                lease = parse_lease_id(value.unwrap_or(""))?;
            }
            "--rev" => rev = int(value)?,
            "--limit" => limit = int(value)?,
            other if other.starts_with("--") => {
                return Err(Failure::invalid(format!(
                    "unknown flag {other:?} in {verb}"
                )));
            }
            _ => positional.push(token.clone()),
        }
    }
    match (verb.as_str(), positional.as_slice()) {
        ("put", [key, value]) => Ok(Op::put(
            key.as_bytes().to_vec(),
            value.as_bytes().to_vec(),
            PutOptions {
                lease,
                prev_kv: false,
            },
        )),
        ("get", [key]) => Ok(Op::get(
            key.as_bytes().to_vec(),
            GetOptions {
                prefix,
                revision: rev,
                limit,
                ..GetOptions::default()
            },
        )),
        ("del" | "delete", [key]) => Ok(Op::delete(
            key.as_bytes().to_vec(),
            DeleteOptions {
                prefix,
                ..DeleteOptions::default()
            },
        )),
        ("put", _) => Err(Failure::invalid("put needs KEY VALUE")),
        ("get" | "del" | "delete", _) => Err(Failure::invalid(format!("{verb} needs one KEY"))),
        (other, _) => Err(Failure::invalid(format!(
            "unknown operation {other:?} (use get, put or del)"
        ))),
    }
}

/// Splits on whitespace, honouring "double" (with \ escapes) and 'single' quotes; a `)`
/// right after a quoted word is its own token (for compares).
fn tokenize(text: &str) -> CmdResult<Vec<String>> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        if c == ')' {
            chars.next();
            tokens.push(")".to_string());
            continue;
        }
        let mut token = String::new();
        while let Some(&c) = chars.peek() {
            if c.is_whitespace() || (c == ')' && !token.is_empty()) {
                break;
            }
            chars.next();
            match c {
                '"' => loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some('n') => token.push('\n'),
                            Some('t') => token.push('\t'),
                            Some(other) => token.push(other),
                            None => return Err(Failure::invalid("unterminated \\ escape")),
                        },
                        Some(other) => token.push(other),
                        None => return Err(Failure::invalid("unterminated \" quote")),
                    }
                },
                '\'' => loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(other) => token.push(other),
                        None => return Err(Failure::invalid("unterminated ' quote")),
                    }
                },
                other => token.push(other),
            }
        }
        tokens.push(token);
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_sections() {
        let parsed = parse(
            "value(\"k\") = \"v 1\"\nmod(\"k\") > \"0\"\n\nput k \"new value\"\nget k --prefix\n\nget k\ndel k\n",
        )
        .expect("parses");
        assert_eq!(parsed.compares.len(), 2);
        assert_eq!(parsed.success.len(), 2);
        assert_eq!(parsed.failure.len(), 2);
        let request = Txn::new()
            .when(parsed.compares)
            .and_then(parsed.success)
            .into_request();
        assert_eq!(&request.compare[0].key[..], b"k");
    }

    #[test]
    fn empty_compares_and_bad_lines() {
        let parsed = parse("\nput a 1\n").expect("parses");
        assert!(parsed.compares.is_empty());
        assert_eq!(parsed.success.len(), 1);
        for bad in [
            "value(k = v",
            "size(\"k\") = \"1\"",
            "ver(\"k\") = \"x\"",
            "\nfrob k",
            "\nput k",
            "\nput \"k v",
        ] {
            let failure = parse(bad).err();
            assert_eq!(failure.map(|f| f.code), Some("invalid_argument"), "{bad}");
        }
    }

    #[test]
    fn tokenizer_handles_quotes() {
        assert_eq!(
            tokenize(r#"put "a b" 'c d' "e\"f""#).ok(),
            Some(vec![
                "put".to_string(),
                "a b".into(),
                "c d".into(),
                "e\"f".into()
            ])
        );
    }
}
