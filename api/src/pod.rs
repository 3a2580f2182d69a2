//! How gpupool reads a pod: which class and role it asks for, and how many
//! slots it requests. The webhook, the operator, the device plugin and the
//! simulator's scheduler all use these, so they never disagree.

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::lease::Role;
use crate::names::{LABEL_CLASS, LABEL_ROLE};

/// A pod whose gpupool labels or resource requests cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodError {
    /// The role label holds something other than `primary` or `helper`.
    #[error("label gpupool.io/role must be \"primary\" or \"helper\", not {0:?}")]
    BadRole(String),
    /// An extended-resource quantity is not a whole number.
    #[error(
        "container {container:?} requests {resource} = {quantity:?}: GPU slots are whole numbers"
    )]
    FractionalSlots {
        /// Container that holds the request.
        container: String,
        /// Resource it requests.
        resource: String,
        /// The quantity as written.
        quantity: String,
    },
    /// The pod requests more slots than any node could ever advertise.
    #[error(
        "the pod requests {slots} {resource} slots; at most {} can be requested",
        u32::MAX
    )]
    TooManySlots {
        /// Resource it requests.
        resource: String,
        /// Slots it requests.
        slots: u64,
    },
}

/// The pod's role, from its `gpupool.io/role` label (absent = primary).
pub fn role(pod: &Pod) -> Result<Role, PodError> {
    match pod.metadata.labels.as_ref().and_then(|l| l.get(LABEL_ROLE)) {
        None => Ok(Role::Primary),
        Some(v) if v == "primary" => Ok(Role::Primary),
        Some(v) if v == "helper" => Ok(Role::Helper),
        Some(v) => Err(PodError::BadRole(v.clone())),
    }
}

/// The class the pod names with `gpupool.io/class`, if any.
pub fn class_label(pod: &Pod) -> Option<&str> {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_CLASS))
        .map(String::as_str)
}

/// True when any container or init container mentions `resource` in its
/// requests or limits.
pub fn mentions_resource(spec: &PodSpec, resource: &str) -> bool {
    all_containers(spec).any(|c| {
        c.resources.as_ref().is_some_and(|r| {
            r.requests
                .as_ref()
                .is_some_and(|m| m.contains_key(resource))
                || r.limits.as_ref().is_some_and(|m| m.contains_key(resource))
        })
    })
}

/// Slots of `resource` the pod needs, computed as kubelet does for its
/// effective request: the larger of what the app containers (plus sidecar init
/// containers) need together and what the largest regular init container needs
/// alone. Requests default to limits for extended resources.
pub fn requested_slots(spec: &PodSpec, resource: &str) -> Result<u32, PodError> {
    let mut long_running: u64 = 0;
    let mut largest_init: u64 = 0;
    for c in &spec.containers {
        long_running = long_running.saturating_add(container_slots(c, resource)?);
    }
    for c in spec.init_containers.iter().flatten() {
        let n = container_slots(c, resource)?;
        if c.restart_policy.as_deref() == Some("Always") {
            long_running = long_running.saturating_add(n);
        } else {
            largest_init = largest_init.max(n);
        }
    }
    let slots = long_running.max(largest_init);
    u32::try_from(slots).map_err(|_| PodError::TooManySlots {
        resource: resource.to_owned(),
        slots,
    })
}

/// Slots one container requests (requests, else limits).
pub fn container_slots(c: &Container, resource: &str) -> Result<u64, PodError> {
    let Some(res) = c.resources.as_ref() else {
        return Ok(0);
    };
    let q = res
        .requests
        .as_ref()
        .and_then(|m| m.get(resource))
        .or_else(|| res.limits.as_ref().and_then(|m| m.get(resource)));
    match q {
        None => Ok(0),
        Some(q) => parse_whole(q).ok_or_else(|| PodError::FractionalSlots {
            container: c.name.clone(),
            resource: resource.to_owned(),
            quantity: q.0.clone(),
        }),
    }
}

fn all_containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
}

/// Parses a Kubernetes quantity that is a whole, non-negative number, in
/// any of its spellings: plain (`2`, `+1`, `2.0`), decimal or binary suffixes
/// (`1k`, `1T`, `3Ki`, `2000m`) and exponents (`1e9`, `1E3`). `None` for
/// anything fractional, negative, malformed or beyond `u64`: extended
/// resources are whole numbers.
pub fn parse_whole(q: &Quantity) -> Option<u64> {
    let s = q.0.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return None;
    }
    let (mut exp10, binary): (i32, u32) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        exp if exp.starts_with(['e', 'E']) => {
            let e = &exp[1..];
            let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            (e.parse().ok()?, 0)
        }
        _ => return None,
    };
    // The number's digits as one integer, the fraction moved into the exponent.
    let digits = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return Some(0);
    }
    exp10 -= i32::try_from(frac.len()).ok()?;
    let mut value: u128 = digits.parse().ok()?;
    value = value.checked_mul(1u128.checked_shl(binary)?)?;
    if exp10 >= 0 {
        value = value.checked_mul(10u128.checked_pow(exp10.unsigned_abs())?)?;
    } else {
        let divisor = 10u128.checked_pow(exp10.unsigned_abs())?;
        if !value.is_multiple_of(divisor) {
            return None;
        }
        value /= divisor;
    }
    u64::try_from(value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_quantities_in_every_spelling() {
        let q = |s: &str| parse_whole(&Quantity(s.to_owned()));
        for (text, want) in [
            ("0", Some(0)),
            ("2", Some(2)),
            ("+1", Some(1)),
            ("2.0", Some(2)),
            ("1e9", Some(1_000_000_000)),
            ("1E3", Some(1000)),
            ("1e+2", Some(100)),
            ("1k", Some(1000)),
            ("1T", Some(1_000_000_000_000)),
            ("3Ki", Some(3072)),
            ("1Ti", Some(1 << 40)),
            ("2000m", Some(2)),
            ("1.5k", Some(1500)),
            ("0.5", None),
            ("1500m", None),
            ("1e-1", None),
            ("-1", None),
            ("1x", None),
            ("", None),
            (".", None),
            ("1.2.3", None),
            ("1e", None),
            ("20E", None),
            ("4294967296", Some(4_294_967_296)),
        ] {
            assert_eq!(q(text), want, "{text:?}");
        }
    }

    #[test]
    fn more_slots_than_u32_is_an_error_naming_the_number() {
        let spec = PodSpec {
            containers: vec![Container {
                name: "a".into(),
                resources: Some(k8s_openapi::api::core::v1::ResourceRequirements {
                    limits: Some(std::collections::BTreeMap::from([(
                        "gpupool/slot".to_owned(),
                        Quantity("4294967296".into()),
                    )])),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let e = requested_slots(&spec, "gpupool/slot").expect_err("too many");
        assert_eq!(
            e.to_string(),
            "the pod requests 4294967296 gpupool/slot slots; at most 4294967295 can be requested"
        );
    }
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use std::collections::BTreeMap;

    fn container(name: &str, req: Option<&str>, lim: Option<&str>) -> Container {
        let map = |v: Option<&str>| {
            v.map(|v| BTreeMap::from([("gpupool/slot".to_owned(), Quantity(v.to_owned()))]))
        };
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                requests: map(req),
                limits: map(lim),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn sums_containers_and_takes_max_with_init() {
        let spec = PodSpec {
            containers: vec![
                container("a", Some("1"), Some("1")),
                container("b", None, Some("2")),
            ],
            init_containers: Some(vec![container("i", Some("4"), Some("4"))]),
            ..Default::default()
        };
        assert!(mentions_resource(&spec, "gpupool/slot"));
        assert_eq!(requested_slots(&spec, "gpupool/slot"), Ok(4));
        assert_eq!(requested_slots(&spec, "other/x"), Ok(0));
    }

    #[test]
    fn sidecar_init_containers_add_to_the_app_containers() {
        let mut sidecar = container("s", Some("1"), Some("1"));
        sidecar.restart_policy = Some("Always".into());
        let spec = PodSpec {
            containers: vec![container("a", Some("2"), Some("2"))],
            init_containers: Some(vec![sidecar]),
            ..Default::default()
        };
        assert_eq!(requested_slots(&spec, "gpupool/slot"), Ok(3));
    }

    #[test]
    fn fractional_slots_name_the_container() {
        let spec = PodSpec {
            containers: vec![container("train", Some("500m"), None)],
            ..Default::default()
        };
        let err = requested_slots(&spec, "gpupool/slot").expect_err("fractional");
        assert!(
            err.to_string().contains("train") && err.to_string().contains("500m"),
            "{err}"
        );
    }

    #[test]
    fn role_label_values() {
        let mut pod = Pod::default();
        assert_eq!(role(&pod), Ok(Role::Primary));
        pod.metadata.labels = Some(BTreeMap::from([(
            LABEL_ROLE.to_owned(),
            "helper".to_owned(),
        )]));
        assert_eq!(role(&pod), Ok(Role::Helper));
        pod.metadata.labels = Some(BTreeMap::from([(LABEL_ROLE.to_owned(), "boss".to_owned())]));
        assert_eq!(role(&pod), Err(PodError::BadRole("boss".into())));
    }
}
