//! Majority arithmetic for plain and joint configurations.

use std::collections::{BTreeMap, BTreeSet};

use crate::types::{ConfState, Index, NodeId};

/// The outcome of a vote so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VoteResult {
    Won,
    Lost,
    Pending,
}

/// The highest index acknowledged by a majority of `voters`, given each voter's acknowledged
/// index (absent voters count as 0). An empty voter set imposes no constraint.
fn majority_index(voters: &BTreeSet<NodeId>, acked: &dyn Fn(NodeId) -> Index) -> Index {
    if voters.is_empty() {
        return Index::MAX;
    }
    let mut indexes: Vec<Index> = voters.iter().map(|&id| acked(id)).collect();
    indexes.sort_unstable_by(|a, b| b.cmp(a));
    indexes[voters.len() / 2]
}

/// The highest index committed by the configuration: a majority of each half when joint.
pub fn committed_index(conf: &ConfState, acked: &dyn Fn(NodeId) -> Index) -> Index {
    let incoming = majority_index(&conf.voters, acked);
    let outgoing = majority_index(&conf.voters_outgoing, acked);
    incoming.min(outgoing)
}

fn majority_vote(voters: &BTreeSet<NodeId>, votes: &BTreeMap<NodeId, bool>) -> VoteResult {
    if voters.is_empty() {
        return VoteResult::Won;
    }
    let (mut yes, mut missing) = (0, 0);
    for id in voters {
        match votes.get(id) {
            Some(true) => yes += 1,
            Some(false) => {}
            None => missing += 1,
        }
    }
    let quorum = voters.len() / 2 + 1;
    if yes >= quorum {
        VoteResult::Won
    } else if yes + missing >= quorum {
        VoteResult::Pending
    } else {
        VoteResult::Lost
    }
}

/// Tallies `votes` (true = granted) against the configuration: joint needs both halves.
pub fn vote_result(conf: &ConfState, votes: &BTreeMap<NodeId, bool>) -> VoteResult {
    let incoming = majority_vote(&conf.voters, votes);
    let outgoing = majority_vote(&conf.voters_outgoing, votes);
    match (incoming, outgoing) {
        (VoteResult::Won, VoteResult::Won) => VoteResult::Won,
        (VoteResult::Lost, _) | (_, VoteResult::Lost) => VoteResult::Lost,
        _ => VoteResult::Pending,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_index_takes_the_median_of_each_half() {
        let conf = ConfState::with_voters([1, 2, 3]);
        let acked = |id: NodeId| [0, 5, 7, 9][id as usize];
        assert_eq!(committed_index(&conf, &acked), 7);
        let mut joint = ConfState::with_voters([1, 2, 3]);
        joint.voters_outgoing = [1, 4, 5].into_iter().collect();
        let acked = |id: NodeId| [0, 9, 9, 9, 1, 2][id as usize];
        assert_eq!(committed_index(&joint, &acked), 2);
    }

    #[test]
    fn joint_votes_need_both_halves() {
        let mut joint = ConfState::with_voters([1, 2, 3]);
        joint.voters_outgoing = [3, 4, 5].into_iter().collect();
        let mut votes = BTreeMap::new();
        votes.insert(1, true);
        votes.insert(2, true);
        assert_eq!(vote_result(&joint, &votes), VoteResult::Pending);
        votes.insert(4, false);
        votes.insert(5, false);
        assert_eq!(vote_result(&joint, &votes), VoteResult::Lost);
        votes.insert(5, true);
        votes.insert(3, true);
        assert_eq!(vote_result(&joint, &votes), VoteResult::Won);
    }
}
