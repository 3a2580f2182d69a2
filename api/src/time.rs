//! The enqueue stamp's wire format (DESIGN §2: RFC 3339 with microseconds).

use jiff::Timestamp;

/// Why an enqueue stamp could not be read.
#[derive(Debug, thiserror::Error)]
#[error("annotation {annotation} is not an RFC 3339 time: {value:?} ({source})")]
pub struct StampError {
    /// The annotation that held the value.
    pub annotation: &'static str,
    /// The value as found.
    pub value: String,
    /// What the parser said.
    #[source]
    pub source: jiff::Error,
}

/// Formats `t` as RFC 3339 in UTC with exactly six fractional digits, so that
/// stamps sort as strings the same way they sort as times.
pub fn format_micros(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%S.%6fZ").to_string()
}

/// Parses an enqueue stamp written by [`format_micros`] (or any RFC 3339 time).
pub fn parse_stamp(value: &str) -> Result<Timestamp, StampError> {
    value.parse::<Timestamp>().map_err(|source| StampError {
        annotation: crate::names::ANNOTATION_ENQUEUED_AT,
        value: value.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros_round_trip_and_sort_as_strings() {
        let a = Timestamp::from_microsecond(1_700_000_000_000_001).expect("valid");
        let b = Timestamp::from_microsecond(1_700_000_000_100_000).expect("valid");
        let (sa, sb) = (format_micros(a), format_micros(b));
        assert_eq!(sa, "2023-11-14T22:13:20.000001Z");
        assert!(sa < sb);
        assert_eq!(parse_stamp(&sa).expect("parses"), a);
    }

    #[test]
    fn garbage_is_an_error_naming_the_annotation() {
        let err = parse_stamp("yesterday").expect_err("not a time");
        let msg = err.to_string();
        assert!(msg.contains("gpupool.io/enqueued-at"), "{msg}");
        assert!(msg.contains("yesterday"), "{msg}");
    }
}
