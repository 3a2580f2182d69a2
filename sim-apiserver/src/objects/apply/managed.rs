//! `metadata.managedFields`: one entry per manager and operation, read
//! from and written to objects, and the conflict error of an apply.

use serde_json::{Value, json};

use super::fieldset::{FieldSet, path_string};
use crate::error::{ApiError, Reason};

/// Managers beyond this many `Update` entries are merged, oldest first,
/// into one `ancient-changes` entry per API version, as the real server
/// caps them so that an object cannot grow without bound.
const MAX_UPDATE_MANAGERS: usize = 10;
const ANCIENT: &str = "ancient-changes";

/// One manager's fields.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The field manager.
    pub manager: String,
    /// `Apply` (true) or `Update`.
    pub apply: bool,
    /// The API version the fields were written in.
    pub api_version: String,
    /// When the manager last changed the object.
    pub time: Option<String>,
    /// `status` for writes to the status subresource, empty otherwise.
    pub subresource: String,
    /// The fields it owns.
    pub set: FieldSet,
}

impl Entry {
    /// Whether both entries are the same manager's: an applier is one
    /// entry whatever its API version; an updater is one per version.
    pub fn same_manager(&self, other: &Entry) -> bool {
        self.manager == other.manager
            && self.apply == other.apply
            && self.subresource == other.subresource
            && (self.apply || self.api_version == other.api_version)
    }

    /// The manager as conflict messages name it.
    pub fn describe(&self) -> String {
        let mut s = format!("{:?}", self.manager);
        if !self.subresource.is_empty() {
            s.push_str(&format!(" with subresource {:?}", self.subresource));
        }
        if !self.apply {
            s.push_str(&format!(" using {}", self.api_version));
        }
        s
    }

    fn to_json(&self) -> Value {
        let mut v = json!({
            "manager": self.manager,
            "operation": if self.apply { "Apply" } else { "Update" },
            "apiVersion": self.api_version,
        });
        if let Some(t) = &self.time {
            v["time"] = json!(t);
        }
        v["fieldsType"] = json!("FieldsV1");
        v["fieldsV1"] = self.set.to_fields_v1();
        if !self.subresource.is_empty() {
            v["subresource"] = json!(self.subresource);
        }
        v
    }

    fn from_json(v: &Value) -> Result<Entry, String> {
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or_default();
        let apply = match s("operation") {
            "Apply" => true,
            "Update" => false,
            other => return Err(format!("unknown operation {other:?}")),
        };
        let set = match v.get("fieldsV1") {
            None | Some(Value::Null) => FieldSet::default(),
            Some(f) => {
                if s("fieldsType") != "FieldsV1" {
                    return Err(format!("unknown fieldsType {:?}", s("fieldsType")));
                }
                FieldSet::from_fields_v1(f)?
            }
        };
        Ok(Entry {
            manager: s("manager").to_string(),
            apply,
            api_version: s("apiVersion").to_string(),
            time: v.get("time").and_then(Value::as_str).map(str::to_string),
            subresource: s("subresource").to_string(),
            set,
        })
    }
}

/// Whether a request's managedFields ask for them to be cleared: a list of
/// one empty entry.
pub fn is_reset(v: Option<&Value>) -> bool {
    matches!(v, Some(Value::Array(a)) if a.len() == 1 && a[0].as_object().is_some_and(|o| o.is_empty()))
}

/// The entries of a `managedFields` list; an entry that does not decode
/// makes the whole list invalid, as on the real server.
pub fn decode(v: Option<&Value>) -> Result<Vec<Entry>, String> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(Entry::from_json).collect(),
        Some(other) => Err(format!("managedFields must be a list, got {other}")),
    }
}

/// The `managedFields` list of the entries: appliers first, then by time,
/// manager and API version, as the real server sorts them.
pub fn encode(mut entries: Vec<Entry>) -> Value {
    entries.sort_by(|a, b| {
        (!a.apply, &a.time, &a.manager, &a.api_version).cmp(&(
            !b.apply,
            &b.time,
            &b.manager,
            &b.api_version,
        ))
    });
    Value::Array(entries.iter().map(Entry::to_json).collect())
}

/// Merges the oldest `Update` entries into `ancient-changes` entries (one
/// per API version) until at most [`MAX_UPDATE_MANAGERS`] are left.
pub fn cap(entries: &mut Vec<Entry>) {
    let updates = |es: &Vec<Entry>| es.iter().filter(|e| !e.apply).count();
    for _ in 0..entries.len() * 2 {
        if updates(entries) <= MAX_UPDATE_MANAGERS {
            return;
        }
        let Some(oldest) = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.apply && e.manager != ANCIENT)
            .min_by(|a, b| a.1.time.cmp(&b.1.time))
            .map(|(i, _)| i)
        else {
            return;
        };
        let old = entries.remove(oldest);
        match entries
            .iter_mut()
            .find(|e| !e.apply && e.manager == ANCIENT && e.api_version == old.api_version)
        {
            Some(bucket) => {
                bucket.set.union(&old.set);
                bucket.time = old.time;
            }
            None => entries.push(Entry {
                manager: ANCIENT.into(),
                subresource: String::new(),
                ..old
            }),
        }
    }
}

/// The 409 of an apply that would change fields other managers own: one
/// `FieldManagerConflict` cause per field, the message as the real server
/// words it.
pub fn conflict_error(conflicts: &[(String, Vec<String>)]) -> ApiError {
    let mut sorted: Vec<&(String, Vec<String>)> = conflicts.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    let causes: Vec<Value> = sorted
        .iter()
        .map(|(who, path)| {
            json!({"reason": "FieldManagerConflict", "message": format!("conflict with {who}"), "field": path_string(path)})
        })
        .collect();
    let message = if let [(who, path)] = sorted.as_slice() {
        format!(
            "Apply failed with 1 conflict: conflict with {who}: {}",
            path_string(path)
        )
    } else {
        let mut lines = Vec::new();
        let mut last: Option<&str> = None;
        for (who, path) in &sorted {
            if last != Some(who.as_str()) {
                lines.push(format!("conflicts with {who}:"));
                last = Some(who);
            }
            lines.push(format!("- {}", path_string(path)));
        }
        format!(
            "Apply failed with {} conflicts: {}",
            sorted.len(),
            lines.join("\n")
        )
    };
    let mut e = ApiError::new(Reason::Conflict, message);
    e.details = Some(json!({"causes": causes}));
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(manager: &str, apply: bool, time: &str) -> Entry {
        Entry {
            manager: manager.into(),
            apply,
            api_version: "v1".into(),
            time: Some(time.into()),
            subresource: String::new(),
            set: FieldSet::from_fields_v1(&json!({"f:data": {"f:a": {}}})).expect("valid"),
        }
    }

    #[test]
    fn entries_round_trip_and_sort_appliers_first() {
        let list = encode(vec![
            entry("kubectl-edit", false, "2024-01-02T00:00:00Z"),
            entry("helm", true, "2024-01-03T00:00:00Z"),
            entry("kubectl-create", false, "2024-01-01T00:00:00Z"),
        ]);
        let names: Vec<&str> = list
            .as_array()
            .expect("list")
            .iter()
            .map(|e| e["manager"].as_str().expect("manager"))
            .collect();
        assert_eq!(names, ["helm", "kubectl-create", "kubectl-edit"]);
        assert_eq!(list[0]["fieldsType"], "FieldsV1");
        assert_eq!(list[0]["fieldsV1"], json!({"f:data": {"f:a": {}}}));
        let back = decode(Some(&list)).expect("decodes");
        assert_eq!(back.len(), 3);
        assert!(back[0].apply && !back[1].apply);
    }

    #[test]
    fn bad_entries_and_resets_are_told_apart() {
        assert!(decode(Some(&json!([{"operation": "Merge"}]))).is_err());
        assert!(
            decode(Some(
                &json!([{"operation": "Apply", "fieldsType": "FieldsV2", "fieldsV1": {}}])
            ))
            .is_err()
        );
        assert!(decode(Some(&json!("x"))).is_err());
        assert!(is_reset(Some(&json!([{}]))));
        assert!(!is_reset(Some(&json!([]))));
        assert!(!is_reset(None));
    }

    #[test]
    fn update_managers_are_capped_into_ancient_changes() {
        let mut entries: Vec<Entry> = (0..13)
            .map(|i| {
                entry(
                    &format!("m{i:02}"),
                    false,
                    &format!("2024-01-01T00:00:{i:02}Z"),
                )
            })
            .collect();
        entries.push(entry("applier", true, "2024-01-01T00:00:00Z"));
        cap(&mut entries);
        assert_eq!(entries.iter().filter(|e| !e.apply).count(), 10);
        assert!(entries.iter().any(|e| e.manager == ANCIENT));
        assert!(entries.iter().any(|e| e.manager == "applier"));
        assert!(!entries.iter().any(|e| e.manager == "m00"));
        assert!(entries.iter().any(|e| e.manager == "m12"));
    }

    #[test]
    fn conflict_messages_name_managers_and_fields() {
        let one = conflict_error(&[(
            "\"helm\"".into(),
            vec!["f:spec".into(), "f:replicas".into()],
        )]);
        assert_eq!(one.http_code(), 409);
        assert_eq!(
            one.message,
            "Apply failed with 1 conflict: conflict with \"helm\": .spec.replicas"
        );
        let two = conflict_error(&[
            ("\"b\" using v1".into(), vec!["f:data".into(), "f:y".into()]),
            ("\"a\"".into(), vec!["f:data".into(), "f:x".into()]),
        ]);
        assert_eq!(
            two.message,
            "Apply failed with 2 conflicts: conflicts with \"a\":\n- .data.x\nconflicts with \"b\" using v1:\n- .data.y"
        );
        let causes = &two.details.as_ref().expect("details")["causes"];
        assert_eq!(causes[0]["reason"], "FieldManagerConflict");
        assert_eq!(causes[0]["field"], ".data.x");
        assert_eq!(causes[1]["message"], "conflict with \"b\" using v1");
    }
}
