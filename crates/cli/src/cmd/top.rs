//! `conclave top`: the dashboard's overview (`/api/v1/overview` on a member's metrics
//! listener) in the terminal, redrawn every second; `--json` prints one snapshot.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::Failure;
use super::output::Output;

/// How long one overview request may take.
const TOP_REQUEST_TIMEOUT_MS: u64 = 3_000;
/// The largest overview answer read (the server caps its rows, so this is generous).
const TOP_ANSWER_BYTES_MAX: usize = 16 * 1024 * 1024;

#[derive(Args, Debug)]
pub struct TopArgs {
    /// A member's metrics listener, `host:port` or `http://host:port`. Default: the first
    /// --endpoints entry with its port plus 10000 (the serve default).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Redraw interval in milliseconds.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub interval_ms: u64,
    /// Draw this many screens, then exit (0: until Ctrl-C).
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}

/// Runs `conclave top`; returns the exit code.
pub async fn run(json: bool, endpoints: &str, args: TopArgs) -> i32 {
    let out = Output::new(json);
    let base = match base_url(endpoints, args.metrics.as_deref()) {
        Ok(base) => base,
        Err(failure) => {
            out.failure(&failure);
            return failure.exit_code();
        }
    };
    let mut drawn = 0u64;
    loop {
        match fetch(&base).await {
            Ok(overview) if json => {
                out.ok(overview, String::new);
                return 0;
            }
            Ok(overview) => {
                // Clear the screen and draw from the top left, like `top`.
                let screen = render(&overview, &out);
                let mut stdout = std::io::stdout().lock();
                let _ = write!(stdout, "\x1b[2J\x1b[H{screen}");
                let _ = stdout.flush();
            }
            Err(failure) => {
                out.failure(&failure);
                return failure.exit_code();
            }
        }
        drawn += 1;
        if args.count != 0 && drawn >= args.count {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(args.interval_ms)).await;
    }
}

fn base_url(endpoints: &str, metrics: Option<&str>) -> Result<String, Failure> {
    let address = match metrics {
        Some(address) => address.trim_end_matches('/').to_owned(),
        None => {
            let first = endpoints.split(',').next().unwrap_or_default().trim();
            let bare = first
                .trim_start_matches("http://")
                .trim_start_matches("https://")
                .trim_end_matches('/');
            conclave_server::http::default_metrics_address(bare).ok_or_else(|| {
                Failure::new(
                    "invalid_argument",
                    format!("cannot derive a metrics address from endpoint {first:?}; give --metrics HOST:PORT"),
                )
            })?
        }
    };
    if address.starts_with("http://") {
        Ok(address)
    } else {
        Ok(format!("http://{address}"))
    }
}

async fn fetch(base: &str) -> Result<Value, Failure> {
    let url = format!("{base}/api/v1/overview");
    let uri: hyper::Uri = url.parse().map_err(|e| {
        Failure::new(
            "invalid_argument",
            format!("bad metrics address {base:?}: {e}"),
        )
    })?;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let unavailable = |what: String| Failure::new("unavailable", format!("{url}: {what}"));
    let answer = tokio::time::timeout(Duration::from_millis(TOP_REQUEST_TIMEOUT_MS), async {
        let response = client
            .get(uri)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), TOP_ANSWER_BYTES_MAX)
            .collect()
            .await
            .map_err(|e| unavailable(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(unavailable(format!("answered {status}")));
        }
        serde_json::from_slice::<Value>(&body)
            .map_err(|e| unavailable(format!("not an overview document: {e}")))
    })
    .await;
    answer.unwrap_or_else(|_| {
        Err(unavailable(format!(
            "no answer within {TOP_REQUEST_TIMEOUT_MS} ms"
        )))
    })
}

fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        Value::Bool(b) => if *b { "yes" } else { "no" }.to_owned(),
        other => other.to_string(),
    }
}

fn age(value: &Value) -> String {
    match value.as_u64() {
        Some(ms) if ms < 10_000 => format!("{:.1}s", ms as f64 / 1e3),
        Some(ms) => format!("{}s", ms / 1000),
        None => "-".to_owned(),
    }
}

/// The overview as text: one table per section.
pub fn render(overview: &Value, out: &Output) -> String {
    let empty = Vec::new();
    let list = |key: &str| overview[key].as_array().unwrap_or(&empty).clone();
    let mut screen = format!(
        "{}  cluster {}  term {}  leader {}  (via member {})\n\n",
        out.bold("conclave top"),
        text(&overview["cluster_id"]),
        text(&overview["term"]),
        text(&overview["leader"]),
        text(&overview["member"]),
    );
    let members: Vec<Vec<String>> = list("members")
        .iter()
        .map(|m| {
            let healthy = if m["healthy"].as_bool() == Some(true) {
                out.green("healthy")
            } else {
                out.red("unhealthy")
            };
            vec![
                text(&m["id"]),
                text(&m["name"]),
                text(&m["role"]),
                text(&m["term"]),
                text(&m["commit"]),
                text(&m["applied"]),
                text(&m["lag"]),
                healthy,
            ]
        })
        .collect();
    screen += &out.table(
        &[
            "ID", "NAME", "ROLE", "TERM", "COMMIT", "APPLIED", "LAG", "HEALTH",
        ],
        &members,
    );
    screen += "\n\n";
    let groups: Vec<Vec<String>> = list("groups")
        .iter()
        .map(|g| {
            let candidates: Vec<String> = g["candidates"]
                .as_array()
                .unwrap_or(&empty)
                .iter()
                .map(|c| format!("{}({})", text(&c["id"]), text(&c["priority"])))
                .collect();
            vec![
                text(&g["name"]),
                text(&g["leader"]),
                text(&g["priority"]),
                text(&g["fence"]),
                text(&g["term"]),
                age(&g["leader_keepalive_age_ms"]),
                candidates.join(" "),
            ]
        })
        .collect();
    screen += &out.table(
        &[
            "GROUP",
            "LEADER",
            "PRIORITY",
            "FENCE",
            "TERM",
            "KEEPALIVE",
            "CANDIDATES",
        ],
        &groups,
    );
    screen += "\n\n";
    let locks: Vec<Vec<String>> = list("locks")
        .iter()
        .map(|l| {
            vec![
                text(&l["name"]),
                text(&l["holder"]),
                text(&l["fence"]),
                text(&l["waiting"]),
            ]
        })
        .collect();
    screen += &out.table(&["LOCK", "HOLDER", "FENCE", "WAITING"], &locks);
    screen += "\n\n";
    let topics: Vec<Vec<String>> = list("topics")
        .iter()
        .map(|t| {
            let lags: Vec<String> = t["consumers"]
                .as_array()
                .unwrap_or(&empty)
                .iter()
                .map(|c| format!("{}:{}", text(&c["consumer"]), text(&c["lag"])))
                .collect();
            vec![
                text(&t["name"]),
                text(&t["depth"]),
                text(&t["last_seq"]),
                lags.join(" "),
            ]
        })
        .collect();
    screen += &out.table(&["TOPIC", "DEPTH", "LAST SEQ", "CONSUMER LAG"], &topics);
    screen += "\n\n";
    let last = overview["rates"]["samples"]
        .as_array()
        .and_then(|s| s.last().cloned())
        .unwrap_or(Value::Null);
    screen += &format!(
        "puts/s {:.0}   mean put latency {:.2} ms   puts total {}\n",
        last["puts_per_s"].as_f64().unwrap_or(0.0),
        last["put_latency_ms"].as_f64().unwrap_or(0.0),
        text(&overview["rates"]["puts_total"]),
    );
    screen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_address_defaults_to_the_endpoint_port_plus_ten_thousand() {
        assert_eq!(
            base_url("127.0.0.1:2379,127.0.0.1:2381", None).ok(),
            Some("http://127.0.0.1:12379".to_owned())
        );
        assert_eq!(
            base_url("http://10.0.0.1:2379", None).ok(),
            Some("http://10.0.0.1:12379".to_owned())
        );
        assert_eq!(
            base_url("x", Some("h:9")).ok(),
            Some("http://h:9".to_owned())
        );
        assert!(base_url("nonsense", None).is_err());
    }

    #[test]
    fn render_shows_every_section() {
        let overview = serde_json::json!({
            "cluster_id": "c1", "term": 3, "leader": "1", "member": "1",
            "members": [{"id": "1", "name": "n1", "role": "leader", "healthy": true}],
            "groups": [{"name": "workers", "leader": "a", "candidates": [{"id": "a", "priority": 5}]}],
            "locks": [{"name": "l", "holder": "l/1", "fence": 7, "waiting": 0}],
            "topics": [{"name": "t", "depth": 2, "last_seq": 2, "consumers": []}],
            "rates": {"puts_total": 5, "samples": [{"puts_per_s": 2.0, "put_latency_ms": 1.5}]},
        });
        let screen = render(&overview, &Output::new(false));
        for needle in ["n1", "leader", "workers", "a(5)", "l/1", "puts/s 2"] {
            assert!(screen.contains(needle), "{needle} missing from:\n{screen}");
        }
    }
}
