//! Hostile input on the peer surface: see `main.rs`.

#[allow(unused_imports)]
use crate::common;
