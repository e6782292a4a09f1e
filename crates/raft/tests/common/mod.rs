//! The tiny in-memory network the core's integration tests drive nodes through.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use conclave_raft::{
    ConfState, Config, Entry, EntryKind, MemStorage, Message, RawNode, ReadState, Role,
};

pub struct Net {
    pub nodes: BTreeMap<u64, RawNode<MemStorage>>,
    /// Directed links that drop everything.
    pub cut: BTreeSet<(u64, u64)>,
    /// Every message sent, in order.
    pub sent: Vec<Message>,
    pub read_states: BTreeMap<u64, Vec<ReadState>>,
}

pub fn config(id: u64) -> Config {
    let mut config = Config::new(id);
    config.election_ticks = 10;
    config.heartbeat_ticks = 2;
    config
}

impl Net {
    pub fn new(size: u64) -> Net {
        Net::with_config(size, config)
    }

    /// A fresh cluster of `size` founding members configured by `make`.
    pub fn with_config(size: u64, make: fn(u64) -> Config) -> Net {
        let voters: Vec<u64> = (1..=size).collect();
        let stores = voters
            .iter()
            .map(|&id| {
                (
                    id,
                    MemStorage::new_with_conf_state(ConfState::with_voters(voters.clone())),
                )
            })
            .collect();
        Net::with_stores(stores, make)
    }

    pub fn with_stores(stores: BTreeMap<u64, MemStorage>, make: fn(u64) -> Config) -> Net {
        let nodes = stores
            .into_iter()
            .map(|(id, store)| (id, RawNode::new(make(id), store).expect("valid config")))
            .collect();
        Net {
            nodes,
            cut: BTreeSet::new(),
            sent: Vec::new(),
            read_states: BTreeMap::new(),
        }
    }

    pub fn node(&mut self, id: u64) -> &mut RawNode<MemStorage> {
        self.nodes.get_mut(&id).expect("node exists")
    }

    pub fn isolate(&mut self, id: u64) {
        for &other in self.nodes.keys() {
            if other != id {
                self.cut.insert((id, other));
                self.cut.insert((other, id));
            }
        }
    }

    pub fn heal(&mut self) {
        self.cut.clear();
    }

    /// Handles every Ready (persisting to the node's MemStorage) and returns the messages.
    pub fn collect(&mut self) -> Vec<Message> {
        let mut out = Vec::new();
        for (&id, node) in self.nodes.iter_mut() {
            while node.has_ready() {
                let ready = node.ready();
                let store = node.store_mut();
                if let Some(snapshot) = &ready.snapshot {
                    store.apply_snapshot(snapshot.clone());
                }
                store.append(&ready.entries);
                if let Some(hard_state) = ready.hard_state {
                    store.set_hard_state(hard_state);
                }
                out.extend(ready.messages.iter().cloned());
                self.read_states
                    .entry(id)
                    .or_default()
                    .extend(ready.read_states.iter().cloned());
                node.advance(ready);
            }
        }
        self.sent.extend(out.iter().cloned());
        out
    }

    /// Delivers messages until the network is quiet, passing each through `filter`.
    pub fn settle_with(&mut self, filter: &mut dyn FnMut(&Message) -> bool) {
        for _ in 0..10_000 {
            let messages = self.collect();
            if messages.is_empty() {
                return;
            }
            for m in messages {
                if self.cut.contains(&(m.from, m.to)) || !filter(&m) {
                    continue;
                }
                if let Some(node) = self.nodes.get_mut(&m.to) {
                    let _ = node.step(m);
                }
            }
        }
        panic!("network never went quiet");
    }

    pub fn settle(&mut self) {
        self.settle_with(&mut |_| true);
    }

    pub fn tick_all(&mut self, ticks: u64) {
        for _ in 0..ticks {
            for node in self.nodes.values_mut() {
                node.tick();
            }
            self.settle();
        }
    }

    pub fn leaders(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.role() == Role::Leader)
            .map(|(&id, _)| id)
            .collect()
    }

    pub fn elect(&mut self, id: u64) {
        self.node(id).campaign().expect("the term can grow");
        self.settle();
        assert_eq!(
            self.node(id).role(),
            Role::Leader,
            "node {id} failed to win"
        );
    }
}

pub fn entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        kind: EntryKind::Normal,
        data: Bytes::from(format!("{index}@{term}")),
    }
}
