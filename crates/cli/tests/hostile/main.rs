//! Hostile input against real `conclave serve` processes: raw peers and raw clients built in
//! the test send what no honest member or client would, and every test asserts afterwards that
//! the node still answers, that no acknowledged write was lost or changed, that the node
//! restarts from its data directory, and that its memory stayed bounded.
//!
//! One module per port or surface; `docs/security.md` lists the guards these tests exercise.

#[path = "../common/mod.rs"]
mod common;

mod client;
mod disk;
mod peer;
