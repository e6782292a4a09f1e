//! Hostile input on the disk surface: see `main.rs`.

#[allow(unused_imports)]
use crate::common;
