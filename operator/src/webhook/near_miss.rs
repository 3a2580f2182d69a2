//! Near misses: a pod that asks for a resource no class hands out, but
//! which looks meant for one (`gpupool/slots` for `gpupool/slot`). Such a
//! pod would otherwise be created untouched, get no lease and stay Pending
//! for good with nothing said; the webhook tells its creator instead.

/// A resource the pod asks for that no class hands out, with the class
/// resources it resembles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NearMiss {
    /// What the pod asks for.
    pub requested: String,
    /// The class resources it resembles, sorted.
    pub meant: Vec<String>,
}

/// The first resource of `requested` (domain-qualified names the pod asks
/// for) that is not one of `handed_out` but shares a domain with one, or
/// is one edit (insertion, deletion or substitution) away from one.
pub fn find(requested: &[&str], handed_out: &[&str]) -> Option<NearMiss> {
    requested
        .iter()
        .filter(|r| !handed_out.contains(r))
        .find_map(|r| {
            let mut meant: Vec<String> = handed_out
                .iter()
                .filter(|h| same_domain(r, h) || one_edit_apart(r, h))
                .map(|h| (*h).to_owned())
                .collect();
            meant.sort_unstable();
            meant.dedup();
            (!meant.is_empty()).then(|| NearMiss {
                requested: (*r).to_owned(),
                meant,
            })
        })
}

fn same_domain(a: &str, b: &str) -> bool {
    match (a.split_once('/'), b.split_once('/')) {
        (Some((da, _)), Some((db, _))) => da == db,
        _ => false,
    }
}

/// True when `a` and `b` differ by exactly one inserted, deleted or
/// substituted character.
fn one_edit_apart(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let (short, long) = if a.len() <= b.len() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    if long.len() - short.len() > 1 {
        return false;
    }
    let prefix = short
        .iter()
        .zip(long.iter())
        .take_while(|(x, y)| x == y)
        .count();
    if short.len() == long.len() {
        // One substitution: everything after the first difference matches.
        prefix < short.len() && short[prefix + 1..] == long[prefix + 1..]
    } else {
        // One insertion into the shorter.
        short[prefix..] == long[prefix + 1..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_or_a_sibling_in_the_domain_is_a_near_miss() {
        let classes = ["gpupool/slot", "example.com/gpu"];
        for (asked, meant) in [
            ("gpupool/slots", vec!["gpupool/slot"]),
            ("gpupool/slt", vec!["gpupool/slot"]),
            ("gpupol/slot", vec!["gpupool/slot"]),
            ("gpupool/other", vec!["gpupool/slot"]),
            ("example.com/gpus", vec!["example.com/gpu"]),
        ] {
            let miss = find(&[asked], &classes).expect(asked);
            assert_eq!(miss.requested, asked);
            assert_eq!(miss.meant, meant, "{asked}");
        }
    }

    #[test]
    fn exact_and_unrelated_resources_are_not() {
        let classes = ["gpupool/slot"];
        assert_eq!(find(&["gpupool/slot"], &classes), None);
        assert_eq!(find(&["nvidia.com/gpu"], &classes), None);
        assert_eq!(find(&["gpupool/slot", "vendor.io/fpga"], &classes), None);
        assert_eq!(find(&["gpupool/slot"], &[]), None);
    }

    #[test]
    fn one_edit_means_exactly_one() {
        assert!(one_edit_apart("abc", "abd"));
        assert!(one_edit_apart("abc", "abxc"));
        assert!(one_edit_apart("abc", "ab"));
        assert!(!one_edit_apart("abc", "abc"));
        assert!(!one_edit_apart("abc", "axd"));
        assert!(!one_edit_apart("abc", "a"));
        assert!(!one_edit_apart("ab", "ba"));
    }
}
