//! Sets of field paths as structured-merge-diff keeps them, and their
//! `FieldsV1` encoding: a tree whose keys are path elements (`f:<field>`,
//! `k:<keys as JSON>` for an item of a keyed list, `v:<value as JSON>` for
//! an item of a set list, `i:<index>`), with `.` marking a node that is
//! itself in the set as well as some of its children.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

/// The key marking a node with children as a member itself.
const SELF: &str = ".";

/// A set of field paths. Children are keyed by their encoded path element,
/// so two sets compare and combine without decoding any element.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSet {
    member: bool,
    children: BTreeMap<String, FieldSet>,
}

/// The path element of a field of an object.
pub fn field(name: &str) -> String {
    format!("f:{name}")
}

/// The path element of an item of a set list.
pub fn value(v: &Value) -> String {
    format!("v:{}", serde_json::to_string(v).unwrap_or_default())
}

/// The path element of an item of a keyed list: its key fields, sorted by
/// name, as one compact JSON object.
pub fn key(fields: &[(&str, &Value)]) -> String {
    let mut sorted: Vec<&(&str, &Value)> = fields.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let body: Vec<String> = sorted
        .iter()
        .map(|(k, v)| {
            format!(
                "{}:{}",
                serde_json::to_string(k).unwrap_or_default(),
                serde_json::to_string(v).unwrap_or_default()
            )
        })
        .collect();
    format!("k:{{{}}}", body.join(","))
}

impl FieldSet {
    /// Whether the set holds no path at all.
    pub fn is_empty(&self) -> bool {
        !self.member && self.children.values().all(FieldSet::is_empty)
    }

    /// Whether the path to this node is itself in the set.
    pub fn is_member(&self) -> bool {
        self.member
    }

    /// Marks the path to this node as in the set.
    pub fn set_member(&mut self) {
        self.member = true;
    }

    /// The node below `pe`, created empty when missing.
    pub fn child_mut(&mut self, pe: &str) -> &mut FieldSet {
        self.children.entry(pe.to_string()).or_default()
    }

    /// The node below `pe`, if any.
    pub fn child(&self, pe: &str) -> Option<&FieldSet> {
        self.children.get(pe)
    }

    /// Drops the subtree below `pe`.
    pub fn remove_child(&mut self, pe: &str) {
        self.children.remove(pe);
    }

    /// Adds every path of `other`.
    pub fn union(&mut self, other: &FieldSet) {
        self.member |= other.member;
        for (pe, child) in &other.children {
            self.child_mut(pe).union(child);
        }
    }

    /// The paths of this set that `other` does not hold.
    pub fn difference(&self, other: &FieldSet) -> FieldSet {
        let mut out = FieldSet {
            member: self.member && !other.member,
            children: BTreeMap::new(),
        };
        for (pe, child) in &self.children {
            let d = match other.children.get(pe) {
                Some(o) => child.difference(o),
                None => child.clone(),
            };
            if !d.is_empty() {
                out.children.insert(pe.clone(), d);
            }
        }
        out
    }

    /// The paths both sets hold.
    pub fn intersection(&self, other: &FieldSet) -> FieldSet {
        let mut out = FieldSet {
            member: self.member && other.member,
            children: BTreeMap::new(),
        };
        for (pe, child) in &self.children {
            if let Some(o) = other.children.get(pe) {
                let i = child.intersection(o);
                if !i.is_empty() {
                    out.children.insert(pe.clone(), i);
                }
            }
        }
        out
    }

    /// The paths of this set that are neither in `removed` nor below one
    /// of its paths: what is left owned once those fields are gone.
    pub fn without_subtrees(&self, removed: &FieldSet) -> FieldSet {
        if removed.member {
            return FieldSet::default();
        }
        let mut out = FieldSet {
            member: self.member,
            children: BTreeMap::new(),
        };
        for (pe, child) in &self.children {
            let kept = match removed.children.get(pe) {
                Some(r) => child.without_subtrees(r),
                None => child.clone(),
            };
            if !kept.is_empty() {
                out.children.insert(pe.clone(), kept);
            }
        }
        out
    }

    /// Every path in the set, each as its path elements, in the order of
    /// the encoding.
    pub fn paths(&self) -> Vec<Vec<String>> {
        let mut out = Vec::new();
        let mut prefix = Vec::new();
        self.collect(&mut prefix, &mut out);
        out
    }

    fn collect(&self, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        if self.member && !prefix.is_empty() {
            out.push(prefix.clone());
        }
        for (pe, child) in &self.children {
            prefix.push(pe.clone());
            child.collect(prefix, out);
            prefix.pop();
        }
    }

    /// The `fieldsV1` object of this set.
    pub fn to_fields_v1(&self) -> Value {
        let mut m = Map::new();
        if self.member && self.children.values().any(|c| !c.is_empty()) {
            m.insert(SELF.into(), Value::Object(Map::new()));
        }
        for (pe, child) in &self.children {
            if !child.is_empty() {
                m.insert(pe.clone(), child.to_fields_v1());
            }
        }
        Value::Object(m)
    }

    /// Reads a `fieldsV1` object; anything but objects keyed by `.` or a
    /// known path element prefix is an error naming the offending key.
    pub fn from_fields_v1(v: &Value) -> Result<FieldSet, String> {
        let mut root = FieldSet::read(v)?;
        // The root is never a member: there is no path to it.
        root.member = false;
        Ok(root)
    }

    fn read(v: &Value) -> Result<FieldSet, String> {
        let Some(m) = v.as_object() else {
            return Err(format!("expected an object in fieldsV1, got {v}"));
        };
        let mut out = FieldSet {
            member: m.is_empty(),
            children: BTreeMap::new(),
        };
        for (k, child) in m {
            if k == SELF {
                out.member = true;
                continue;
            }
            if !["f:", "k:", "v:", "i:"].iter().any(|p| k.starts_with(p)) {
                return Err(format!("unknown path element {k:?} in fieldsV1"));
            }
            out.children.insert(k.clone(), FieldSet::read(child)?);
        }
        Ok(out)
    }
}

/// A path as structured-merge-diff prints it: `.spec.containers[name="c"].image`.
pub fn path_string(path: &[String]) -> String {
    let mut out = String::new();
    for pe in path {
        if let Some(f) = pe.strip_prefix("f:") {
            out.push('.');
            out.push_str(f);
        } else if let Some(k) = pe.strip_prefix("k:") {
            let fields = serde_json::from_str::<Map<String, Value>>(k).unwrap_or_default();
            let inner: Vec<String> = fields.iter().map(|(n, v)| format!("{n}={v}")).collect();
            out.push_str(&format!("[{}]", inner.join(",")));
        } else if let Some(v) = pe.strip_prefix("v:") {
            out.push_str(&format!("[={v}]"));
        } else if let Some(i) = pe.strip_prefix("i:") {
            out.push_str(&format!("[{i}]"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn set(v: Value) -> FieldSet {
        FieldSet::from_fields_v1(&v).expect("valid fieldsV1")
    }

    #[test]
    fn fields_v1_round_trips_with_self_markers() {
        let v = json!({"f:metadata": {"f:labels": {".": {}, "f:app": {}}},
            "f:spec": {"f:containers": {"k:{\"name\":\"c\"}": {".": {}, "f:image": {}}},
                        "f:finalizers": {"v:\"x\"": {}}}});
        let s = set(v.clone());
        assert_eq!(s.to_fields_v1(), v);
        assert_eq!(s.paths().len(), 5);
    }

    #[test]
    fn unknown_path_elements_are_refused() {
        let err = FieldSet::from_fields_v1(&json!({"x:y": {}})).expect_err("bad element");
        assert!(err.contains("x:y"), "{err}");
        assert!(FieldSet::from_fields_v1(&json!({"f:a": 1})).is_err());
    }

    #[test]
    fn keys_sort_their_fields_and_print_like_the_real_server() {
        let pe = key(&[("protocol", &json!("TCP")), ("containerPort", &json!(80))]);
        assert_eq!(pe, "k:{\"containerPort\":80,\"protocol\":\"TCP\"}");
        let path = vec![
            field("spec"),
            field("containers"),
            key(&[("name", &json!("c"))]),
            field("ports"),
            pe,
            field("hostPort"),
        ];
        assert_eq!(
            path_string(&path),
            ".spec.containers[name=\"c\"].ports[containerPort=80,protocol=\"TCP\"].hostPort"
        );
        assert_eq!(
            path_string(&[field("metadata"), field("finalizers"), value(&json!("a"))]),
            ".metadata.finalizers[=\"a\"]"
        );
    }

    #[test]
    fn set_algebra() {
        let a = set(json!({"f:a": {}, "f:b": {"f:c": {}, "f:d": {}}}));
        let b = set(json!({"f:b": {"f:c": {}}, "f:e": {}}));
        assert_eq!(a.intersection(&b), set(json!({"f:b": {"f:c": {}}})));
        assert_eq!(
            a.difference(&b),
            set(json!({"f:a": {}, "f:b": {"f:d": {}}}))
        );
        let mut u = a.clone();
        u.union(&b);
        assert_eq!(u.paths().len(), 4);
        let removed = set(json!({"f:b": {}}));
        assert_eq!(a.without_subtrees(&removed), set(json!({"f:a": {}})));
        assert!(a.difference(&a).is_empty());
    }
}
