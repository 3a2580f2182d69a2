//! How gpupool reads a pod: which class and role it asks for, and how many
//! slots it requests. The webhook, the operator, the device plugin and the
//! simulator's scheduler all use these, so they never disagree.
//!
//! The rules read a pod through small traits ([`PodLabels`],
//! [`PodContainers`], [`ContainerFields`]) that a whole `Pod` implements,
//! and so does the operator's trimmed copy of one: each rule is written
//! once for every form a pod is kept in.

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

/// What the rules here read of a pod's labels, whatever form the pod is
/// kept in (a whole `Pod`, or a cache's trimmed copy): the rules are
/// written once, against this, so every form is read alike.
pub trait PodLabels {
    /// The value of label `key`, if the pod has it.
    fn label(&self, key: &str) -> Option<&str>;
}

impl PodLabels for Pod {
    fn label(&self, key: &str) -> Option<&str> {
        self.metadata.labels.as_ref()?.get(key).map(String::as_str)
    }
}

/// A quantity as its writer spelled it, however a form of the pod holds
/// it (a `Quantity`, or a plain string).
pub trait QuantityText {
    /// The quantity as written (`2`, `1k`, `500m`).
    fn text(&self) -> &str;
}

impl QuantityText for Quantity {
    fn text(&self) -> &str {
        &self.0
    }
}

impl QuantityText for str {
    fn text(&self) -> &str {
        self
    }
}

/// What the slot rules read of one container, whatever form the pod is
/// kept in: [`container_request`], [`container_slots`], [`is_sidecar`] and
/// [`effective_request`] read a container only through this.
pub trait ContainerFields {
    /// How this form holds a quantity.
    type Quantity: QuantityText + ?Sized;
    /// The container's name, for errors about its request.
    fn name(&self) -> &str;
    /// What it requests of `resource`, if it names it in its requests.
    fn request(&self, resource: &str) -> Option<&Self::Quantity>;
    /// Its limit of `resource`, if it names it in its limits.
    fn limit(&self, resource: &str) -> Option<&Self::Quantity>;
    /// Its `restartPolicy` (only init containers carry one).
    fn restart_policy(&self) -> Option<&str>;
    /// The name of every resource it requests, then of every one it
    /// limits (a name in both comes twice).
    fn resource_names(&self) -> impl Iterator<Item = &str>;
}

impl ContainerFields for Container {
    type Quantity = Quantity;

    fn name(&self) -> &str {
        &self.name
    }

    fn request(&self, resource: &str) -> Option<&Quantity> {
        self.resources.as_ref()?.requests.as_ref()?.get(resource)
    }

    fn limit(&self, resource: &str) -> Option<&Quantity> {
        self.resources.as_ref()?.limits.as_ref()?.get(resource)
    }

    fn restart_policy(&self) -> Option<&str> {
        self.restart_policy.as_deref()
    }

    fn resource_names(&self) -> impl Iterator<Item = &str> {
        self.resources
            .iter()
            .flat_map(|r| r.requests.iter().chain(r.limits.iter()))
            .flat_map(|m| m.keys())
            .map(String::as_str)
    }
}

/// A pod's containers, as the slot rules read them, whatever form the pod
/// is kept in.
pub trait PodContainers {
    /// How this form holds a container.
    type Container: ContainerFields;
    /// The app containers, in order.
    fn containers(&self) -> impl Iterator<Item = &Self::Container>;
    /// The init containers, in order.
    fn init_containers(&self) -> impl Iterator<Item = &Self::Container>;
}

impl PodContainers for PodSpec {
    type Container = Container;

    fn containers(&self) -> impl Iterator<Item = &Container> {
        self.containers.iter()
    }

    fn init_containers(&self) -> impl Iterator<Item = &Container> {
        self.init_containers.iter().flatten()
    }
}

/// The pod's role, from its `gpupool.io/role` label (absent = primary).
pub fn role(pod: &impl PodLabels) -> Result<Role, PodError> {
    match pod.label(LABEL_ROLE) {
        None | Some("primary") => Ok(Role::Primary),
        Some("helper") => Ok(Role::Helper),
        Some(v) => Err(PodError::BadRole(v.to_owned())),
    }
}

/// The class the pod names with `gpupool.io/class`, if any.
pub fn class_label(pod: &impl PodLabels) -> Option<&str> {
    pod.label(LABEL_CLASS)
}

/// True when any container or init container mentions `resource` in its
/// requests or limits.
pub fn mentions_resource(spec: &impl PodContainers, resource: &str) -> bool {
    spec.containers()
        .chain(spec.init_containers())
        .any(|c| container_request(c, resource).is_some())
}

/// True for a restartable init container (`restartPolicy: Always`): a
/// sidecar, which starts in its turn among the init containers and then
/// runs beside the app containers for the pod's whole life.
pub fn is_sidecar(c: &impl ContainerFields) -> bool {
    c.restart_policy() == Some("Always")
}

/// A pod's effective request of one resource, by Kubernetes' rule (KEP-753,
/// as the scheduler, the kubelet's admission and its resource accounting
/// apply it), given what each container requests (`amount`):
///
/// `max(apps + sidecars, max over each regular init container i of
/// (i's request + the sidecars declared before i))`
///
/// where `apps` sums the app containers and `sidecars` every sidecar init
/// container (see [`is_sidecar`]). Sums saturate at `u64::MAX` rather than
/// wrap. The first error `amount` returns is returned, so a caller that
/// parses quantities reports the first container it cannot read.
pub fn effective_request<S: PodContainers + ?Sized, E>(
    spec: &S,
    mut amount: impl FnMut(&S::Container) -> Result<u64, E>,
) -> Result<u64, E> {
    let mut long_running: u64 = 0;
    for c in spec.containers() {
        long_running = long_running.saturating_add(amount(c)?);
    }
    // Sidecars started so far: they keep running while a later regular
    // init container runs, so its turn needs both.
    let mut sidecars_before: u64 = 0;
    let mut init_peak: u64 = 0;
    for c in spec.init_containers() {
        let n = amount(c)?;
        if is_sidecar(c) {
            sidecars_before = sidecars_before.saturating_add(n);
            long_running = long_running.saturating_add(n);
        } else {
            init_peak = init_peak.max(sidecars_before.saturating_add(n));
        }
    }
    Ok(long_running.max(init_peak))
}

/// Slots of `resource` the pod needs: its [`effective_request`], as
/// Kubernetes counts it, with each container's request read by
/// [`container_slots`] (requests, else limits, as the API server defaults
/// them for extended resources). Errors: [`PodError::FractionalSlots`]
/// naming the first container whose quantity is not a whole number, and
/// [`PodError::TooManySlots`] when the total exceeds `u32::MAX`.
pub fn requested_slots(spec: &impl PodContainers, resource: &str) -> Result<u32, PodError> {
    let slots = effective_request(spec, |c| container_slots(c, resource))?;
    u32::try_from(slots).map_err(|_| PodError::TooManySlots {
        resource: resource.to_owned(),
        slots,
    })
}

/// The quantity one container requests of `resource`: its request, else its
/// limit (the API server defaults a missing request to the limit); `None`
/// when it names the resource in neither.
pub fn container_request<'a, C: ContainerFields + ?Sized>(
    c: &'a C,
    resource: &str,
) -> Option<&'a C::Quantity> {
    c.request(resource).or_else(|| c.limit(resource))
}

/// Slots one container requests of `resource` (requests, else limits; 0
/// when it names neither). Error: [`PodError::FractionalSlots`] when the
/// quantity is not a whole, non-negative number.
pub fn container_slots(
    c: &(impl ContainerFields + ?Sized),
    resource: &str,
) -> Result<u64, PodError> {
    match container_request(c, resource) {
        None => Ok(0),
        Some(q) => whole(q.text()).ok_or_else(|| PodError::FractionalSlots {
            container: c.name().to_owned(),
            resource: resource.to_owned(),
            quantity: q.text().to_owned(),
        }),
    }
}

/// Parses a Kubernetes quantity that is a whole, non-negative number, in
/// any of its spellings: plain (`2`, `+1`, `2.0`), decimal or binary suffixes
/// (`1k`, `1T`, `3Ki`, `2000m`) and exponents (`1e9`, `1E3`). `None` for
/// anything fractional, negative, malformed or beyond `u64`: extended
/// resources are whole numbers.
pub fn parse_whole(q: &Quantity) -> Option<u64> {
    whole(&q.0)
}

/// [`parse_whole`] of a quantity as written, for the forms of a pod that
/// keep quantities as plain strings.
fn whole(text: &str) -> Option<u64> {
    scaled(text, 0, Rounding::Exact)
}

/// Parses a non-negative Kubernetes quantity (every spelling
/// [`parse_whole`] reads) in thousandths, rounding up as Kubernetes'
/// `MilliValue` does: `1` is 1000, `100m` is 100, `0.5` is 500, `1n` is 1.
/// This is how CPU is counted. `None` for a negative or malformed quantity
/// or one beyond `u64` thousandths.
pub fn parse_milli(q: &Quantity) -> Option<u64> {
    scaled(&q.0, 3, Rounding::Up)
}

/// Parses a non-negative Kubernetes quantity (every spelling
/// [`parse_whole`] reads) as a whole number, rounding a fraction up as
/// Kubernetes' `Value` does: `1.5` is 2, `64Gi` is 68719476736. This is how
/// memory, storage and pods are counted. `None` for a negative or malformed
/// quantity or one beyond `u64`.
pub fn parse_ceil(q: &Quantity) -> Option<u64> {
    scaled(&q.0, 0, Rounding::Up)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Rounding {
    /// A fraction is no value at all.
    Exact,
    /// A fraction counts as the next whole unit.
    Up,
}

/// The quantity times `10^scale`, as a whole number rounded as asked.
fn scaled(q: &str, scale: i32, rounding: Rounding) -> Option<u64> {
    let s = q.trim();
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
    // The number's digits as one integer, the fraction moved into the
    // exponent, and trailing zeros too, so `1.000…0` stays small.
    let digits = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return Some(0);
    }
    exp10 = exp10.checked_sub(i32::try_from(frac.len()).ok()?)?;
    let significant = digits.trim_end_matches('0');
    exp10 = exp10.checked_add(i32::try_from(digits.len() - significant.len()).ok()?)?;
    exp10 = exp10.checked_add(scale)?;
    let mut value: u128 = significant.parse().ok()?;
    value = value.checked_mul(1u128.checked_shl(binary)?)?;
    if exp10 >= 0 {
        value = value.checked_mul(10u128.checked_pow(exp10.unsigned_abs())?)?;
    } else {
        // A divisor beyond u128 is larger than any value: the quotient is 0
        // with a remainder.
        let (quotient, exact) = match 10u128.checked_pow(exp10.unsigned_abs()) {
            Some(divisor) => (value / divisor, value.is_multiple_of(divisor)),
            None => (0, false),
        };
        value = match (exact, rounding) {
            (true, _) => quotient,
            (false, Rounding::Exact) => return None,
            (false, Rounding::Up) => quotient.checked_add(1)?,
        };
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

    fn sidecar(name: &str, slots: &str) -> Container {
        Container {
            restart_policy: Some("Always".into()),
            ..container(name, Some(slots), Some(slots))
        }
    }

    fn regular(name: &str, slots: &str) -> Container {
        container(name, Some(slots), Some(slots))
    }

    fn spec_of(init: Vec<Container>, apps: Vec<Container>) -> PodSpec {
        PodSpec {
            containers: apps,
            init_containers: Some(init),
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
        let spec = spec_of(vec![sidecar("s", "1")], vec![regular("a", "2")]);
        assert_eq!(requested_slots(&spec, "gpupool/slot"), Ok(3));
    }

    /// Every shape Kubernetes' effective-request rule distinguishes, with
    /// the number the scheduler and the kubelet count for it.
    #[test]
    fn each_shape_counts_as_kubernetes_counts_it() {
        let cases: &[(&str, PodSpec, u32)] = &[
            ("nothing", spec_of(vec![], vec![]), 0),
            ("one app", spec_of(vec![], vec![regular("a", "1")]), 1),
            (
                "init 2, app 1",
                spec_of(vec![regular("i", "2")], vec![regular("a", "1")]),
                2,
            ),
            (
                "init 1, app 2",
                spec_of(vec![regular("i", "1")], vec![regular("a", "2")]),
                2,
            ),
            (
                "sidecar 1, init 2, app 1",
                spec_of(
                    vec![sidecar("s", "1"), regular("i", "2")],
                    vec![regular("a", "1")],
                ),
                3,
            ),
            (
                "init 2, sidecar 1, app 1: the sidecar starts after the init ends",
                spec_of(
                    vec![regular("i", "2"), sidecar("s", "1")],
                    vec![regular("a", "1")],
                ),
                2,
            ),
            (
                "sidecars 1 and 1, init 3, no app",
                spec_of(
                    vec![sidecar("s1", "1"), sidecar("s2", "1"), regular("i", "3")],
                    vec![],
                ),
                5,
            ),
            (
                "sidecar 1, init 1, sidecar 1, init 2, app 1",
                spec_of(
                    vec![
                        sidecar("s1", "1"),
                        regular("i1", "1"),
                        sidecar("s2", "1"),
                        regular("i2", "2"),
                    ],
                    vec![regular("a", "1")],
                ),
                4,
            ),
            (
                "inits 3 and 1 run one at a time",
                spec_of(
                    vec![regular("i1", "3"), regular("i2", "1")],
                    vec![regular("a", "1")],
                ),
                3,
            ),
            (
                "a sidecar alone",
                spec_of(vec![sidecar("s", "2")], vec![]),
                2,
            ),
            (
                "two apps and a sidecar outweigh an init",
                spec_of(
                    vec![sidecar("s", "1"), regular("i", "2")],
                    vec![regular("a", "1"), regular("b", "1")],
                ),
                3,
            ),
        ];
        for (what, spec, want) in cases {
            assert_eq!(requested_slots(spec, "gpupool/slot"), Ok(*want), "{what}");
        }
    }

    /// What a pod holds at its busiest, found by walking its life: each
    /// regular init container runs alone beside the sidecars started before
    /// it, then the app containers run beside every sidecar.
    fn busiest(init: &[(bool, u64)], apps: &[u64]) -> u64 {
        let mut sidecars_running = 0;
        let mut busiest = 0;
        for &(is_sidecar, n) in init {
            if is_sidecar {
                sidecars_running += n;
                busiest = busiest.max(sidecars_running);
            } else {
                busiest = busiest.max(sidecars_running + n);
            }
        }
        busiest.max(sidecars_running + apps.iter().sum::<u64>())
    }

    /// Every pod of up to three init containers (regular or sidecar) and two
    /// app containers, each asking 0 to 2: the count is what the pod holds
    /// at its busiest, it never falls when a container asks more, and it
    /// lies between the largest container and the sum of all.
    #[test]
    fn property_the_count_is_the_busiest_moment_of_every_small_pod() {
        let kinds: Vec<(bool, u64)> = [false, true]
            .into_iter()
            .flat_map(|s| (0..=2).map(move |n| (s, n)))
            .collect();
        let mut inits: Vec<Vec<(bool, u64)>> = vec![vec![]];
        for _ in 0..3 {
            let longer: Vec<Vec<(bool, u64)>> = inits
                .iter()
                .filter(|v| v.len() == inits.last().map_or(0, Vec::len))
                .flat_map(|v| {
                    kinds.iter().map(move |k| {
                        let mut w = v.clone();
                        w.push(*k);
                        w
                    })
                })
                .collect();
            inits.extend(longer);
        }
        let mut apps: Vec<Vec<u64>> = vec![vec![]];
        apps.extend((0..=2).map(|n| vec![n]));
        apps.extend((0..=2).flat_map(|a| (0..=2).map(move |b| vec![a, b])));
        let spec = |init: &[(bool, u64)], app: &[u64]| {
            let init = init
                .iter()
                .enumerate()
                .map(|(i, &(s, n))| {
                    let name = format!("i{i}");
                    if s {
                        sidecar(&name, &n.to_string())
                    } else {
                        regular(&name, &n.to_string())
                    }
                })
                .collect();
            let app = app
                .iter()
                .enumerate()
                .map(|(i, n)| regular(&format!("a{i}"), &n.to_string()))
                .collect();
            spec_of(init, app)
        };
        let count = |init: &[(bool, u64)], app: &[u64]| {
            u64::from(requested_slots(&spec(init, app), "gpupool/slot").expect("whole numbers"))
        };
        let mut checked = 0;
        for init in &inits {
            for app in &apps {
                let got = count(init, app);
                assert_eq!(got, busiest(init, app), "{init:?} {app:?}");
                let all: Vec<u64> = init
                    .iter()
                    .map(|k| k.1)
                    .chain(app.iter().copied())
                    .collect();
                assert!(
                    got >= all.iter().copied().max().unwrap_or(0),
                    "{init:?} {app:?}"
                );
                assert!(got <= all.iter().sum(), "{init:?} {app:?}");
                for i in 0..init.len() {
                    let mut more = init.clone();
                    more[i].1 += 1;
                    assert!(
                        count(&more, app) >= got,
                        "{init:?} {app:?}: more at init {i}"
                    );
                }
                for i in 0..app.len() {
                    let mut more = app.clone();
                    more[i] += 1;
                    assert!(
                        count(init, &more) >= got,
                        "{init:?} {app:?}: more at app {i}"
                    );
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 259 * 13);
    }

    #[test]
    fn effective_request_returns_the_first_error_and_saturates() {
        let spec = spec_of(
            vec![regular("i", "1"), container("bad", Some("0.5"), None)],
            vec![regular("a", "1")],
        );
        let err = requested_slots(&spec, "gpupool/slot").expect_err("fractional");
        assert_eq!(
            err,
            PodError::FractionalSlots {
                container: "bad".into(),
                resource: "gpupool/slot".into(),
                quantity: "0.5".into(),
            }
        );
        let huge = spec_of(vec![], vec![regular("a", "1"), regular("b", "1")]);
        let got: Result<u64, ()> = effective_request(&huge, |_| Ok(u64::MAX));
        assert_eq!(got, Ok(u64::MAX));
        let sidecar_then_init = spec_of(vec![sidecar("s", "1"), regular("i", "1")], vec![]);
        let got: Result<u64, ()> = effective_request(&sidecar_then_init, |_| Ok(u64::MAX));
        assert_eq!(got, Ok(u64::MAX));
    }

    #[test]
    fn requests_come_before_limits_per_container() {
        let c = container("c", Some("1"), Some("3"));
        assert_eq!(
            container_request(&c, "gpupool/slot"),
            Some(&Quantity("1".into()))
        );
        let c = container("c", None, Some("3"));
        assert_eq!(container_slots(&c, "gpupool/slot"), Ok(3));
        assert_eq!(container_request(&c, "other/x"), None);
        assert_eq!(
            container_request(&Container::default(), "gpupool/slot"),
            None
        );
    }

    #[test]
    fn milli_and_ceil_round_up_as_kubernetes_does() {
        let milli = |s: &str| parse_milli(&Quantity(s.to_owned()));
        let ceil = |s: &str| parse_ceil(&Quantity(s.to_owned()));
        for (text, want) in [
            ("1", Some(1000)),
            ("1000", Some(1_000_000)),
            ("100m", Some(100)),
            ("0.5", Some(500)),
            ("1.0000000000000000000000000000000000000000000", Some(1000)),
            ("1n", Some(1)),
            ("1e-100", Some(1)),
            ("0", Some(0)),
            ("2k", Some(2_000_000)),
            ("-1", None),
            ("x", None),
            ("18446744073709552", None),
        ] {
            assert_eq!(milli(text), want, "milli {text:?}");
        }
        for (text, want) in [
            ("64Gi", Some(68_719_476_736)),
            ("1.5", Some(2)),
            ("1500m", Some(2)),
            ("110", Some(110)),
            ("1.5Ki", Some(1536)),
            ("0.1Ki", Some(103)),
            ("1e3", Some(1000)),
            ("-5", None),
            ("20E", None),
        ] {
            assert_eq!(ceil(text), want, "ceil {text:?}");
        }
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
