//! Owner references as the store answers them: who depends on whom, and
//! orphaning. The garbage collector and deletes both ask; neither owns it.
//!
//! Every store write keeps an [`OwnerIndex`] up to date, so these answers
//! are look-ups: a garbage-collection sweep that read every object under the
//! store's lock took a large share of a busy server's time once tens of
//! thousands of objects were kept, and stalled every request meanwhile.

use std::collections::{BTreeSet, HashMap};

use serde_json::Value;

use crate::store::{ObjectKey, State};

/// The finalizer of foreground deletion.
pub const FOREGROUND: &str = "foregroundDeletion";

/// Which objects name which owners, and which objects are being deleted in
/// the foreground.
#[derive(Debug, Default)]
pub struct OwnerIndex {
    /// Owner uid → the objects naming it. A reference without a uid is
    /// kept under "", which no object has, so it counts as a gone owner.
    dependents: HashMap<String, BTreeSet<ObjectKey>>,
    /// Objects with a deletionTimestamp and the foregroundDeletion finalizer.
    foreground: BTreeSet<ObjectKey>,
}

impl OwnerIndex {
    /// Records that the object at `key` went from `old` to `new` (`None`:
    /// absent).
    pub(super) fn update(&mut self, key: &ObjectKey, old: Option<&Value>, new: Option<&Value>) {
        let before = old.map(owner_uids).unwrap_or_default();
        let after = new.map(owner_uids).unwrap_or_default();
        if before != after {
            for uid in &before {
                if let Some(set) = self.dependents.get_mut(uid) {
                    set.remove(key);
                    if set.is_empty() {
                        self.dependents.remove(uid);
                    }
                }
            }
            for uid in after {
                self.dependents.entry(uid).or_default().insert(key.clone());
            }
        }
        if new.is_some_and(is_foreground_deleting) {
            self.foreground.insert(key.clone());
        } else {
            self.foreground.remove(key);
        }
    }
}

/// The uids `obj`'s owner references name ("" for one without a uid).
fn owner_uids(obj: &Value) -> BTreeSet<String> {
    obj.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .map(|refs| {
            refs.iter()
                .map(|r| {
                    r.get("uid")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Being deleted, and waiting for its dependents to go first.
fn is_foreground_deleting(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp").is_some()
        && obj
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| f.iter().any(|x| x == FOREGROUND))
}

/// Objects not being deleted whose owners are all gone: the garbage
/// collector deletes them. In key order.
pub fn orphaned(st: &State) -> Vec<ObjectKey> {
    let mut found = BTreeSet::new();
    for (uid, keys) in &st.owners.dependents {
        if st.by_uid(uid).is_some() {
            continue;
        }
        for key in keys {
            let Some(obj) = st.get(&key.resource, &key.namespace, &key.name) else {
                continue;
            };
            if obj.pointer("/metadata/deletionTimestamp").is_none()
                && owner_uids(&obj).iter().all(|u| st.by_uid(u).is_none())
            {
                found.insert(key.clone());
            }
        }
    }
    found.into_iter().collect()
}

/// Objects being deleted in the foreground, in key order.
pub fn foreground_deletions(st: &State) -> Vec<ObjectKey> {
    st.owners.foreground.iter().cloned().collect()
}

/// The objects naming `uid` as an owner, in key order.
pub fn dependents_of(st: &State, uid: &str) -> Vec<ObjectKey> {
    st.owners
        .dependents
        .get(uid)
        .map(|keys| keys.iter().cloned().collect())
        .unwrap_or_default()
}

/// Whether any object names `uid` as an owner.
pub fn has_dependents(st: &State, uid: &str) -> bool {
    st.owners.dependents.contains_key(uid)
}

/// Removes owner references to `uid` from every object (orphan deletion).
pub fn orphan_dependents(st: &mut State, uid: &str) {
    for key in dependents_of(st, uid) {
        let Some(obj) = st.get(&key.resource, &key.namespace, &key.name) else {
            continue;
        };
        let mut o = (*obj).clone();
        if let Some(list) = o
            .pointer_mut("/metadata/ownerReferences")
            .and_then(Value::as_array_mut)
        {
            list.retain(|r| r["uid"] != uid);
        }
        st.put(&key.resource, &key.namespace, &key.name, o);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::registry::{Registry, ResourceId};

    fn cm(name: &str, uid: &str, owners: &[&str]) -> Value {
        let refs: Vec<Value> = owners
            .iter()
            .map(|u| json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": u}))
            .collect();
        json!({"metadata": {"name": name, "uid": uid, "ownerReferences": refs}})
    }

    fn key(name: &str) -> ObjectKey {
        ObjectKey {
            resource: ResourceId::new("", "configmaps"),
            namespace: "default".into(),
            name: name.into(),
        }
    }

    #[test]
    fn the_index_follows_every_write_and_finds_orphans() {
        let mut st = State::new(Registry::builtin(), 64, 16);
        let id = ResourceId::new("", "configmaps");
        st.put(&id, "default", "a", cm("a", "ua", &[]));
        st.put(&id, "default", "b", cm("b", "ub", &[]));
        st.put(&id, "default", "both", cm("both", "u1", &["ua", "ub"]));
        st.put(&id, "default", "of-a", cm("of-a", "u2", &["ua"]));
        assert!(has_dependents(&st, "ua") && has_dependents(&st, "ub"));
        assert_eq!(dependents_of(&st, "ua"), [key("both"), key("of-a")]);
        assert!(orphaned(&st).is_empty(), "every owner exists");

        // One of two owners gone: not an orphan yet; both gone: it is.
        st.remove(&id, "default", "a");
        assert_eq!(orphaned(&st), [key("of-a")]);
        st.remove(&id, "default", "b");
        assert_eq!(orphaned(&st), [key("both"), key("of-a")]);

        // A write that drops the references takes the object out.
        st.put(&id, "default", "both", cm("both", "u1", &[]));
        assert_eq!(dependents_of(&st, "ub"), []);
        assert!(!has_dependents(&st, "ub"), "no empty entry is kept");
        st.remove(&id, "default", "of-a");
        assert!(orphaned(&st).is_empty());

        // A reference without a uid names no object: a gone owner.
        st.put(
            &id,
            "default",
            "no-uid",
            json!({"metadata": {"name": "no-uid", "ownerReferences": [{"name": "x"}]}}),
        );
        assert_eq!(orphaned(&st), [key("no-uid")]);
        // An object already being deleted is left to finish.
        st.put(
            &id,
            "default",
            "no-uid",
            json!({"metadata": {"name": "no-uid", "deletionTimestamp": "2026-01-01T00:00:00Z",
                                "finalizers": ["x"], "ownerReferences": [{"name": "x"}]}}),
        );
        assert!(orphaned(&st).is_empty());
    }

    #[test]
    fn foreground_deletions_and_orphaning_are_looked_up() {
        let mut st = State::new(Registry::builtin(), 64, 16);
        let id = ResourceId::new("", "configmaps");
        st.put(&id, "default", "owner", cm("owner", "uo", &[]));
        st.put(&id, "default", "dep", cm("dep", "ud", &["uo"]));
        assert!(foreground_deletions(&st).is_empty());
        let mut deleting = cm("owner", "uo", &[]);
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        deleting["metadata"]["finalizers"] = json!([FOREGROUND]);
        st.put(&id, "default", "owner", deleting.clone());
        assert_eq!(foreground_deletions(&st), [key("owner")]);
        // Another finalizer alone is not a foreground deletion.
        deleting["metadata"]["finalizers"] = json!(["example.com/keep"]);
        st.put(&id, "default", "owner", deleting);
        assert!(foreground_deletions(&st).is_empty());

        orphan_dependents(&mut st, "uo");
        assert!(!has_dependents(&st, "uo"));
        let dep = st.get(&id, "default", "dep").expect("dep kept");
        assert_eq!(dep["metadata"]["ownerReferences"], json!([]));
        st.remove(&id, "default", "owner");
        assert!(orphaned(&st).is_empty(), "an orphaned dependent stays");
    }

    #[test]
    fn dropping_a_resource_forgets_its_objects() {
        let mut st = State::new(Registry::builtin(), 64, 16);
        let id = ResourceId::new("", "configmaps");
        st.put(&id, "default", "dep", cm("dep", "ud", &["gone"]));
        assert_eq!(orphaned(&st), [key("dep")]);
        st.forget_resource(&id);
        assert!(orphaned(&st).is_empty());
        assert!(!has_dependents(&st, "gone"));
    }
}
