//! Server-side apply and field ownership: which manager owns which fields
//! of an object (`metadata.managedFields`), how an applied configuration
//! merges into the live object, when it conflicts with other managers, and
//! what an applier's dropped fields take with them.
//!
//! Every write records its manager: an apply as an `Apply` entry holding
//! exactly the fields it names, any other write as an `Update` entry that
//! takes over the fields it changed.

use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::registry::ResourceDef;
use crate::util::now_rfc3339;

use super::Part;

pub mod fieldset;
pub mod managed;
pub mod types;
pub mod walk;

use fieldset::FieldSet;
use managed::Entry;
use types::Types;

/// Metadata fields the server sets, never owned by a manager.
const SERVER_META: [&str; 9] = [
    "name",
    "namespace",
    "creationTimestamp",
    "selfLink",
    "uid",
    "clusterName",
    "generation",
    "managedFields",
    "resourceVersion",
];

/// Drops the paths nobody owns: type information and server-set metadata.
fn strip(set: &mut FieldSet) {
    set.remove_child("f:apiVersion");
    set.remove_child("f:kind");
    let meta = set.child_mut("f:metadata");
    for f in SERVER_META {
        meta.remove_child(&fieldset::field(f));
    }
    if set.child("f:metadata").is_some_and(FieldSet::is_empty) {
        set.remove_child("f:metadata");
    }
}

fn subresource(part: Part) -> &'static str {
    match part {
        Part::Main => "",
        Part::Status => "status",
    }
}

/// Root fields every object of the kind has, so that a write adding
/// under them does not own them: built-in objects always carry their
/// spec and status structs.
fn always_present(def: &ResourceDef) -> &'static [&'static str] {
    if def.custom {
        &["metadata"]
    } else {
        &["metadata", "spec", "status"]
    }
}

fn managed_fields(obj: &Value) -> Option<&Value> {
    obj.get("metadata").and_then(|m| m.get("managedFields"))
}

fn set_managed_fields(obj: &mut Value, entries: Vec<Entry>) {
    let meta = crate::util::meta_mut(obj);
    if entries.is_empty() {
        meta.remove("managedFields");
    } else {
        meta.insert("managedFields".into(), managed::encode(entries));
    }
}

/// Records a create or update by `manager` in `new`'s managedFields.
///
/// The entries start from the request's own managedFields when they are
/// valid and not empty (a client may rewrite them; `[{}]` clears them),
/// from `old`'s otherwise. The manager's `Update` entry then takes every
/// field the write added or changed, from every other manager, and drops
/// what it removed. An empty `manager` (a write from inside the process)
/// records nothing.
pub fn record_update(
    def: &ResourceDef,
    part: Part,
    old: Option<&Value>,
    new: &mut Value,
    manager: &str,
) {
    let old_raw = old.and_then(managed_fields).cloned();
    let requested = managed_fields(new).cloned();
    let from_old = || managed::decode(old_raw.as_ref()).unwrap_or_default();
    let (mut entries, untouched) = if part == Part::Status {
        (from_old(), true)
    } else if managed::is_reset(requested.as_ref()) {
        (Vec::new(), false)
    } else {
        match managed::decode(requested.as_ref()) {
            Ok(es) if !es.is_empty() => {
                let same = requested == old_raw;
                (es, same)
            }
            _ => (from_old(), true),
        }
    };
    let restore_old = |new: &mut Value| {
        let meta = crate::util::meta_mut(new);
        match &old_raw {
            Some(raw) => meta.insert("managedFields".into(), raw.clone()),
            None => meta.remove("managedFields"),
        };
    };
    if manager.is_empty() {
        if untouched {
            restore_old(new);
        } else {
            set_managed_fields(new, entries);
        }
        return;
    }
    let types = Types::of(def);
    let empty = json!({});
    let mut changes = walk::compare(old.unwrap_or(&empty), new, &types, always_present(def));
    strip(&mut changes.changed);
    strip(&mut changes.removed);
    if changes.changed.is_empty() && changes.removed.is_empty() && untouched {
        restore_old(new);
        return;
    }
    let me = Entry {
        manager: manager.to_string(),
        apply: false,
        api_version: def.api_version(),
        time: None,
        subresource: subresource(part).to_string(),
        set: FieldSet::default(),
    };
    for e in entries.iter_mut().filter(|e| !e.same_manager(&me)) {
        e.set = e.set.difference(&changes.changed);
    }
    let pos = match entries.iter().position(|e| e.same_manager(&me)) {
        Some(i) => i,
        None => {
            entries.push(me);
            entries.len() - 1
        }
    };
    let own = &mut entries[pos];
    let mut set = own.set.without_subtrees(&changes.removed);
    set.union(&changes.changed);
    own.set = set;
    if !changes.changed.is_empty() || own.time.is_none() {
        own.time = Some(now_rfc3339());
    }
    entries.retain(|e| !e.set.is_empty());
    managed::cap(&mut entries);
    set_managed_fields(new, entries);
}

/// Parses an apply body (YAML, or JSON as a subset of it) into an object
/// and checks its type and identity against the resource and the URL.
pub fn parse_config(
    def: &ResourceDef,
    ns: &str,
    name: &str,
    body: &[u8],
) -> Result<Value, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    let mut config: Value = serde_yaml::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    let Some(obj) = config.as_object_mut() else {
        return Err(ApiError::bad_request(
            "error decoding YAML: an applied configuration must be an object",
        ));
    };
    let av = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if av != def.api_version() {
        return Err(ApiError::bad_request(format!(
            "Incorrect version specified in apply patch. Specified patch version: {av}, expected: {}",
            def.api_version()
        )));
    }
    match obj.get("kind").and_then(Value::as_str) {
        None | Some("") => {
            return Err(ApiError::bad_request(
                "Object 'Kind' is missing in the apply patch",
            ));
        }
        Some(k) if k != def.kind => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                def.kind
            )));
        }
        Some(_) => {}
    }
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(meta) = meta.as_object_mut() else {
        return Err(ApiError::bad_request(
            "error decoding YAML: metadata must be an object",
        ));
    };
    if meta.get("managedFields").is_some_and(|m| !m.is_null()) {
        return Err(ApiError::bad_request("metadata.managedFields must be nil"));
    }
    match meta.get("name").and_then(Value::as_str) {
        Some(n) if n != name => {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({name})"
            )));
        }
        Some(_) => {}
        None => {
            meta.insert("name".into(), json!(name));
        }
    }
    if def.namespaced {
        match meta.get("namespace").and_then(Value::as_str) {
            Some(n) if !n.is_empty() && n != ns => {
                return Err(ApiError::bad_request(format!(
                    "the namespace of the object ({n}) does not match the namespace on the URL ({ns})"
                )));
            }
            _ => {
                meta.insert("namespace".into(), json!(ns));
            }
        }
    }
    Ok(config)
}

/// What a subresource's apply may set: the main resource never applies
/// status where status is its own subresource, `/status` applies only it.
fn reset_fields(def: &ResourceDef, part: Part, config: &mut Value) {
    let Some(obj) = config.as_object_mut() else {
        return;
    };
    match part {
        Part::Main if def.status_subresource => {
            obj.remove("status");
        }
        Part::Main => {}
        Part::Status => obj.retain(|k, _| matches!(k.as_str(), "apiVersion" | "kind" | "status")),
    }
}

/// Applies `config` for `manager` to `live` (or to nothing, creating):
/// merges it, refuses with 409 when it would change fields other managers
/// own (unless `force`, which takes them over), removes what the manager
/// applied before and nobody owns now, and records the manager's `Apply`
/// entry. A no-op apply leaves the object exactly as it was.
pub fn apply(
    def: &ResourceDef,
    part: Part,
    live: Option<&Value>,
    mut config: Value,
    manager: &str,
    force: bool,
) -> Result<Value, ApiError> {
    reset_fields(def, part, &mut config);
    let types = Types::of(def);
    let mut set = walk::config_set(&config, &types).map_err(|e| {
        ApiError::bad_request(format!(
            "failed to create typed patch object ({}, Kind={}): {e}",
            def.api_version(),
            def.kind
        ))
    })?;
    strip(&mut set);
    let empty = json!({});
    let live = live.unwrap_or(&empty);
    let mut entries = managed::decode(managed_fields(live)).unwrap_or_default();
    let mut merged = live.clone();
    walk::merge(&mut merged, &config, &types);
    let mut changes = walk::compare(live, &merged, &types, always_present(def));
    strip(&mut changes.changed);
    let me = Entry {
        manager: manager.to_string(),
        apply: true,
        api_version: def.api_version(),
        time: Some(now_rfc3339()),
        subresource: subresource(part).to_string(),
        set,
    };
    let mut conflicts = Vec::new();
    for e in entries.iter().filter(|e| !e.same_manager(&me)) {
        for path in e.set.intersection(&changes.changed).paths() {
            conflicts.push((e.describe(), path));
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(managed::conflict_error(&conflicts));
    }
    for e in entries.iter_mut().filter(|e| !e.same_manager(&me)) {
        e.set = e.set.difference(&changes.changed);
    }
    let previous = entries.iter().position(|e| e.same_manager(&me));
    let last = previous.map(|i| entries[i].set.clone()).unwrap_or_default();
    let mut me = me;
    match previous {
        Some(i) => {
            if changes.changed.is_empty() && entries[i].set == me.set {
                me.time = entries[i].time.clone();
            }
            entries[i] = me;
        }
        None => entries.push(me),
    }
    let mut owned = FieldSet::default();
    for e in &entries {
        owned.union(&e.set);
    }
    walk::prune(&mut merged, &last, &owned, &types);
    entries.retain(|e| !e.set.is_empty());
    set_managed_fields(&mut merged, entries);
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm_def() -> ResourceDef {
        crate::registry::Registry::builtin()
            .get("", "v1", "configmaps")
            .cloned()
            .expect("builtin")
    }

    fn cfg(data: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ns"}, "data": data})
    }

    fn entries(obj: &Value) -> Vec<Entry> {
        managed::decode(managed_fields(obj)).expect("valid managedFields")
    }

    #[test]
    fn apply_creates_with_one_apply_entry() {
        let def = cm_def();
        let obj =
            apply(&def, Part::Main, None, cfg(json!({"a": "1"})), "m1", false).expect("applies");
        assert_eq!(obj["data"], json!({"a": "1"}));
        let es = entries(&obj);
        assert_eq!(es.len(), 1);
        assert!(es[0].apply);
        assert_eq!(es[0].manager, "m1");
        assert_eq!(es[0].api_version, "v1");
        assert_eq!(es[0].set.to_fields_v1(), json!({"f:data": {"f:a": {}}}));
    }

    #[test]
    fn a_second_manager_conflicts_on_a_different_value_and_shares_an_equal_one() {
        let def = cm_def();
        let live = apply(
            &def,
            Part::Main,
            None,
            cfg(json!({"a": "1", "b": "2"})),
            "m1",
            false,
        )
        .expect("applies");
        let err = apply(
            &def,
            Part::Main,
            Some(&live),
            cfg(json!({"a": "9", "b": "8"})),
            "m2",
            false,
        )
        .expect_err("conflicts");
        assert_eq!(err.http_code(), 409);
        assert!(
            err.message
                .starts_with("Apply failed with 2 conflicts: conflicts with \"m1\":"),
            "{}",
            err.message
        );
        let shared = apply(
            &def,
            Part::Main,
            Some(&live),
            cfg(json!({"a": "1"})),
            "m2",
            false,
        )
        .expect("an equal value is shared");
        let es = entries(&shared);
        assert_eq!(es.len(), 2);
        assert!(
            es.iter()
                .all(|e| e.set.child("f:data").and_then(|d| d.child("f:a")).is_some())
        );
    }

    #[test]
    fn force_takes_the_fields_over() {
        let def = cm_def();
        let live = apply(
            &def,
            Part::Main,
            None,
            cfg(json!({"a": "1", "b": "2"})),
            "m1",
            false,
        )
        .expect("applies");
        let forced = apply(
            &def,
            Part::Main,
            Some(&live),
            cfg(json!({"a": "9"})),
            "m2",
            true,
        )
        .expect("forced");
        assert_eq!(forced["data"], json!({"a": "9", "b": "2"}));
        let es = entries(&forced);
        let m1 = es.iter().find(|e| e.manager == "m1").expect("m1 keeps b");
        assert_eq!(m1.set.to_fields_v1(), json!({"f:data": {"f:b": {}}}));
        let m2 = es.iter().find(|e| e.manager == "m2").expect("m2");
        assert_eq!(m2.set.to_fields_v1(), json!({"f:data": {"f:a": {}}}));
        // m1 now conflicts on a, which it no longer owns.
        let err = apply(
            &def,
            Part::Main,
            Some(&forced),
            cfg(json!({"a": "1", "b": "2"})),
            "m1",
            false,
        )
        .expect_err("m2 owns a");
        assert_eq!(
            err.message,
            "Apply failed with 1 conflict: conflict with \"m2\": .data.a"
        );
    }

    #[test]
    fn dropped_fields_are_removed_unless_someone_else_owns_them() {
        let def = cm_def();
        let live = apply(
            &def,
            Part::Main,
            None,
            cfg(json!({"a": "1", "b": "2", "c": "3"})),
            "m1",
            false,
        )
        .expect("applies");
        let live = apply(
            &def,
            Part::Main,
            Some(&live),
            cfg(json!({"c": "3"})),
            "m2",
            false,
        )
        .expect("shares c");
        let after = apply(
            &def,
            Part::Main,
            Some(&live),
            cfg(json!({"a": "1"})),
            "m1",
            false,
        )
        .expect("drops b and c");
        assert_eq!(after["data"], json!({"a": "1", "c": "3"}));
    }

    #[test]
    fn a_manager_applying_no_fields_keeps_no_entry() {
        let def = cm_def();
        let only_name = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        let obj = apply(&def, Part::Main, None, only_name, "m1", false).expect("applies");
        assert!(obj["metadata"].get("managedFields").is_none(), "{obj}");
    }

    #[test]
    fn a_no_op_apply_changes_nothing() {
        let def = cm_def();
        let live =
            apply(&def, Part::Main, None, cfg(json!({"a": "1"})), "m1", false).expect("applies");
        let mut aged = live.clone();
        aged["metadata"]["managedFields"][0]["time"] = json!("2000-01-01T00:00:00Z");
        let again = apply(
            &def,
            Part::Main,
            Some(&aged),
            cfg(json!({"a": "1"})),
            "m1",
            false,
        )
        .expect("applies");
        assert_eq!(again, aged);
    }

    #[test]
    fn updates_take_changed_fields_from_appliers() {
        let def = cm_def();
        let live = apply(
            &def,
            Part::Main,
            None,
            cfg(json!({"a": "1", "b": "2"})),
            "m1",
            false,
        )
        .expect("applies");
        let mut new = live.clone();
        new["data"]["a"] = json!("5");
        new["data"]["z"] = json!("6");
        record_update(&def, Part::Main, Some(&live), &mut new, "editor");
        let es = entries(&new);
        let editor = es.iter().find(|e| e.manager == "editor").expect("editor");
        assert!(!editor.apply);
        assert_eq!(
            editor.set.to_fields_v1(),
            json!({"f:data": {"f:a": {}, "f:z": {}}})
        );
        let m1 = es.iter().find(|e| e.manager == "m1").expect("m1");
        assert_eq!(m1.set.to_fields_v1(), json!({"f:data": {"f:b": {}}}));
    }

    #[test]
    fn an_update_with_one_empty_entry_clears_managed_fields() {
        let def = cm_def();
        let live =
            apply(&def, Part::Main, None, cfg(json!({"a": "1"})), "m1", false).expect("applies");
        let mut new = live.clone();
        new["metadata"]["managedFields"] = json!([{}]);
        record_update(&def, Part::Main, Some(&live), &mut new, "editor");
        assert!(new["metadata"].get("managedFields").is_none(), "{new}");
        let mut kept = live.clone();
        kept["metadata"]["managedFields"] = json!([]);
        record_update(&def, Part::Main, Some(&live), &mut kept, "editor");
        assert_eq!(kept, live, "an empty list keeps them");
    }

    #[test]
    fn creates_own_everything_but_server_fields() {
        let def = cm_def();
        let mut new = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c",
            "uid": "u", "labels": {"l": "v"}}, "data": {"a": "1"}});
        record_update(&def, Part::Main, None, &mut new, "kubectl-create");
        let es = entries(&new);
        assert_eq!(
            es[0].set.to_fields_v1(),
            json!({"f:data": {".": {}, "f:a": {}}, "f:metadata": {"f:labels": {".": {}, "f:l": {}}}})
        );
        assert!(es[0].time.is_some());
    }

    #[test]
    fn configs_are_checked_against_the_url_and_the_type() {
        let def = cm_def();
        let ok = parse_config(
            &def,
            "ns",
            "c",
            b"apiVersion: v1\nkind: ConfigMap\ndata:\n  a: '1'\n",
        )
        .expect("YAML parses");
        assert_eq!(ok["metadata"], json!({"name": "c", "namespace": "ns"}));
        let e = parse_config(
            &def,
            "ns",
            "c",
            br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"d"}}"#,
        )
        .expect_err("name mismatch");
        assert_eq!(e.http_code(), 400);
        assert!(
            e.message.contains("(d)") && e.message.contains("(c)"),
            "{}",
            e.message
        );
        let e = parse_config(
            &def,
            "ns",
            "c",
            br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"namespace":"x"}}"#,
        )
        .expect_err("namespace mismatch");
        assert!(
            e.message.contains("(x)") && e.message.contains("(ns)"),
            "{}",
            e.message
        );
        let e = parse_config(
            &def,
            "ns",
            "c",
            br#"{"apiVersion":"apps/v1","kind":"ConfigMap"}"#,
        )
        .expect_err("version");
        assert!(e.message.contains("Incorrect version"), "{}", e.message);
        let e = parse_config(&def, "ns", "c", br#"{"apiVersion":"v1"}"#).expect_err("kind");
        assert!(e.message.contains("Kind"), "{}", e.message);
        let e = parse_config(
            &def,
            "ns",
            "c",
            br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"managedFields":[]}}"#,
        )
        .expect_err("managedFields");
        assert!(
            e.message.contains("managedFields must be nil"),
            "{}",
            e.message
        );
        assert!(parse_config(&def, "ns", "c", b"- a\n- b\n").is_err());
        assert!(parse_config(&def, "ns", "c", b"{unclosed").is_err());
        let e = apply(
            &def,
            Part::Main,
            None,
            json!({"apiVersion": "v1", "kind": "Pod",
            "spec": {"containers": [{"image": "x"}]}}),
            "m",
            false,
        )
        .expect_err("no key");
        assert!(
            e.message.contains("failed to create typed patch object"),
            "{}",
            e.message
        );
    }
}
