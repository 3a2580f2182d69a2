//! Wording shared by what `gpupool-sim` prints: counts with the right
//! plural ("1 GPU", "2 GPUs").

/// `n` followed by `one` when `n` is 1, else by `many`: `count(1, "GPU",
/// "GPUs")` is `"1 GPU"`, `count(0, "slot", "slots")` is `"0 slots"`.
pub fn count(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_is_singular_and_everything_else_plural() {
        assert_eq!(count(0u32, "GPU", "GPUs"), "0 GPUs");
        assert_eq!(count(1u32, "GPU", "GPUs"), "1 GPU");
        assert_eq!(count(2u64, "primary", "primaries"), "2 primaries");
    }
}
