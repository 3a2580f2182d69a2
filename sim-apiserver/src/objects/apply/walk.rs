//! Walks over objects with their list types: the field set an applied
//! configuration names, what changed between two objects, the merge of a
//! configuration into a live object, and the removal of fields an applier
//! stopped applying.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value};

use super::fieldset::{self, FieldSet};
use super::types::{ListType, Types};

/// The path element of a keyed list's item, or why it has none (a key
/// field missing without a default, or an item that is not an object).
fn item_key(item: &Value, keys: &[(String, Option<Value>)]) -> Result<String, String> {
    let Some(obj) = item.as_object() else {
        return Err("associative list with keys has an element that is not a map".into());
    };
    let mut fields = Vec::with_capacity(keys.len());
    for (k, default) in keys {
        match obj.get(k).filter(|v| !v.is_null()).or(default.as_ref()) {
            Some(v) => fields.push((k.as_str(), v)),
            None => {
                return Err(format!(
                    "associative list with keys has an element that omits key field {k:?} (and doesn't have default value)"
                ));
            }
        }
    }
    Ok(fieldset::key(&fields))
}

/// The path element of each item of a list, or `None` when the list is
/// atomic or some item has no valid, unique key.
fn item_elements(items: &[Value], lt: &ListType) -> Option<Vec<String>> {
    let pes: Vec<String> = match lt {
        ListType::Atomic => return None,
        ListType::Set => items.iter().map(fieldset::value).collect(),
        ListType::Map(keys) => items
            .iter()
            .map(|i| item_key(i, keys))
            .collect::<Result<_, _>>()
            .ok()?,
    };
    let unique: HashSet<&String> = pes.iter().collect();
    (unique.len() == pes.len()).then_some(pes)
}

fn printable(path: &[String]) -> String {
    let pes: Vec<String> = path.iter().map(|f| fieldset::field(f)).collect();
    fieldset::path_string(&pes)
}

/// The field set an applied configuration names: every scalar, every list
/// item, every null or empty object and every atomic list. Keyed list items
/// without a key, or with a key twice, are errors naming the list.
pub fn config_set(v: &Value, types: &Types<'_>) -> Result<FieldSet, String> {
    let mut out = FieldSet::default();
    let mut path = Vec::new();
    config_walk(v, types, &mut path, &mut out)?;
    Ok(out)
}

fn config_walk(
    v: &Value,
    types: &Types<'_>,
    path: &mut Vec<String>,
    node: &mut FieldSet,
) -> Result<(), String> {
    match v {
        Value::Object(m) if m.is_empty() && !path.is_empty() => node.set_member(),
        Value::Object(m) => {
            for (k, child) in m {
                path.push(k.clone());
                let r = config_walk(child, types, path, node.child_mut(&fieldset::field(k)));
                path.pop();
                r?;
            }
        }
        Value::Array(items) => match types.list_type(path) {
            ListType::Atomic => node.set_member(),
            ListType::Set => {
                for item in items {
                    node.child_mut(&fieldset::value(item)).set_member();
                }
            }
            ListType::Map(keys) => {
                let mut seen = HashSet::new();
                for (i, item) in items.iter().enumerate() {
                    let pe = item_key(item, &keys)
                        .map_err(|e| format!("{}: element {i}: {e}", printable(path)))?;
                    if !seen.insert(pe.clone()) {
                        return Err(format!(
                            "{}: duplicate entries for key {}",
                            printable(path),
                            fieldset::path_string(std::slice::from_ref(&pe))
                        ));
                    }
                    let child = node.child_mut(&pe);
                    child.set_member();
                    config_walk(item, types, path, child)?;
                }
            }
        },
        _ => node.set_member(),
    }
    Ok(())
}

/// What changed from one object to the next: paths added or modified, and
/// paths removed.
#[derive(Debug, Default)]
pub struct Changes {
    /// Added or modified paths (members).
    pub changed: FieldSet,
    /// Removed paths (members; everything below them went too).
    pub removed: FieldSet,
}

/// Compares two objects. A field or item that appears is a member with its
/// whole subtree, except the root fields `keep_root` names, which exist on
/// every object of the kind.
pub fn compare(old: &Value, new: &Value, types: &Types<'_>, keep_root: &[&str]) -> Changes {
    let mut out = Changes::default();
    let mut path = Vec::new();
    diff(
        old,
        new,
        types,
        &mut path,
        &mut out.changed,
        &mut out.removed,
        keep_root,
    );
    out
}

fn diff(
    old: &Value,
    new: &Value,
    types: &Types<'_>,
    path: &mut Vec<String>,
    ch: &mut FieldSet,
    rm: &mut FieldSet,
    keep_root: &[&str],
) {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            for (k, nv) in n {
                let pe = fieldset::field(k);
                path.push(k.clone());
                match o.get(k) {
                    None => {
                        let member = !(path.len() == 1 && keep_root.contains(&k.as_str()));
                        added(nv, types, path, ch.child_mut(&pe), member);
                    }
                    Some(ov) => {
                        let mut c = FieldSet::default();
                        let mut r = FieldSet::default();
                        diff(ov, nv, types, path, &mut c, &mut r, keep_root);
                        if !c.is_empty() {
                            ch.child_mut(&pe).union(&c);
                        }
                        if !r.is_empty() {
                            rm.child_mut(&pe).union(&r);
                        }
                    }
                }
                path.pop();
            }
            for k in o.keys().filter(|k| !n.contains_key(*k)) {
                rm.child_mut(&fieldset::field(k)).set_member();
            }
        }
        (Value::Array(o), Value::Array(n)) => {
            let lt = types.list_type(path);
            match (item_elements(o, &lt), item_elements(n, &lt)) {
                (Some(ope), Some(npe)) => {
                    let olds: HashMap<&String, &Value> = ope.iter().zip(o).collect();
                    for (pe, item) in npe.iter().zip(n) {
                        match olds.get(pe) {
                            Some(oi) if lt != ListType::Set => {
                                let mut c = FieldSet::default();
                                let mut r = FieldSet::default();
                                diff(oi, item, types, path, &mut c, &mut r, keep_root);
                                if !c.is_empty() {
                                    ch.child_mut(pe).union(&c);
                                }
                                if !r.is_empty() {
                                    rm.child_mut(pe).union(&r);
                                }
                            }
                            Some(_) => {}
                            None => added(item, types, path, ch.child_mut(pe), true),
                        }
                    }
                    let news: HashSet<&String> = npe.iter().collect();
                    for pe in ope.iter().filter(|pe| !news.contains(pe)) {
                        rm.child_mut(pe).set_member();
                    }
                }
                _ => {
                    if o != n {
                        ch.set_member();
                    }
                }
            }
        }
        (a, b) => {
            if a != b {
                ch.set_member();
            }
        }
    }
}

fn added(v: &Value, types: &Types<'_>, path: &mut Vec<String>, node: &mut FieldSet, member: bool) {
    if member {
        node.set_member();
    }
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                path.push(k.clone());
                added(
                    child,
                    types,
                    path,
                    node.child_mut(&fieldset::field(k)),
                    true,
                );
                path.pop();
            }
        }
        Value::Array(items) => {
            let lt = types.list_type(path);
            match item_elements(items, &lt) {
                Some(pes) if !items.is_empty() => {
                    for (pe, item) in pes.iter().zip(items) {
                        if lt == ListType::Set {
                            node.child_mut(pe).set_member();
                        } else {
                            added(item, types, path, node.child_mut(pe), true);
                        }
                    }
                }
                _ => node.set_member(),
            }
        }
        _ => node.set_member(),
    }
}

/// Merges an applied configuration into a live object: objects field by
/// field, keyed lists item by item (new items after the live ones), set
/// lists as unions, atomic lists and scalars replaced; a null removes.
pub fn merge(live: &mut Value, config: &Value, types: &Types<'_>) {
    let mut path = Vec::new();
    merge_at(live, config, types, &mut path);
}

fn merge_at(live: &mut Value, config: &Value, types: &Types<'_>, path: &mut Vec<String>) {
    match config {
        Value::Object(c) => {
            if !live.is_object() {
                *live = Value::Object(Map::new());
            }
            let Some(l) = live.as_object_mut() else {
                return;
            };
            for (k, cv) in c {
                if cv.is_null() {
                    l.remove(k);
                    continue;
                }
                path.push(k.clone());
                let slot = l.entry(k.clone()).or_insert(Value::Null);
                merge_at(slot, cv, types, path);
                path.pop();
            }
        }
        Value::Array(items) => {
            let lt = types.list_type(path);
            let live_items = live.as_array().cloned().unwrap_or_default();
            let (Some(lpe), Some(cpe)) =
                (item_elements(&live_items, &lt), item_elements(items, &lt))
            else {
                *live = config.clone();
                return;
            };
            let mut out = live_items;
            let index: HashMap<String, usize> =
                lpe.into_iter().enumerate().map(|(i, pe)| (pe, i)).collect();
            for (pe, item) in cpe.iter().zip(items) {
                match index.get(pe) {
                    Some(&i) if lt != ListType::Set => merge_at(&mut out[i], item, types, path),
                    Some(_) => {}
                    None => {
                        let mut fresh = Value::Null;
                        merge_at(&mut fresh, item, types, path);
                        out.push(fresh);
                    }
                }
            }
            *live = Value::Array(out);
        }
        other => *live = other.clone(),
    }
}

fn owns_any(node: Option<&FieldSet>) -> bool {
    node.is_some_and(|n| !n.is_empty())
}

/// Removes from `obj` every path of `last` (what the applier applied
/// before) that no manager owns now, neither the path nor anything below
/// it; `owned` is the union of every manager's set after this apply.
pub fn prune(obj: &mut Value, last: &FieldSet, owned: &FieldSet, types: &Types<'_>) {
    let mut path = Vec::new();
    prune_at(obj, last, Some(owned), types, &mut path, &[]);
}

fn prune_at(
    obj: &mut Value,
    last: &FieldSet,
    owned: Option<&FieldSet>,
    types: &Types<'_>,
    path: &mut Vec<String>,
    keys: &[String],
) {
    let gone = |pe: &str, l: &FieldSet| l.is_member() && !owns_any(owned.and_then(|o| o.child(pe)));
    match obj {
        Value::Object(m) => {
            let names: Vec<String> = m.keys().cloned().collect();
            for k in names {
                let pe = fieldset::field(&k);
                let Some(l) = last.child(&pe) else { continue };
                if gone(&pe, l) {
                    // A kept item keeps its key, whoever owns it.
                    if !keys.contains(&k) {
                        m.remove(&k);
                    }
                } else if let Some(v) = m.get_mut(&k) {
                    path.push(k);
                    prune_at(v, l, owned.and_then(|o| o.child(&pe)), types, path, &[]);
                    path.pop();
                }
            }
        }
        Value::Array(items) => {
            let lt = types.list_type(path);
            let Some(pes) = item_elements(items, &lt) else {
                return;
            };
            let key_names: Vec<String> = match &lt {
                ListType::Map(ks) => ks.iter().map(|(k, _)| k.clone()).collect(),
                _ => Vec::new(),
            };
            let mut kept = Vec::with_capacity(items.len());
            for (pe, mut item) in pes.into_iter().zip(std::mem::take(items)) {
                match last.child(&pe) {
                    Some(l) if gone(&pe, l) => {}
                    Some(l) => {
                        let o = owned.and_then(|o| o.child(&pe));
                        prune_at(&mut item, l, o, types, path, &key_names);
                        kept.push(item);
                    }
                    None => kept.push(item),
                }
            }
            *items = kept;
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const BUILTIN: Types<'static> = Types::builtin();

    fn fs(v: Value) -> FieldSet {
        FieldSet::from_fields_v1(&v).expect("valid")
    }

    #[test]
    fn config_sets_key_containers_and_ports_and_mark_set_items() {
        let cfg = json!({"metadata": {"labels": {"app": "x"}, "finalizers": ["a"]},
            "spec": {"replicas": 2, "strategy": {}, "template": {"spec": {"containers": [
                {"name": "c", "image": "i", "ports": [{"containerPort": 80}],
                 "env": [{"name": "E", "value": "1"}], "args": ["a", "b"]}]}}}});
        let s = config_set(&cfg, &BUILTIN).expect("valid");
        assert_eq!(
            s.to_fields_v1(),
            json!({"f:metadata": {"f:finalizers": {"v:\"a\"": {}}, "f:labels": {"f:app": {}}},
                "f:spec": {"f:replicas": {}, "f:strategy": {}, "f:template": {"f:spec": {"f:containers": {
                    "k:{\"name\":\"c\"}": {".": {}, "f:args": {}, "f:env": {"k:{\"name\":\"E\"}": {".": {}, "f:name": {}, "f:value": {}}},
                        "f:image": {}, "f:name": {},
                        "f:ports": {"k:{\"containerPort\":80,\"protocol\":\"TCP\"}": {".": {}, "f:containerPort": {}}}}}}}}})
        );
    }

    #[test]
    fn config_sets_refuse_items_without_keys_and_duplicates() {
        let missing = json!({"spec": {"containers": [{"image": "i"}]}});
        let err = config_set(&missing, &BUILTIN).expect_err("no key");
        assert!(err.contains(".spec.containers: element 0"), "{err}");
        assert!(err.contains("omits key field \"name\""), "{err}");
        let dup = json!({"spec": {"containers": [{"name": "a"}, {"name": "a"}]}});
        let err = config_set(&dup, &BUILTIN).expect_err("duplicate");
        assert!(
            err.contains("duplicate entries for key [name=\"a\"]"),
            "{err}"
        );
    }

    #[test]
    fn merge_keys_items_unions_sets_and_replaces_atomics() {
        let mut live = json!({"metadata": {"finalizers": ["a"]}, "spec": {
            "containers": [{"name": "a", "image": "1", "args": ["x"]}, {"name": "b", "image": "2"}],
            "tolerations": [{"key": "t"}]}});
        let cfg = json!({"metadata": {"finalizers": ["b", "a"]}, "spec": {
            "containers": [{"name": "b", "image": "3"}, {"name": "c", "image": "4"}, {"name": "a", "args": ["y"]}],
            "tolerations": [{"key": "u"}], "nodeName": null}});
        merge(&mut live, &cfg, &BUILTIN);
        assert_eq!(
            live,
            json!({"metadata": {"finalizers": ["a", "b"]}, "spec": {
                "containers": [{"name": "a", "image": "1", "args": ["y"]}, {"name": "b", "image": "3"}, {"name": "c", "image": "4"}],
                "tolerations": [{"key": "u"}]}})
        );
    }

    #[test]
    fn compare_reports_modified_added_and_removed_paths() {
        let old = json!({"metadata": {"name": "x"}, "spec": {"replicas": 1, "paused": true,
            "template": {"spec": {"containers": [{"name": "a", "image": "1"}]}}}});
        let new = json!({"metadata": {"name": "x", "labels": {"l": "v"}}, "spec": {"replicas": 2,
            "template": {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}]}}}});
        let c = compare(&old, &new, &BUILTIN, &["metadata", "spec"]);
        assert_eq!(
            c.changed.to_fields_v1(),
            json!({"f:metadata": {"f:labels": {".": {}, "f:l": {}}}, "f:spec": {"f:replicas": {},
                "f:template": {"f:spec": {"f:containers": {"k:{\"name\":\"b\"}": {".": {}, "f:image": {}, "f:name": {}}}}}}})
        );
        assert_eq!(c.removed, fs(json!({"f:spec": {"f:paused": {}}})));
        let none = compare(&new, &new, &BUILTIN, &[]);
        assert!(none.changed.is_empty() && none.removed.is_empty());
    }

    #[test]
    fn prune_removes_only_what_nobody_owns() {
        let mut obj = json!({"metadata": {"labels": {"a": "1", "b": "2"}}, "spec": {"containers": [
            {"name": "x", "image": "1", "resources": {"limits": {"cpu": "1"}}}, {"name": "y", "image": "2"}]}});
        let last = fs(
            json!({"f:metadata": {"f:labels": {"f:a": {}, "f:b": {}}}, "f:spec": {"f:containers": {
            "k:{\"name\":\"x\"}": {".": {}, "f:name": {}, "f:image": {}},
            "k:{\"name\":\"y\"}": {".": {}, "f:name": {}, "f:image": {}}}}}),
        );
        // Still applied: label a. Owned by someone else: x's resources.
        let owned = fs(
            json!({"f:metadata": {"f:labels": {"f:a": {}}}, "f:spec": {"f:containers": {
            "k:{\"name\":\"x\"}": {"f:resources": {"f:limits": {"f:cpu": {}}}}}}}),
        );
        prune(&mut obj, &last, &owned, &BUILTIN);
        assert_eq!(
            obj,
            json!({"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [
                {"name": "x", "resources": {"limits": {"cpu": "1"}}}]}})
        );
    }
}
