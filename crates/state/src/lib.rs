//! conclave-state (under construction).
