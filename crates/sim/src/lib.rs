//! conclave-sim (under construction).
