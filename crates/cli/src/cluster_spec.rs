//! Parsing `--initial-cluster` and `--initial-cluster-clients`, and the CLI's error type.

use conclave_server::Member;

/// Everything that ends the `conclave` process with an error.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad flags: fix the command line.
    #[error("{0}")]
    Usage(String),
    /// The server stopped with an error.
    #[error("{0}")]
    Server(#[from] conclave_server::Error),
    /// A child process or the terminal failed (dev).
    #[error("{0}")]
    Io(String),
}

impl CliError {
    /// Exit codes: 2 for usage errors, 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Server(_) | CliError::Io(_) => 1,
        }
    }
}

fn pairs(spec: &str, flag: &str) -> Result<Vec<(String, String)>, CliError> {
    spec.split(',')
        .filter(|part| !part.trim().is_empty())
        .map(|part| {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| CliError::Usage(format!("{flag}: {part:?} is not KEY=HOST:PORT")))?;
            let value = value
                .trim()
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string();
            if !value.contains(':') {
                return Err(CliError::Usage(format!(
                    "{flag}: address {value:?} of {key:?} has no port"
                )));
            }
            Ok((key.trim().to_string(), value))
        })
        .collect()
}

/// The default client address of a member whose only known address is its peer address:
/// the port below it (the `conclave dev` layout: client 2379, peer 2380).
fn client_from_peer(peer: &str) -> Option<String> {
    let (host, port) = peer.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    Some(format!("{host}:{}", port.checked_sub(1)?))
}

/// The warning an even-sized cluster gets: it tolerates no more failures than the odd size
/// below it, and a partition into halves leaves neither side a quorum.
pub fn even_cluster_warning(voters: usize) -> Option<String> {
    (voters > 0 && voters.is_multiple_of(2)).then(|| {
        format!(
            "a cluster of {voters} members tolerates {} failure(s), no more than one of {} \
             members, and a split into two halves of {} stops both; prefer an odd size",
            voters / 2 - 1,
            voters - 1,
            voters / 2
        )
    })
}

/// `serve --name`'s default: a member left unnamed.
pub const DEFAULT_MEMBER_NAME: &str = "default";

/// Builds the member list. Numeric keys are ids (named `node<id>`, except this member when
/// `--id` and `--name` both name it); other keys are names, numbered 1, 2, ... in list order,
/// which every member computes alike from the same flag.
pub fn parse_members(
    spec: &str,
    clients: Option<&str>,
    self_id: Option<u64>,
    self_name: &str,
    self_client: &str,
) -> Result<Vec<Member>, CliError> {
    let entries = pairs(spec, "--initial-cluster")?;
    if entries.is_empty() {
        return Err(CliError::Usage("--initial-cluster lists no members".into()));
    }
    let client_pairs = match clients {
        Some(clients) => pairs(clients, "--initial-cluster-clients")?,
        None => Vec::new(),
    };
    let mut members = Vec::new();
    for (position, (key, peer_addr)) in entries.into_iter().enumerate() {
        let (id, name) = match key.parse::<u64>() {
            // This member's own --name, when given, beats the generated one: `member add n4`
            // prints `--name n4 --id 4` with numeric keys, and the member must be `n4`.
            Ok(id) if self_id == Some(id) && self_name != DEFAULT_MEMBER_NAME => {
                (id, self_name.to_string())
            }
            Ok(id) => (id, format!("node{id}")),
            Err(_) => (position as u64 + 1, key.clone()),
        };
        let is_self = self_id.map_or(name == self_name, |own| own == id);
        let client_addr = match client_pairs.iter().find(|(k, _)| *k == key) {
            Some((_, addr)) => addr.clone(),
            None if is_self => self_client.to_string(),
            None => client_from_peer(&peer_addr).ok_or_else(|| {
                CliError::Usage(format!(
                    "no client address for member {key:?}: give it in --initial-cluster-clients"
                ))
            })?,
        };
        members.push(Member {
            id,
            name,
            peer_addr,
            client_addr,
        });
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numeric_and_named_members() {
        let members = parse_members(
            "1=127.0.0.1:2380,2=127.0.0.1:2382",
            Some("2=10.0.0.2:9000"),
            Some(1),
            "default",
            "127.0.0.1:2379",
        )
        .expect("valid");
        assert_eq!(members[0].id, 1);
        assert_eq!(members[0].client_addr, "127.0.0.1:2379");
        assert_eq!(members[1].client_addr, "10.0.0.2:9000");
        let named =
            parse_members("a=h:2380,b=http://h:2382", None, None, "b", "h:7").expect("valid");
        assert_eq!((named[1].id, named[1].name.as_str()), (2, "b"));
        assert_eq!(named[1].client_addr, "h:7");
        assert_eq!(named[0].client_addr, "h:2379");
        assert!(parse_members("a", None, None, "a", "h:1").is_err());
        // `member add n4` prints `--name n4 --id 4` and numeric keys.
        let joined = parse_members("1=h:2380,4=h:2386", None, Some(4), "n4", "h:7").expect("ok");
        assert_eq!(joined[1].name, "n4");
        assert_eq!(joined[0].name, "node1");
        let unnamed = parse_members(
            "1=h:2380,4=h:2386",
            None,
            Some(4),
            DEFAULT_MEMBER_NAME,
            "h:7",
        )
        .expect("ok");
        assert_eq!(unnamed[1].name, "node4");
    }

    #[test]
    fn only_even_clusters_are_warned_about() {
        for odd in [1, 3, 5, 7] {
            assert_eq!(even_cluster_warning(odd), None, "{odd}");
        }
        let four = even_cluster_warning(4).expect("a warning");
        assert!(four.contains("tolerates 1 failure"), "{four}");
        assert!(
            even_cluster_warning(2)
                .expect("a warning")
                .contains("tolerates 0")
        );
        assert!(parse_members("a=nohost", None, None, "a", "h:1").is_err());
    }
}
