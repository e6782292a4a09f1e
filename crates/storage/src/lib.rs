//! conclave-storage (under construction).
