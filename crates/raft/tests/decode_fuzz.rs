//! The core's own decoder, fuzzed: `ConfChange::decode` reads entry data that a peer's Append
//! carries, so no byte string may make it panic, and what `encode` writes must come back.
//!
//! `CONCLAVE_FUZZ_CASES` sets the number of cases (default: a CI-sized run of a few seconds).

use conclave_raft::{ConfChange, ConfChangeStep};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

/// Cases per property in CI; each is microseconds.
const CI_CASES: u32 = 20_000;

#[allow(
    clippy::disallowed_methods,
    reason = "tests read the fuzz budget from the environment"
)]
fn cases() -> u32 {
    std::env::var("CONCLAVE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CI_CASES)
}

fn step() -> impl Strategy<Value = ConfChangeStep> {
    let id = prop_oneof![Just(0u64), Just(1), Just(u64::MAX), any::<u64>()];
    (0u8..3, id).prop_map(|(kind, id)| match kind {
        0 => ConfChangeStep::AddVoter(id),
        1 => ConfChangeStep::AddLearner(id),
        _ => ConfChangeStep::RemoveNode(id),
    })
}

fn change() -> impl Strategy<Value = ConfChange> {
    prop_oneof![
        Just(ConfChange::Leave),
        prop::collection::vec(step(), 0..20).prop_map(ConfChange::Enter),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        // Whatever decodes is canonical: encoding it gives back the same bytes.
        if let Some(change) = ConfChange::decode(&bytes) {
            let encoded = change.encode();
            prop_assert_eq!(&encoded[..], &bytes[..]);
        }
    }

    #[test]
    fn encode_then_decode_round_trips(change in change()) {
        prop_assert_eq!(ConfChange::decode(&change.encode()), Some(change));
    }

    /// A valid encoding with one byte changed, cut short or extended (the count field
    /// included, so lengths lie) never panics the decoder.
    #[test]
    fn mutated_encodings_never_panic_the_decoder(
        change in change(),
        position in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        cut in any::<prop::sample::Index>(),
        tail in prop::collection::vec(any::<u8>(), 0..20),
    ) {
        let mut bytes = change.encode().to_vec();
        let at = position.index(bytes.len());
        bytes[at] = byte;
        let _ = ConfChange::decode(&bytes);
        let _ = ConfChange::decode(&bytes[..cut.index(bytes.len() + 1)]);
        bytes.extend_from_slice(&tail);
        let _ = ConfChange::decode(&bytes);
    }
}
