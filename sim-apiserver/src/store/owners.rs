//! Owner references as the store answers them: who depends on whom, and
//! orphaning. The garbage collector and deletes both ask; neither owns it.

use serde_json::Value;

use crate::store::State;

/// The finalizer of foreground deletion.
pub const FOREGROUND: &str = "foregroundDeletion";

/// Whether `obj` names `uid` among its owners.
pub fn owned_by(obj: &Value, uid: &str) -> bool {
    obj.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .is_some_and(|r| r.iter().any(|o| o["uid"] == uid))
}

/// Whether any object names `uid` as an owner.
pub fn has_dependents(st: &State, uid: &str) -> bool {
    st.resources()
        .iter()
        .any(|id| st.list(id, None, None).any(|(_, o)| owned_by(o, uid)))
}

/// Removes owner references to `uid` from every object (orphan deletion).
pub fn orphan_dependents(st: &mut State, uid: &str) {
    let mut changed = Vec::new();
    for id in st.resources() {
        for ((ns, name), obj) in st.list(&id, None, None) {
            let refs = obj
                .pointer("/metadata/ownerReferences")
                .and_then(Value::as_array);
            if refs.is_some_and(|r| r.iter().any(|o| o["uid"] == uid)) {
                let mut o = (**obj).clone();
                if let Some(list) = o
                    .pointer_mut("/metadata/ownerReferences")
                    .and_then(Value::as_array_mut)
                {
                    list.retain(|r| r["uid"] != uid);
                }
                changed.push((id.clone(), ns.clone(), name.clone(), o));
            }
        }
    }
    for (id, ns, name, o) in changed {
        st.put(&id, &ns, &name, o);
    }
}
