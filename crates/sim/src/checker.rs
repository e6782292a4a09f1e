//! Raft's safety invariants, checked against the whole history of a run after every event.
//!
//! Each check keeps just enough history to be incremental: the checkers see every Ready a node
//! handles and every role it takes, and remember what the cluster has ever committed.

use std::collections::BTreeMap;

use conclave_raft::{Entry, HardState, Index, NodeId, Role, Storage, Term};

use crate::node::{AppState, chain_hash};

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub invariant: &'static str,
    pub detail: String,
}

/// The history the checkers keep.
#[derive(Debug, Default)]
pub struct Checker {
    /// ElectionSafety: the leader seen for each term, ever.
    leaders: BTreeMap<Term, NodeId>,
    /// LogMatching: for each (index, term) ever persisted, its data hash and previous term.
    log_entries: BTreeMap<(Index, Term), (u64, Term)>,
    /// StateMachineSafety: the entry applied at each index and the state hash after it.
    applied: BTreeMap<Index, (Term, u64)>,
    /// LeaderCompleteness: for each applied index, the lowest term of a node seen applying it
    /// (the entry was committed in that term or earlier).
    committed_by_term: BTreeMap<Index, Term>,
    /// The state hash of each node's state machine and how far it has applied.
    node_state: BTreeMap<NodeId, AppState>,
    /// Durability: the highest term each node ever reached (across restarts).
    max_term: BTreeMap<NodeId, Term>,
    /// Durability: the vote each node granted in each term.
    votes: BTreeMap<(NodeId, Term), NodeId>,
    /// Read safety: the commit index known cluster-wide when each read began.
    reads: BTreeMap<(NodeId, Vec<u8>), Index>,
    /// The highest index known committed anywhere.
    pub max_committed: Index,
    pub violations: Vec<Violation>,
}

impl Checker {
    fn fail(&mut self, invariant: &'static str, detail: String) {
        self.violations.push(Violation { invariant, detail });
    }

    /// A node is observed in `role` at `term` (after an event touched it).
    pub fn observe_role(&mut self, node: NodeId, role: Role, term: Term) {
        let max = self.max_term.entry(node).or_insert(0);
        if term < *max {
            let detail = format!("node {node} went from term {max} back to {term}");
            self.fail("Durability(term)", detail);
        } else {
            *max = term;
        }
        if role == Role::Leader {
            match self.leaders.get(&term) {
                Some(&other) if other != node => {
                    let detail = format!("nodes {other} and {node} both led term {term}");
                    self.fail("ElectionSafety", detail);
                }
                Some(_) => {}
                None => {
                    self.leaders.insert(term, node);
                }
            }
        }
    }

    /// A node just became leader: its log must hold every entry known committed.
    pub fn check_leader_completeness(&mut self, node: NodeId, term: Term, log: &LogView<'_>) {
        let first = log.first_index;
        // Only entries committed in an earlier term must be there: a stale candidate may still
        // win an old term after later terms committed more.
        let missing: Option<(Index, Term, Option<Term>)> = self
            .applied
            .range(first..)
            .filter(|(index, _)| self.committed_by_term.get(index).is_some_and(|&c| c < term))
            .map(|(&index, &(t, _))| (index, t, log.term(index)))
            .find(|&(_, t, mine)| mine != Some(t));
        if let Some((index, committed_term, mine)) = missing {
            let detail = format!(
                "node {node} leads term {term} but holds {mine:?} at committed index {index} \
                 (committed term {committed_term})"
            );
            self.fail("LeaderCompleteness", detail);
        }
    }

    /// Entries a node made durable.
    pub fn observe_persisted(&mut self, node: NodeId, entries: &[Entry], prev_term: Option<Term>) {
        let mut prev = prev_term;
        for entry in entries {
            let data_hash = chain_hash(0, entry);
            let prev_t = prev.unwrap_or(u64::MAX);
            match self.log_entries.get(&(entry.index, entry.term)) {
                Some(&(h, p)) => {
                    let prev_differs = prev.is_some() && p != u64::MAX && p != prev_t;
                    if h != data_hash || prev_differs {
                        let detail = format!(
                            "node {node} holds a different entry or prefix at ({}, {})",
                            entry.index, entry.term
                        );
                        self.fail("LogMatching", detail);
                    }
                }
                None => {
                    self.log_entries
                        .insert((entry.index, entry.term), (data_hash, prev_t));
                }
            }
            prev = Some(entry.term);
        }
    }

    /// A node restarted or installed a snapshot: its state machine now stands at `state`.
    pub fn reset_state(&mut self, node: NodeId, state: AppState) {
        if state.applied > 0
            && let Some(&(_, hash)) = self.applied.get(&state.applied)
            && hash != state.hash
        {
            let detail = format!(
                "node {node} restored a state at {} that no one applied",
                state.applied
            );
            self.fail("StateMachineSafety", detail);
        }
        self.node_state.insert(node, state);
    }

    /// A node applied `entry`, reaching state hash `hash`.
    pub fn observe_applied(&mut self, node: NodeId, node_term: Term, entry: &Entry, hash: u64) {
        let by_term = self
            .committed_by_term
            .entry(entry.index)
            .or_insert(node_term);
        *by_term = (*by_term).min(node_term);
        let before = self.node_state.get(&node).map_or(0, |s| s.applied);
        if entry.index != before + 1 {
            let detail = format!("node {node} applied {} after {before}", entry.index);
            self.fail("StateMachineSafety(order)", detail);
        }
        self.node_state.insert(
            node,
            AppState {
                applied: entry.index,
                hash,
            },
        );
        match self.applied.get(&entry.index) {
            Some(&(term, h)) if term != entry.term || h != hash => {
                let detail = format!(
                    "node {node} applied ({}, term {}) but another node applied term {term} there",
                    entry.index, entry.term
                );
                self.fail("StateMachineSafety", detail);
            }
            Some(_) => {}
            None => {
                self.applied.insert(entry.index, (entry.term, hash));
            }
        }
        self.max_committed = self.max_committed.max(entry.index);
    }

    /// A node's commit index: everything up to it is committed.
    pub fn observe_commit(&mut self, commit: Index) {
        self.max_committed = self.max_committed.max(commit);
    }

    /// A vote was granted (the response left the node, so it was persisted first).
    pub fn observe_vote(&mut self, voter: NodeId, term: Term, candidate: NodeId) {
        match self.votes.get(&(voter, term)) {
            Some(&previous) if previous != candidate => {
                let detail =
                    format!("node {voter} voted for {previous} and for {candidate} in term {term}");
                self.fail("Durability(vote)", detail);
            }
            Some(_) => {}
            None => {
                self.votes.insert((voter, term), candidate);
            }
        }
    }

    /// A node restarted with `hard_state` from its disk: it must remember every vote it cast
    /// (a vote leaves the node only after it was persisted) and never go back in term.
    pub fn check_restart(&mut self, node: NodeId, hard_state: HardState) {
        let max = self.max_term.get(&node).copied().unwrap_or(0);
        if hard_state.term < max {
            let detail = format!(
                "node {node} restarted at term {} after reaching {max}",
                hard_state.term
            );
            self.fail("Durability(term)", detail);
        }
        if let Some(&cast) = self.votes.get(&(node, hard_state.term))
            && hard_state.vote != Some(cast)
        {
            let detail = format!(
                "node {node} voted for {cast} in term {} but restarted remembering {:?}",
                hard_state.term, hard_state.vote
            );
            self.fail("Durability(vote)", detail);
        }
    }

    /// A read began on `node`: remember what was committed then.
    pub fn read_started(&mut self, node: NodeId, context: &[u8]) {
        self.read_started_at(node, context, self.max_committed);
    }

    /// A read began on `node` when `committed` was the highest index known committed.
    pub fn read_started_at(&mut self, node: NodeId, context: &[u8], committed: Index) {
        self.reads.insert((node, context.to_vec()), committed);
    }

    /// A read was answered at `index`: it must not miss anything committed before it began.
    pub fn read_served(&mut self, node: NodeId, context: &[u8], index: Index) {
        let Some(committed_then) = self.reads.remove(&(node, context.to_vec())) else {
            return;
        };
        if index < committed_then {
            let detail = format!(
                "node {node} served a read at index {index}, but {committed_then} was committed \
                 before the read began"
            );
            self.fail("ReadSafety", detail);
        }
    }

    /// The term of the entry applied at `index`, if any node applied it.
    pub fn applied_term(&self, index: Index) -> Option<Term> {
        self.applied.get(&index).map(|&(term, _)| term)
    }

    pub fn committed_entries(&self) -> usize {
        self.applied.len()
    }
}

/// A read-only view of a node's log for the checkers.
pub struct LogView<'a> {
    pub first_index: Index,
    pub last_index: Index,
    store: &'a dyn Storage,
}

impl<'a> LogView<'a> {
    /// A view of what `store` holds (call after a Ready was persisted).
    pub fn new(store: &'a dyn Storage) -> Self {
        let first_index = store.first_index().unwrap_or(1);
        let last_index = store.last_index().unwrap_or(0);
        LogView {
            first_index,
            last_index,
            store,
        }
    }

    pub fn term(&self, index: Index) -> Option<Term> {
        if index > self.last_index {
            return None;
        }
        self.store.term(index).ok()
    }
}

/// Each checker, fed a fabricated history that breaks its invariant, must report it; and
/// the matching lawful history must pass. These prove the checkers can fail at all.
#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use conclave_raft::{ConfState, EntryKind, MemStorage};

    use super::*;

    fn entry(index: Index, term: Term, data: &'static str) -> Entry {
        Entry {
            index,
            term,
            kind: EntryKind::Normal,
            data: Bytes::from_static(data.as_bytes()),
        }
    }

    fn caught(checker: &Checker, invariant: &str) -> bool {
        checker.violations.iter().any(|v| v.invariant == invariant)
    }

    #[test]
    fn two_leaders_in_one_term_break_election_safety() {
        let mut c = Checker::default();
        c.observe_role(1, Role::Leader, 5);
        c.observe_role(1, Role::Leader, 5);
        c.observe_role(2, Role::Leader, 6);
        assert!(c.violations.is_empty());
        c.observe_role(3, Role::Leader, 5);
        assert!(caught(&c, "ElectionSafety"));
    }

    #[test]
    fn different_entries_at_one_index_and_term_break_log_matching() {
        let mut c = Checker::default();
        c.observe_persisted(1, &[entry(4, 2, "a"), entry(5, 2, "b")], Some(1));
        c.observe_persisted(2, &[entry(4, 2, "a"), entry(5, 2, "b")], Some(1));
        assert!(c.violations.is_empty());
        c.observe_persisted(3, &[entry(5, 2, "c")], Some(2));
        assert!(caught(&c, "LogMatching"));
        let mut c = Checker::default();
        c.observe_persisted(1, &[entry(4, 2, "a")], Some(1));
        c.observe_persisted(2, &[entry(4, 2, "a")], Some(2));
        assert!(
            caught(&c, "LogMatching"),
            "same entry after a different prefix"
        );
    }

    #[test]
    fn divergent_or_out_of_order_applies_break_state_machine_safety() {
        let mut c = Checker::default();
        let (a, b) = (entry(1, 1, "a"), entry(1, 1, "b"));
        c.observe_applied(1, 1, &a, chain_hash(0, &a));
        c.observe_applied(2, 1, &a, chain_hash(0, &a));
        assert!(c.violations.is_empty());
        c.observe_applied(3, 1, &b, chain_hash(0, &b));
        assert!(caught(&c, "StateMachineSafety"));
        let mut c = Checker::default();
        let gap = entry(3, 1, "x");
        c.observe_applied(1, 1, &gap, chain_hash(0, &gap));
        assert!(caught(&c, "StateMachineSafety(order)"));
    }

    #[test]
    fn a_leader_missing_a_committed_entry_breaks_leader_completeness() {
        let mut c = Checker::default();
        let committed = entry(2, 1, "x");
        // Node 1 starts from the bootstrap snapshot at index 1.
        c.reset_state(
            1,
            AppState {
                applied: 1,
                hash: 0,
            },
        );
        c.observe_applied(1, 1, &committed, chain_hash(0, &committed));
        let mut holds = MemStorage::new_with_conf_state(ConfState::with_voters([1, 2, 3]));
        holds.append(std::slice::from_ref(&committed));
        c.check_leader_completeness(2, 2, &LogView::new(&holds));
        assert!(c.violations.is_empty());
        let mut lacks = MemStorage::new_with_conf_state(ConfState::with_voters([1, 2, 3]));
        lacks.append(&[entry(2, 2, "y")]);
        // A stale leader of the same term that committed it is exempt; a later one is not.
        c.check_leader_completeness(3, 1, &LogView::new(&lacks));
        assert!(c.violations.is_empty());
        c.check_leader_completeness(3, 2, &LogView::new(&lacks));
        assert!(caught(&c, "LeaderCompleteness"));
    }

    #[test]
    fn forgotten_votes_and_terms_break_durability() {
        let mut c = Checker::default();
        c.observe_vote(1, 3, 2);
        c.observe_vote(1, 3, 2);
        assert!(c.violations.is_empty());
        c.observe_vote(1, 3, 4);
        assert!(caught(&c, "Durability(vote)"));

        let mut c = Checker::default();
        c.observe_vote(1, 3, 2);
        c.observe_role(1, Role::Follower, 3);
        c.check_restart(
            1,
            HardState {
                term: 3,
                vote: Some(2),
                commit: 0,
            },
        );
        assert!(c.violations.is_empty());
        c.check_restart(
            1,
            HardState {
                term: 3,
                vote: None,
                commit: 0,
            },
        );
        assert!(caught(&c, "Durability(vote)"));
        c.check_restart(
            1,
            HardState {
                term: 2,
                vote: None,
                commit: 0,
            },
        );
        assert!(caught(&c, "Durability(term)"));
        let mut c = Checker::default();
        c.observe_role(1, Role::Follower, 4);
        c.observe_role(1, Role::Follower, 3);
        assert!(caught(&c, "Durability(term)"));
    }

    #[test]
    fn a_read_below_an_earlier_commit_breaks_read_safety() {
        let mut c = Checker::default();
        c.observe_commit(10);
        c.read_started(1, b"ok");
        c.read_served(1, b"ok", 10);
        assert!(c.violations.is_empty());
        c.read_started(1, b"stale");
        c.read_served(1, b"stale", 9);
        assert!(caught(&c, "ReadSafety"));
    }
}
