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
    let peer = format!("127.0.0.1:{}", common::free_port());

    let (added, flags) = cli_support::member_add_learner(eps, "n4", &peer);
    let id = added["member"]["id"].as_str().expect("id").to_string();
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
