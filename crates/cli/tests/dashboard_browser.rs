//! The `/ui` dashboard in a real headless Chromium (Debian's `chromium` and
//! `chromium-driver`, driven over WebDriver with fantoccini): the members and an election
//! group appear, and when the group's leading process is killed the new leader shows on the
//! page within 2 s of the cluster electing it. Screenshots go to the test's scratch directory
//! under target/, or to docs/img/ for docs/operations.md with `CONCLAVE_UPDATE_SCREENSHOTS=1`
//! (so an ordinary test run leaves the tracked images alone).
//!
//! Without `chromedriver` on the PATH this test fails (it does not skip): CI installs it
//! (`.ci/run`), and locally `apt-get install -y chromium chromium-driver`.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, http_get as get};
use serde_json::{Value, json};

/// How long the page may take to show the cluster elected a new group leader.
const PAGE_LAG_MAX: Duration = Duration::from_secs(2);
/// Generous bound for everything else on a shared machine.
const SETTLE: Duration = Duration::from_secs(30);
const GROUP: &str = "workers";

/// Kills a child process when dropped, so a failing assert leaves nothing running.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn chromedriver_path() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("chromedriver"))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "chromedriver is not installed: the dashboard test needs a real headless browser; \
             install it with `apt-get install -y chromium chromium-driver` (.ci/run does)"
        )
    })
}

fn chromium_binary() -> Option<String> {
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .into_iter()
    .find(|path| std::path::Path::new(path).is_file())
    .map(str::to_owned)
}

/// `conclave elect campaign GROUP --id ID --priority P`, holding the seat until killed.
fn campaign(cluster: &Cluster, id: &str, priority: i64) -> Reaped {
    let log = std::fs::File::create(cluster.root.join(format!("campaign-{id}.log")))
        .expect("campaign log");
    let child = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args(["--endpoints", &cluster.endpoints()])
        .args(["elect", "campaign", GROUP, "--id", id])
        .args(["--priority", &priority.to_string(), "--ttl", "2s"])
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone().expect("log handle")))
        .stderr(Stdio::from(log))
        .spawn()
        .expect("start a campaign");
    Reaped(child)
}

/// The group's leader as member 1's overview reports it.
async fn group_leader(cluster: &Cluster) -> Option<String> {
    let url = format!("{}/api/v1/overview", cluster.metrics_url(1));
    let (status, body) = get(&url).await?;
    if status != 200 {
        return None;
    }
    let overview: Value = serde_json::from_str(&body).ok()?;
    overview["groups"]
        .as_array()?
        .iter()
        .find(|g| g["name"] == GROUP)?["leader"]
        .as_str()
        .map(str::to_owned)
}

async fn wait_group_leader(cluster: &Cluster, want: &str) -> Instant {
    let start = Instant::now();
    loop {
        if group_leader(cluster).await.as_deref() == Some(want) {
            return Instant::now();
        }
        assert!(
            start.elapsed() < SETTLE,
            "{want} never led {GROUP}; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the page shows: the member rows (id, role) and the group rows (name, leader).
async fn page_rows(browser: &fantoccini::Client) -> (Vec<(String, String)>, Vec<(String, String)>) {
    let script = r#"
        const rows = (id) => Array.from(document.querySelectorAll('#' + id + ' tbody tr'))
            .filter(r => r.dataset.key)
            .map(r => [r.dataset.key, r.children[id === 'members' ? 2 : 1].textContent]);
        return {members: rows('members'), groups: rows('groups')};
    "#;
    let shown = browser
        .execute(script, vec![])
        .await
        .expect("read the page");
    let pairs = |key: &str| -> Vec<(String, String)> {
        shown[key]
            .as_array()
            .map(|rows| {
                rows.iter()
                    .map(|r| {
                        (
                            r[0].as_str().unwrap_or("").to_owned(),
                            r[1].as_str().unwrap_or("").to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    (pairs("members"), pairs("groups"))
}

async fn screenshot(browser: &fantoccini::Client, name: &str) {
    let png = browser.screenshot().await.expect("screenshot");
    let dir = if std::env::var_os("CONCLAVE_UPDATE_SCREENSHOTS").is_some_and(|v| v == "1") {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/img")
    } else {
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots")
    };
    std::fs::create_dir_all(&dir).expect("the screenshot directory");
    std::fs::write(dir.join(name), png).expect("write the screenshot");
}

#[tokio::test(flavor = "multi_thread")]
async fn dashboard_shows_members_groups_and_a_new_group_leader_within_two_seconds() {
    let driver_path = chromedriver_path();
    let cluster = Cluster::start(3).await;
    cluster.wait_for_leader(SETTLE).await;
    let mut alpha = campaign(&cluster, "alpha", 10);
    wait_group_leader(&cluster, "alpha").await;
    let _beta = campaign(&cluster, "beta", 5);

    let driver_port = common::free_port();
    let _driver = Reaped(
        Command::new(&driver_path)
            .arg(format!("--port={driver_port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver"),
    );
    let mut options = json!({
        "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1500,900"],
    });
    if let Some(binary) = chromium_binary() {
        options["binary"] = json!(binary);
    }
    let mut capabilities = serde_json::Map::new();
    capabilities.insert("goog:chromeOptions".into(), options);
    let webdriver = format!("http://127.0.0.1:{driver_port}");
    let start = Instant::now();
    let browser = loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match fantoccini::ClientBuilder::new(connector)
            .capabilities(capabilities.clone())
            .connect(&webdriver)
            .await
        {
            Ok(browser) => break browser,
            Err(error) => {
                assert!(start.elapsed() < SETTLE, "no browser session: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };

    let url = format!("{}/ui", cluster.metrics_url(1));
    browser.goto(&url).await.expect("open the dashboard");
    let start = Instant::now();
    loop {
        let (members, groups) = page_rows(&browser).await;
        let leaders = members.iter().filter(|(_, role)| role == "leader").count();
        let shows_alpha = groups.iter().any(|(g, l)| g == GROUP && l == "alpha");
        if members.len() == 3 && leaders == 1 && shows_alpha {
            break;
        }
        assert!(
            start.elapsed() < SETTLE,
            "the dashboard never showed 3 members with one leader and {GROUP} led by alpha: \
             {members:?} {groups:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let a few puts show on the chart for the screenshot.
    for n in 0..50 {
        cluster
            .put_until_acked(1, &format!("demo/{n}"), "v", SETTLE)
            .await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    screenshot(&browser, "dashboard.png").await;

    // Kill the leading process: its lease runs out and beta takes the seat.
    let killed = Instant::now();
    let _ = alpha.0.kill();
    let _ = alpha.0.wait();
    let elected = wait_group_leader(&cluster, "beta").await;
    let shown = loop {
        let (_, groups) = page_rows(&browser).await;
        if groups.iter().any(|(g, l)| g == GROUP && l == "beta") {
            break Instant::now();
        }
        assert!(
            elected.elapsed() < PAGE_LAG_MAX + Duration::from_secs(1),
            "the page did not show beta leading {GROUP}: {groups:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let page_lag = shown.saturating_duration_since(elected);
    eprintln!(
        "kill -> elected {:?}, elected -> on the page {:?}",
        elected - killed,
        page_lag
    );
    assert!(
        page_lag <= PAGE_LAG_MAX,
        "the page showed the new leader {page_lag:?} after the cluster elected it"
    );
    screenshot(&browser, "dashboard-failover.png").await;
    let _ = browser.close().await;
}
