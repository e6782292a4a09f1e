//! `conclave member add|remove|promote` against a real 3-node cluster.

mod cli_support;
mod common;

use cli_support::run;
use common::Cluster;

#[tokio::test(flavor = "multi_thread")]
async fn member_add_promote_remove_in_both_output_modes() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let peer = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .expect("a free port");

    let added = run(
        eps,
        &[
            "member",
            "add",
            "n4",
            "--peer-url",
            &format!("http://{peer}"),
            "--learner",
            "--json",
        ],
    )
    .data();
    assert_eq!(added["member"]["learner"], true, "{added}");
    let id = added["member"]["id"].as_str().expect("id").to_string();
    let flags: Vec<String> = added["serve_flags"]
        .as_array()
        .map(|f| {
            f.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    assert!(flags.contains(&"existing".to_string()), "{added}");
    assert!(
        flags.iter().any(|f| f.ends_with(&format!("={peer}"))),
        "{added}"
    );

    let list = run(eps, &["member", "list", "--json"]).data();
    assert_eq!(list["members"].as_array().map(Vec::len), Some(4));
    assert!(run(eps, &["member", "list"]).ok().contains("learner"));

    // A learner that never started has none of the log: the server refuses to promote it
    // (etcd's catch-up check), and the CLI answers with one error document.
    let promoted = run(eps, &["member", "promote", &id, "--json"]);
    promoted.assert_error("invalid_argument", 2);
    assert!(
        promoted.json()["message"]
            .as_str()
            .is_some_and(|m| m.contains("in sync with leader")),
        "{promoted:?}"
    );
    run(eps, &["member", "promote", "nobody", "--json"]).assert_error("not_found", 3);

    let removed = run(eps, &["member", "remove", &id]);
    assert!(removed.ok().contains("removed"), "{removed:?}");
    let list = run(eps, &["member", "list", "--json"]).data();
    assert_eq!(list["members"].as_array().map(Vec::len), Some(3));
    run(
        eps,
        &["member", "add", "n5", "--peer-url", "nohost", "--json"],
    )
    .assert_error("invalid_argument", 2);
}
