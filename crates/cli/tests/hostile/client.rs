//! Hostile input on the client surface: see `main.rs`.

#[allow(unused_imports)]
use crate::common;
