//! The kubelet's device bookkeeping: which devices each plugin advertises,
//! which are healthy, and which container holds which. Pure data, so the
//! rules are tested alone:
//!
//! - a device is never given to two live containers;
//! - devices of a pod's (finished) init containers are reused by the pod's
//!   later containers first, as kubelet's device manager does;
//! - an unhealthy device counts in capacity but not in allocatable.

use std::collections::{BTreeMap, BTreeSet};

/// Why devices cannot be chosen for a container.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    /// No plugin registered the resource on this node.
    #[error("resource {0} is not registered by any device plugin on this node")]
    UnknownResource(String),
    /// Fewer healthy, unused devices than requested.
    #[error(
        "requested number of devices unavailable for {resource}. Requested: {requested}, Available: {available}"
    )]
    Insufficient {
        /// The resource.
        resource: String,
        /// Devices the container asked for.
        requested: usize,
        /// Devices that were free.
        available: usize,
    },
    /// A device picked for the container is not among those offered.
    #[error("device {device} of {resource} is not available for this container")]
    NotOffered {
        /// The resource.
        resource: String,
        /// The device.
        device: String,
    },
}

/// What the kubelet may hand one container: the devices it must keep (reused
/// from init containers) and the free ones to pick the rest from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidates {
    /// Resource name.
    pub resource: String,
    /// Devices the container must get (reused from this pod's init containers).
    pub must_include: Vec<String>,
    /// Every device the container may get, `must_include` included, sorted.
    pub available: Vec<String>,
    /// How many devices the container gets.
    pub size: usize,
}

impl Candidates {
    /// True when the reused devices alone are enough for the container:
    /// kubelet's device manager then takes the first `size` of them (in ID
    /// order) without asking the plugin for a preference, since a
    /// preference must include every one of them and could not.
    pub fn settled_by_reuse(&self) -> bool {
        self.must_include.len() >= self.size
    }

    /// The default choice when the plugin expresses no preference: the
    /// reused devices, then free ones in ID order. Always `size` devices
    /// (the book offers no fewer).
    pub fn default_choice(&self) -> Vec<String> {
        self.choose(&[])
    }

    /// The devices kubelet's device manager gives the container when the
    /// plugin prefers `preferred`: every reused device first (the first
    /// `size` of them in ID order when they are enough), then the free
    /// devices `preferred` names, then other free devices, each group in ID
    /// order. Devices `preferred` names that are not offered, or repeats,
    /// are ignored, as kubelet ignores them; so is the order of `preferred`.
    pub fn choose(&self, preferred: &[String]) -> Vec<String> {
        let mut chosen: Vec<String> = self.must_include.iter().take(self.size).cloned().collect();
        let preferred: BTreeSet<&String> = preferred
            .iter()
            .filter(|d| self.available.contains(d))
            .collect();
        for d in preferred.into_iter().chain(&self.available) {
            if chosen.len() >= self.size {
                break;
            }
            if !chosen.contains(d) {
                chosen.push(d.clone());
            }
        }
        chosen
    }

    /// Accepts `chosen` if it has the right size, contains every
    /// must-include device and only offered ones: whether a plugin's
    /// preferred allocation can be taken as it is (kubelet takes what it can
    /// of one that cannot, see [`Candidates::choose`]).
    pub fn validate(&self, chosen: &[String]) -> Result<(), AllocationError> {
        for d in chosen {
            if !self.available.contains(d) {
                return Err(AllocationError::NotOffered {
                    resource: self.resource.clone(),
                    device: d.clone(),
                });
            }
        }
        let distinct: BTreeSet<&String> = chosen.iter().collect();
        let must_ok = self.must_include.len() >= self.size
            || self.must_include.iter().all(|d| distinct.contains(d));
        if distinct.len() != self.size || !must_ok {
            return Err(AllocationError::Insufficient {
                resource: self.resource.clone(),
                requested: self.size,
                available: distinct.len(),
            });
        }
        Ok(())
    }
}

/// Devices one container holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerDevices {
    /// Container name.
    pub container: String,
    /// True for a regular (run-to-completion) init container, whose devices
    /// later containers of the pod reuse.
    pub init: bool,
    /// Resource name.
    pub resource: String,
    /// Device IDs.
    pub devices: Vec<String>,
}

/// Devices a pod's containers hold.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodDevices {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// One entry per (container, resource) that holds devices.
    pub containers: Vec<ContainerDevices>,
}

/// The node's devices and their holders.
#[derive(Debug, Clone, Default)]
pub struct DeviceBook {
    /// resource → device ID → healthy.
    devices: BTreeMap<String, BTreeMap<String, bool>>,
    /// pod UID → what it holds.
    pods: BTreeMap<String, PodDevices>,
}

impl DeviceBook {
    /// Replaces the advertised devices of `resource` (a ListAndWatch update).
    pub fn set_devices(
        &mut self,
        resource: &str,
        devices: impl IntoIterator<Item = (String, bool)>,
    ) {
        self.devices
            .insert(resource.to_owned(), devices.into_iter().collect());
    }

    /// Marks every device of `resource` unhealthy (its plugin went away),
    /// keeping them in capacity as kubelet does until the plugin returns.
    pub fn mark_unhealthy(&mut self, resource: &str) {
        if let Some(devs) = self.devices.get_mut(resource) {
            devs.values_mut().for_each(|h| *h = false);
        }
    }

    /// Resources any plugin has advertised.
    pub fn resources(&self) -> impl Iterator<Item = &str> {
        self.devices.keys().map(String::as_str)
    }

    /// Devices of `resource`, healthy or not.
    pub fn capacity(&self, resource: &str) -> usize {
        self.devices.get(resource).map_or(0, BTreeMap::len)
    }

    /// Healthy devices of `resource`.
    pub fn allocatable(&self, resource: &str) -> usize {
        self.devices
            .get(resource)
            .map_or(0, |d| d.values().filter(|h| **h).count())
    }

    /// Healthy device IDs of `resource`, sorted.
    pub fn healthy_devices(&self, resource: &str) -> Vec<String> {
        self.devices
            .get(resource)
            .map(|d| {
                d.iter()
                    .filter(|(_, h)| **h)
                    .map(|(id, _)| id.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Devices of `resource` held by any live container except the reusable
    /// init-container devices of `pod_uid`.
    fn taken(&self, resource: &str, pod_uid: &str) -> BTreeSet<&String> {
        self.pods
            .iter()
            .flat_map(|(uid, p)| {
                p.containers
                    .iter()
                    .filter(move |c| c.resource == resource && !(uid == pod_uid && c.init))
            })
            .flat_map(|c| c.devices.iter())
            .collect()
    }

    /// Devices the pod's init containers held that no later container of the
    /// pod has taken over yet.
    fn reusable(&self, resource: &str, pod_uid: &str) -> Vec<String> {
        let Some(pod) = self.pods.get(pod_uid) else {
            return Vec::new();
        };
        let in_app: BTreeSet<&String> = pod
            .containers
            .iter()
            .filter(|c| !c.init && c.resource == resource)
            .flat_map(|c| c.devices.iter())
            .collect();
        let mut out: Vec<String> = pod
            .containers
            .iter()
            .filter(|c| c.init && c.resource == resource)
            .flat_map(|c| c.devices.iter())
            .filter(|d| !in_app.contains(d))
            .cloned()
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// What `size` devices of `resource` for a container of `pod_uid` may be chosen from.
    pub fn candidates(
        &self,
        pod_uid: &str,
        resource: &str,
        size: usize,
    ) -> Result<Candidates, AllocationError> {
        if !self.devices.contains_key(resource) {
            return Err(AllocationError::UnknownResource(resource.to_owned()));
        }
        let reusable = self.reusable(resource, pod_uid);
        let taken = self.taken(resource, pod_uid);
        let healthy = self.healthy_devices(resource);
        let available: Vec<String> = healthy
            .into_iter()
            .filter(|d| !taken.contains(d))
            .chain(reusable.iter().cloned())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if available.len() < size {
            return Err(AllocationError::Insufficient {
                resource: resource.to_owned(),
                requested: size,
                available: available.len(),
            });
        }
        Ok(Candidates {
            resource: resource.to_owned(),
            must_include: reusable,
            available,
            size,
        })
    }

    /// Records that a container holds `devices`.
    pub fn assign(&mut self, pod_uid: &str, namespace: &str, name: &str, holder: ContainerDevices) {
        let pod = self.pods.entry(pod_uid.to_owned()).or_default();
        pod.namespace = namespace.to_owned();
        pod.name = name.to_owned();
        pod.containers.push(holder);
    }

    /// Frees everything the pod holds.
    pub fn release(&mut self, pod_uid: &str) -> bool {
        self.pods.remove(pod_uid).is_some()
    }

    /// Every pod that holds devices, by UID.
    pub fn pods(&self) -> &BTreeMap<String, PodDevices> {
        &self.pods
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: &str = "gpupool/slot";

    fn book(n: usize) -> DeviceBook {
        let mut b = DeviceBook::default();
        b.set_devices(R, (0..n).map(|i| (format!("d{i}"), true)));
        b
    }

    fn holder(container: &str, init: bool, devices: &[String]) -> ContainerDevices {
        ContainerDevices {
            container: container.into(),
            init,
            resource: R.into(),
            devices: devices.to_vec(),
        }
    }

    #[test]
    fn a_device_is_never_offered_twice() {
        let mut b = book(3);
        let c = b.candidates("p1", R, 2).expect("fits");
        let chosen = c.default_choice();
        c.validate(&chosen).expect("valid");
        b.assign("p1", "ns", "a", holder("main", false, &chosen));
        let c2 = b.candidates("p2", R, 1).expect("one left");
        assert_eq!(c2.available, vec!["d2".to_owned()]);
        b.assign("p2", "ns", "b", holder("main", false, &c2.default_choice()));
        assert_eq!(
            b.candidates("p3", R, 1),
            Err(AllocationError::Insufficient {
                resource: R.into(),
                requested: 1,
                available: 0
            })
        );
        assert!(b.release("p1"));
        assert_eq!(b.candidates("p3", R, 2).expect("freed").available.len(), 2);
    }

    #[test]
    fn app_containers_reuse_init_devices_but_not_each_others() {
        let mut b = book(3);
        let init = b.candidates("p", R, 2).expect("fits").default_choice();
        b.assign("p", "ns", "p", holder("init", true, &init));
        let c = b.candidates("p", R, 1).expect("fits");
        assert_eq!(c.must_include, init);
        let first = c.default_choice();
        assert_eq!(first, vec![init[0].clone()]);
        b.assign("p", "ns", "p", holder("app1", false, &first));
        let c = b.candidates("p", R, 2).expect("fits");
        assert_eq!(c.must_include, vec![init[1].clone()]);
        let second = c.default_choice();
        assert!(!second.contains(&first[0]), "{second:?}");
        assert_eq!(second.len(), 2);
        // Another pod sees neither init nor app devices of p.
        b.assign("p", "ns", "p", holder("app2", false, &second));
        assert!(b.candidates("q", R, 1).is_err());
    }

    #[test]
    fn reused_devices_alone_serve_a_smaller_container() {
        let mut b = book(2);
        let init = b.candidates("p", R, 2).expect("fits").default_choice();
        assert!(!b.candidates("p", R, 2).expect("fits").settled_by_reuse());
        b.assign("p", "ns", "p", holder("init", true, &init));
        // The app container asks 1 of the init container's 2: no free device
        // is needed, and the plugin is not asked to choose.
        let c = b.candidates("p", R, 1).expect("fits");
        assert_eq!(c.must_include, vec!["d0".to_owned(), "d1".to_owned()]);
        assert!(c.settled_by_reuse());
        assert_eq!(c.default_choice(), vec!["d0".to_owned()]);
        assert_eq!(c.choose(&["d1".into()]), vec!["d0".to_owned()]);
        b.assign("p", "ns", "p", holder("app", false, &c.default_choice()));
        // The pod holds both devices until it ends.
        assert!(b.candidates("q", R, 1).is_err());
        b.release("p");
        assert_eq!(b.candidates("q", R, 2).expect("freed").available.len(), 2);
    }

    #[test]
    fn a_sidecar_before_an_init_container_keeps_its_device() {
        // Sidecar 1, then init 2, then app 1: the init container cannot
        // reuse the running sidecar's device, so 2 devices are not enough.
        let mut b = book(2);
        let sidecar = b.candidates("p", R, 1).expect("fits").default_choice();
        b.assign("p", "ns", "p", holder("sidecar", false, &sidecar));
        assert_eq!(
            b.candidates("p", R, 2),
            Err(AllocationError::Insufficient {
                resource: R.into(),
                requested: 2,
                available: 1
            })
        );
        // With 3, the app container reuses one of the init container's two.
        let mut b = book(3);
        b.assign("p", "ns", "p", holder("sidecar", false, &sidecar));
        let init = b.candidates("p", R, 2).expect("fits").default_choice();
        assert_eq!(init, vec!["d1".to_owned(), "d2".to_owned()]);
        b.assign("p", "ns", "p", holder("init", true, &init));
        let app = b.candidates("p", R, 1).expect("fits");
        assert!(app.settled_by_reuse());
        assert_eq!(app.default_choice(), vec!["d1".to_owned()]);
    }

    #[test]
    fn choose_takes_what_a_preference_offers_in_id_order() {
        let mut b = book(4);
        let init = vec!["d3".to_owned()];
        b.assign("p", "ns", "p", holder("init", true, &init));
        let c = b.candidates("p", R, 3).expect("fits");
        assert_eq!(c.must_include, init);
        // The reused device, then the preferred free ones in ID order,
        // whatever order the plugin gave; unknown and repeated IDs ignored.
        assert_eq!(
            c.choose(&["d2".into(), "d9".into(), "d1".into(), "d1".into()]),
            vec!["d3".to_owned(), "d1".to_owned(), "d2".to_owned()]
        );
        // Too few preferred: the rest from free devices in ID order.
        assert_eq!(
            c.choose(&["d2".into()]),
            vec!["d3".to_owned(), "d2".to_owned(), "d0".to_owned()]
        );
        // Too many preferred: the first in ID order.
        assert_eq!(
            c.choose(&["d2".into(), "d1".into(), "d0".into()]),
            vec!["d3".to_owned(), "d0".to_owned(), "d1".to_owned()]
        );
        assert_eq!(c.default_choice(), c.choose(&[]));
    }

    #[test]
    fn unhealthy_devices_count_in_capacity_only() {
        let mut b = book(2);
        b.set_devices(R, [("d0".to_owned(), true), ("d1".to_owned(), false)]);
        assert_eq!((b.capacity(R), b.allocatable(R)), (2, 1));
        assert_eq!(b.candidates("p", R, 1).expect("one").available, vec!["d0"]);
        b.mark_unhealthy(R);
        assert_eq!((b.capacity(R), b.allocatable(R)), (2, 0));
        assert_eq!(
            b.candidates("p", "other/x", 1),
            Err(AllocationError::UnknownResource("other/x".into()))
        );
    }

    #[test]
    fn validate_rejects_bad_preferences() {
        let b = book(3);
        let c = b.candidates("p", R, 2).expect("fits");
        assert!(c.validate(&["d0".into(), "d9".into()]).is_err());
        assert!(c.validate(&["d0".into(), "d0".into()]).is_err());
        assert!(c.validate(&["d0".into()]).is_err());
        assert!(c.validate(&["d2".into(), "d0".into()]).is_ok());
    }
}
