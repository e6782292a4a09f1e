//! The partition plans cut what they say they cut.

use conclave_faults::nemesis::partition_plan;
use conclave_faults::net::Mode;
use conclave_faults::rng::Rng;

#[test]
fn partition_plans_have_the_shape_they_describe() {
    let mut seen = std::collections::BTreeSet::new();
    for n in [3usize, 5] {
        let mut rng = Rng::new(n as u64);
        for _ in 0..400 {
            let (what, cuts) = partition_plan(n, Some(0), &mut rng, Mode::Namespaces);
            assert!(!cuts.is_empty(), "{what}");
            assert!(
                cuts.iter().all(|&(a, b)| a < n && b < n && a != b),
                "{what}: {cuts:?}"
            );
            let cut = |a: usize, b: usize| cuts.contains(&(a, b));
            let kind = what
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
            match kind.as_str() {
                "leader" => {
                    // Member 1 (index 0) leads: it neither hears nor reaches anyone.
                    assert!((1..n).all(|m| cut(0, m) && cut(m, 0)), "{what}");
                    assert!(cuts.iter().all(|&(a, b)| a == 0 || b == 0), "{what}");
                }
                "minority" => {
                    let inside =
                        &what[what.find('[').expect("a list") + 1..what.find(']').expect("a list")];
                    let minority: Vec<usize> = inside
                        .split(',')
                        .filter_map(|m| m.trim().parse::<usize>().ok())
                        .map(|m| m - 1)
                        .collect();
                    assert!(
                        !minority.is_empty() && minority.len() < n.div_ceil(2),
                        "{what}"
                    );
                    for a in 0..n {
                        for b in (0..n).filter(|&b| b != a) {
                            let across = minority.contains(&a) != minority.contains(&b);
                            assert_eq!(cut(a, b), across, "{what}: {a}->{b} in {cuts:?}");
                        }
                    }
                }
                "member" => {
                    // One way: exactly one member hears no one, and it may still send.
                    let deaf: Vec<usize> = (0..n)
                        .filter(|&m| (0..n).filter(|&o| o != m).all(|o| cut(o, m)))
                        .collect();
                    assert_eq!(deaf.len(), 1, "{what}");
                    assert!(cuts.iter().all(|&(_, b)| b == deaf[0]), "{what}");
                }
                "bridge" => {
                    let bridge: usize = what
                        .split_whitespace()
                        .nth(2)
                        .and_then(|s| s.parse::<usize>().ok())
                        .expect("a bridge member")
                        - 1;
                    assert!(
                        cuts.iter().all(|&(a, b)| a != bridge && b != bridge),
                        "{what}"
                    );
                    // Every cut is symmetric.
                    assert!(cuts.iter().all(|&(a, b)| cut(b, a)), "{what}");
                }
                other => panic!("unknown plan {other}: {what}"),
            }
            seen.insert(kind);
        }
    }
    assert_eq!(seen.len(), 4, "every shape was drawn: {seen:?}");
}
