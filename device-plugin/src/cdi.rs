//! How Allocate tells the container runtime which GPUs a container gets
//! (`--device-list-strategy`): the `NVIDIA_VISIBLE_DEVICES` variable read by
//! the NVIDIA container runtime, or Container Device Interface (CDI) device
//! names, either as annotations or as the CRI's own CDI device field.
//!
//! CDI names are `<vendor>/<class>=<device>`; the kind (`<vendor>/<class>`)
//! is `--cdi-kind` and the device is the GPU's UUID, which is how
//! `nvidia-ctk cdi generate` names each GPU (besides its index).

use std::fmt;

/// Default CDI kind: what `nvidia-ctk cdi generate` writes.
pub const DEFAULT_CDI_KIND: &str = "nvidia.com/gpu";

/// Prefix of the container annotations a CDI-aware runtime reads.
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// The annotation key this plugin writes in `cdi-annotations` mode: the CDI
/// prefix, then `<plugin>_<device>`. One key per container is enough, since
/// annotations are per container and the plugin part keeps it apart from
/// other plugins' keys.
pub const CDI_ANNOTATION_KEY: &str = "cdi.k8s.io/gpupool-device-plugin_gpus";

/// What `NVIDIA_VISIBLE_DEVICES` is set to when only CDI names the GPUs:
/// it overrides the `all` that CUDA images set, so a node whose default
/// runtime is still the NVIDIA runtime (legacy mode) injects nothing beyond
/// what CDI injects.
pub const NVIDIA_VISIBLE_DEVICES_VOID: &str = "void";

/// One way of naming the GPUs to the container runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<uuids>` and the device nodes.
    Envvar,
    /// CDI device names in a `cdi.k8s.io/…` container annotation.
    CdiAnnotations,
    /// CDI device names in the CRI's `CDIDevices` field (Kubernetes 1.28+).
    CdiCri,
}

impl DeviceListStrategy {
    /// The flag value naming this strategy.
    pub fn name(self) -> &'static str {
        match self {
            DeviceListStrategy::Envvar => "envvar",
            DeviceListStrategy::CdiAnnotations => "cdi-annotations",
            DeviceListStrategy::CdiCri => "cdi-cri",
        }
    }
}

/// The strategies in use; at least one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceListStrategies {
    /// `envvar` is in use.
    pub envvar: bool,
    /// `cdi-annotations` is in use.
    pub cdi_annotations: bool,
    /// `cdi-cri` is in use.
    pub cdi_cri: bool,
}

impl Default for DeviceListStrategies {
    /// `envvar` alone.
    fn default() -> Self {
        DeviceListStrategies {
            envvar: true,
            cdi_annotations: false,
            cdi_cri: false,
        }
    }
}

impl DeviceListStrategies {
    /// Parses `--device-list-strategy`: one or more of `envvar`,
    /// `cdi-annotations` and `cdi-cri`, comma-separated; repeats are allowed.
    /// The error names the flag and the bad entry.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut parsed = DeviceListStrategies {
            envvar: false,
            cdi_annotations: false,
            cdi_cri: false,
        };
        for item in list.split(',').map(str::trim) {
            match item {
                "envvar" => parsed.envvar = true,
                "cdi-annotations" => parsed.cdi_annotations = true,
                "cdi-cri" => parsed.cdi_cri = true,
                "" => {
                    return Err(format!(
                        "--device-list-strategy {list:?}: empty entry; give envvar, cdi-annotations or cdi-cri, comma-separated"
                    ));
                }
                other => {
                    return Err(format!(
                        "--device-list-strategy: unknown strategy {other:?}; expected envvar, cdi-annotations or cdi-cri"
                    ));
                }
            }
        }
        Ok(parsed)
    }

    /// True when a CDI strategy is in use.
    pub fn any_cdi(&self) -> bool {
        self.cdi_annotations || self.cdi_cri
    }

    /// The strategies in use, in flag order.
    pub fn iter(&self) -> impl Iterator<Item = DeviceListStrategy> + '_ {
        [
            (self.envvar, DeviceListStrategy::Envvar),
            (self.cdi_annotations, DeviceListStrategy::CdiAnnotations),
            (self.cdi_cri, DeviceListStrategy::CdiCri),
        ]
        .into_iter()
        .filter_map(|(on, strategy)| on.then_some(strategy))
    }
}

impl fmt::Display for DeviceListStrategies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.iter().map(DeviceListStrategy::name).collect();
        f.write_str(&names.join(","))
    }
}

/// A validated CDI kind, `<vendor>/<class>` (`--cdi-kind`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiKind(String);

impl Default for CdiKind {
    /// [`DEFAULT_CDI_KIND`].
    fn default() -> Self {
        CdiKind(DEFAULT_CDI_KIND.to_owned())
    }
}

/// A CDI name part: starts with a letter, ends with a letter or digit, and
/// holds only letters, digits and `extra` in between.
fn cdi_part_ok(part: &str, extra: &[char]) -> bool {
    let mut chars = part.chars();
    let (Some(first), Some(last)) = (chars.next(), part.chars().last()) else {
        return false;
    };
    first.is_ascii_alphabetic()
        && last.is_ascii_alphanumeric()
        && part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || extra.contains(&c))
}

impl CdiKind {
    /// Checks a kind the way the CDI specification does: the vendor is a
    /// domain-like name (letters, digits, `.`, `-`, `_`) and the class a
    /// simple name (letters, digits, `-`, `_`); each starts with a letter and
    /// ends with a letter or digit. The error names the flag.
    pub fn parse(kind: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            Err(format!(
                "--cdi-kind {kind:?}: {why}; expected <vendor>/<class> like {DEFAULT_CDI_KIND}"
            ))
        };
        let Some((vendor, class)) = kind.split_once('/') else {
            return bad("no '/'");
        };
        if !cdi_part_ok(vendor, &['.', '-', '_']) {
            return bad("invalid vendor");
        }
        if !cdi_part_ok(class, &['-', '_']) {
            return bad("invalid class");
        }
        Ok(CdiKind(kind.to_owned()))
    }

    /// The kind as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The fully qualified CDI name of `device`: `<kind>=<device>`.
    pub fn qualified(&self, device: &str) -> String {
        format!("{}={device}", self.0)
    }
}

impl fmt::Display for CdiKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_parse() {
        let s = |envvar, cdi_annotations, cdi_cri| DeviceListStrategies {
            envvar,
            cdi_annotations,
            cdi_cri,
        };
        let cases = [
            ("envvar", s(true, false, false)),
            ("cdi-annotations", s(false, true, false)),
            ("cdi-cri", s(false, false, true)),
            ("envvar,cdi-cri", s(true, false, true)),
            (" cdi-cri , cdi-annotations ", s(false, true, true)),
            ("cdi-cri,cdi-cri", s(false, false, true)),
        ];
        for (text, want) in cases {
            assert_eq!(DeviceListStrategies::parse(text), Ok(want), "{text}");
        }
        assert_eq!(DeviceListStrategies::default(), s(true, false, false));
        assert_eq!(
            s(true, true, true).to_string(),
            "envvar,cdi-annotations,cdi-cri"
        );
        assert!(s(false, false, true).any_cdi());
        assert!(!s(true, false, false).any_cdi());
    }

    #[test]
    fn bad_strategies_name_the_flag() {
        for (text, needle) in [
            ("", "empty entry"),
            ("envvar,", "empty entry"),
            ("volume-mounts", "\"volume-mounts\""),
            ("CDI-CRI", "\"CDI-CRI\""),
        ] {
            let err = DeviceListStrategies::parse(text).expect_err(text);
            assert!(err.contains("--device-list-strategy"), "{err}");
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn cdi_kinds() {
        for good in [
            "nvidia.com/gpu",
            "example.com/gpu_slot",
            "a/b",
            "vendor-1.example/class-2",
        ] {
            let kind = CdiKind::parse(good).unwrap_or_else(|e| panic!("{good}: {e}"));
            assert_eq!(kind.as_str(), good);
        }
        for (bad, needle) in [
            ("nvidia.com", "no '/'"),
            ("/gpu", "invalid vendor"),
            ("1nvidia.com/gpu", "invalid vendor"),
            ("nvidia.com./gpu", "invalid vendor"),
            ("nvi dia.com/gpu", "invalid vendor"),
            ("nvidia.com/", "invalid class"),
            ("nvidia.com/g.pu", "invalid class"),
            ("nvidia.com/gpu-", "invalid class"),
            ("nvidia.com/gpu/x", "invalid class"),
            ("nvidia.com/gpu=x", "invalid class"),
        ] {
            let err = CdiKind::parse(bad).expect_err(bad);
            assert!(err.contains("--cdi-kind"), "{err}");
            assert!(err.contains(needle), "{bad}: {err}");
        }
        assert_eq!(
            CdiKind::default().qualified("GPU-a"),
            "nvidia.com/gpu=GPU-a"
        );
    }
}
