//! Background clean-up, as the real controllers do it: garbage collection of
//! dependents whose owners are all gone, namespace termination, and removal
//! of custom resources whose CRD was deleted.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::objects::{self, DeleteOpts, WriteCtx};
use crate::registry::ResourceId;
use crate::store::State;
use crate::store::owners::{self, FOREGROUND};
use crate::{Shared, UserInfo};

fn gc_user() -> UserInfo {
    UserInfo {
        username: "system:serviceaccount:kube-system:generic-garbage-collector".into(),
        uid: "generic-garbage-collector".into(),
        groups: vec![
            "system:serviceaccounts".into(),
            "system:serviceaccounts:kube-system".into(),
        ],
        extra: Default::default(),
    }
}

/// What one sweep found to delete.
struct Sweep {
    deletes: Vec<(ResourceId, String, String)>,
}

fn find_work(st: &mut State) -> Sweep {
    let mut deletes = Vec::new();
    // Custom resources whose CRD is gone.
    let crds = ResourceId::new("apiextensions.k8s.io", "customresourcedefinitions");
    let orphaned_kinds: Vec<(String, String)> = st
        .registry
        .all()
        .filter(|d| d.custom)
        .filter(|d| {
            st.get(&crds, "", &format!("{}.{}", d.plural, d.group))
                .is_none()
        })
        .map(|d| (d.group.clone(), d.plural.clone()))
        .collect();
    for (group, plural) in orphaned_kinds {
        let id = ResourceId::new(&group, &plural);
        let keys: Vec<(String, String)> =
            st.list(&id, None, None).map(|(k, _)| k.clone()).collect();
        for (ns, name) in keys {
            st.remove(&id, &ns, &name);
        }
        st.forget_resource(&id);
        st.registry.remove_crd(&group, &plural);
    }
    // Dependents whose owners are all gone.
    for key in owners::orphaned(st) {
        deletes.push((key.resource, key.namespace, key.name));
    }
    // Foreground deletion: dependents first, then the owner's finalizer.
    for key in owners::foreground_deletions(st) {
        let Some(owner) = st.get(&key.resource, &key.namespace, &key.name) else {
            continue;
        };
        let Some(uid) = owner.pointer("/metadata/uid").and_then(Value::as_str) else {
            continue;
        };
        let dependents = owners::dependents_of(st, uid);
        for d in &dependents {
            let deleting = st
                .get(&d.resource, &d.namespace, &d.name)
                .is_some_and(|o| o.pointer("/metadata/deletionTimestamp").is_some());
            if !deleting {
                deletes.push((d.resource.clone(), d.namespace.clone(), d.name.clone()));
            }
        }
        if dependents.is_empty() {
            let mut o = (*owner).clone();
            if let Some(f) = o
                .pointer_mut("/metadata/finalizers")
                .and_then(Value::as_array_mut)
            {
                f.retain(|x| x != FOREGROUND);
                if f.is_empty() {
                    st.remove(&key.resource, &key.namespace, &key.name);
                    continue;
                }
            }
            st.put(&key.resource, &key.namespace, &key.name, o);
        }
    }
    // Terminating namespaces: delete their content; remove them once empty.
    let ns_id = ResourceId::new("", "namespaces");
    let terminating: Vec<String> = st
        .list(&ns_id, None, None)
        .filter(|(_, n)| n.pointer("/metadata/deletionTimestamp").is_some())
        .map(|(k, _)| k.1.clone())
        .collect();
    for ns in terminating {
        let mut remaining = 0;
        for id in st.resources() {
            for ((_, name), obj) in st.list(&id, Some(&ns), None) {
                remaining += 1;
                if obj.pointer("/metadata/deletionTimestamp").is_none() {
                    deletes.push((id.clone(), ns.clone(), name.clone()));
                }
            }
        }
        if remaining == 0 {
            st.remove(&ns_id, "", &ns);
        }
    }
    Sweep { deletes }
}

/// Runs sweeps whenever something was removed, until the server stops.
pub async fn run(sh: Arc<Shared>) {
    loop {
        tokio::select! {
            _ = sh.gc_wakeup.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = sh.cancel.cancelled() => return,
        }
        // Let a burst of deletions settle into one sweep.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let work = {
            let mut st = sh.lock();
            find_work(&mut st)
        };
        let ctx = WriteCtx::internal(gc_user(), objects::FieldValidation::Ignore);
        let mut again = false;
        for (id, ns, name) in work.deletes {
            let def = sh.lock().registry.storage_def(&id).cloned();
            let Some(def) = def else { continue };
            match objects::delete(&sh, &def, &ns, &name, &DeleteOpts::default(), &ctx).await {
                Ok(_) => again = true,
                Err(e) => {
                    tracing::debug!(resource = %id.plural, %ns, %name, error = %e, "garbage collection delete failed")
                }
            }
        }
        if again {
            sh.gc_wakeup.notify_one();
        }
    }
}
