//! Label and field selectors, parsed from query strings or `LabelSelector`
//! objects.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::registry::ResourceDef;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelRequirement {
    /// `key=value` / `key==value`.
    Equals(String, String),
    /// `key!=value` (also matches objects without the key).
    NotEquals(String, String),
    /// `key in (a,b)`.
    In(String, BTreeSet<String>),
    /// `key notin (a,b)` (also matches objects without the key).
    NotIn(String, BTreeSet<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    NotExists(String),
}

/// A conjunction of label requirements; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<LabelRequirement>);

impl LabelSelector {
    /// Parses the query-string form (`a=b,c in (x,y),!d`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for term in split_top_level(s) {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            reqs.push(parse_term(term)?);
        }
        Ok(LabelSelector(reqs))
    }

    /// Builds a selector from a `metav1.LabelSelector` object
    /// (`matchLabels` / `matchExpressions`). `None` or `{}` matches everything.
    pub fn from_object(sel: Option<&Value>) -> Result<Self, String> {
        let mut reqs = Vec::new();
        let Some(sel) = sel else {
            return Ok(LabelSelector(reqs));
        };
        if let Some(ml) = sel.get("matchLabels").and_then(Value::as_object) {
            for (k, v) in ml {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("matchLabels.{k}: must be a string"))?;
                reqs.push(LabelRequirement::Equals(k.clone(), v.to_string()));
            }
        }
        if let Some(exprs) = sel.get("matchExpressions").and_then(Value::as_array) {
            for e in exprs {
                let key = e
                    .get("key")
                    .and_then(Value::as_str)
                    .ok_or("matchExpressions[].key: Required value")?
                    .to_string();
                let values: BTreeSet<String> = e
                    .get("values")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                let op = e
                    .get("operator")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                reqs.push(match op {
                    "In" => LabelRequirement::In(key, values),
                    "NotIn" => LabelRequirement::NotIn(key, values),
                    "Exists" => LabelRequirement::Exists(key),
                    "DoesNotExist" => LabelRequirement::NotExists(key),
                    other => {
                        return Err(format!(
                            "\"{other}\" is not a valid label selector operator"
                        ));
                    }
                });
            }
        }
        Ok(LabelSelector(reqs))
    }

    /// Whether the object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.get("metadata").and_then(|m| m.get("labels"));
        self.matches_labels(labels)
    }

    /// Whether a labels map satisfies every requirement.
    pub fn matches_labels(&self, labels: Option<&Value>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelRequirement::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => get(k).is_some_and(|x| vs.contains(x)),
            LabelRequirement::NotIn(k, vs) => !get(k).is_some_and(|x| vs.contains(x)),
            LabelRequirement::Exists(k) => get(k).is_some(),
            LabelRequirement::NotExists(k) => get(k).is_none(),
        })
    }

    /// Whether it has no requirement.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Splits on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn valid_key(k: &str) -> Result<String, String> {
    let k = k.trim();
    let ok = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if ok {
        Ok(k.to_string())
    } else {
        Err(format!(
            "unable to parse requirement: invalid label key \"{k}\""
        ))
    }
}

fn parse_set(rest: &str) -> Result<BTreeSet<String>, String> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("found '{rest}', expected: '(' … ')'"))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

fn parse_term(term: &str) -> Result<LabelRequirement, String> {
    if let Some(k) = term.strip_prefix('!') {
        return Ok(LabelRequirement::NotExists(valid_key(k)?));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(LabelRequirement::NotEquals(
            valid_key(k)?,
            v.trim().to_string(),
        ));
    }
    if let Some((k, v)) = term.split_once("==") {
        return Ok(LabelRequirement::Equals(
            valid_key(k)?,
            v.trim().to_string(),
        ));
    }
    if let Some((k, v)) = term.split_once('=') {
        return Ok(LabelRequirement::Equals(
            valid_key(k)?,
            v.trim().to_string(),
        ));
    }
    let words: Vec<&str> = term.splitn(2, char::is_whitespace).collect();
    if words.len() == 2 {
        let key = valid_key(words[0])?;
        let rest = words[1].trim_start();
        if let Some(r) = rest.strip_prefix("notin") {
            return Ok(LabelRequirement::NotIn(key, parse_set(r)?));
        }
        if let Some(r) = rest.strip_prefix("in") {
            return Ok(LabelRequirement::In(key, parse_set(r)?));
        }
        return Err(format!(
            "unable to parse requirement: found '{rest}', expected: in, notin, =, ==, !="
        ));
    }
    Ok(LabelRequirement::Exists(valid_key(term)?))
}

/// One requirement of a field selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldRequirement {
    /// Dotted field path, e.g. `spec.nodeName`.
    pub field: String,
    /// The value compared against.
    pub value: String,
    /// `!=` instead of `=`.
    pub negate: bool,
}

/// A conjunction of field requirements.
#[derive(Debug, Clone, Default)]
pub struct FieldSelector(pub Vec<FieldRequirement>);

/// Which fields a resource may be selected by, beyond metadata.name/namespace.
fn supported_fields(group: &str, plural: &str) -> &'static [&'static str] {
    match (group, plural) {
        ("", "pods") => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
        ("", "events") | ("events.k8s.io", "events") => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        ("", "nodes") => &["spec.unschedulable"],
        ("", "namespaces") => &["status.phase"],
        ("", "secrets") => &["type"],
        _ => &[],
    }
}

impl FieldSelector {
    /// Parses `a=b,c!=d` and checks each field is selectable on the
    /// built-in resource `group`/`plural` (`metadata.name`,
    /// `metadata.namespace` and the resource's own fields).
    pub fn parse(s: &str, group: &str, plural: &str) -> Result<Self, String> {
        Self::parse_with(s, |field| {
            field == "metadata.name"
                || field == "metadata.namespace"
                || supported_fields(group, plural).contains(&field)
        })
    }

    /// Parses `a=b,c!=d` for a list or watch of `def`, refusing each field
    /// the real server refuses there: a custom resource is selectable by
    /// `metadata.name`, by `metadata.namespace` only when it is namespaced,
    /// and by the `selectableFields` its CRD declares for this version.
    pub fn for_resource(s: &str, def: &ResourceDef) -> Result<Self, String> {
        if !def.custom {
            return Self::parse(s, &def.group, &def.plural);
        }
        Self::parse_with(s, |field| {
            field == "metadata.name"
                || (def.namespaced && field == "metadata.namespace")
                || def.selectable_fields.iter().any(|f| f == field)
        })
    }

    fn parse_with(s: &str, allowed: impl Fn(&str) -> bool) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (field, value, negate) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, false)
            } else {
                return Err(format!(
                    "invalid selector: '{s}'; can't understand '{term}'"
                ));
            };
            let field = field.trim();
            if !allowed(field) {
                return Err(format!("field label not supported: {field}"));
            }
            reqs.push(FieldRequirement {
                field: field.to_string(),
                value: value.trim().to_string(),
                negate,
            });
        }
        Ok(FieldSelector(reqs))
    }

    /// The value `field` must equal, when a requirement says `field=value`.
    pub fn required(&self, field: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|r| r.field == field && !r.negate)
            .map(|r| r.value.as_str())
    }

    /// Whether the object satisfies every requirement. A missing field
    /// compares as the empty string, as the real server's field sets do.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|r| {
            let mut cur = Some(obj);
            for part in r.field.split('.') {
                cur = cur.and_then(|c| c.get(part));
            }
            let actual = match cur {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Bool(b)) => b.to_string(),
                Some(Value::Number(n)) => n.to_string(),
                Some(Value::Object(o)) if r.field == "source" => o
                    .get("component")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            };
            (actual == r.value) != r.negate
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"labels": labels}})
    }

    #[test]
    fn every_operator_parses_and_matches() {
        let o = obj(json!({"a": "1", "b": "x"}));
        for (sel, want) in [
            ("a=1", true),
            ("a==1", true),
            ("a!=1", false),
            ("c!=1", true),
            ("b in (x,y)", true),
            ("b notin (x,y)", false),
            ("c notin (x)", true),
            ("a", true),
            ("!a", false),
            ("!c", true),
            ("a=1,b in (y, x)", true),
            ("a=1,c", false),
        ] {
            let s = LabelSelector::parse(sel).expect(sel);
            assert_eq!(s.matches(&o), want, "{sel}");
        }
    }

    #[test]
    fn bad_selector_is_rejected_with_message() {
        let err = LabelSelector::parse("a in x").expect_err("no parens");
        assert!(err.contains("expected"), "{err}");
        let err = LabelSelector::parse("a b").expect_err("bad op");
        assert!(err.contains("in, notin"), "{err}");
    }

    #[test]
    fn field_selector_checks_supported_fields() {
        let err = FieldSelector::parse("spec.foo=x", "", "pods").expect_err("unsupported");
        assert_eq!(err, "field label not supported: spec.foo");
        let s =
            FieldSelector::parse("spec.nodeName=n1,status.phase!=Failed", "", "pods").expect("ok");
        assert!(s.matches(&json!({"spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})));
        assert!(!s.matches(&json!({"spec": {"nodeName": "n2"}})));
        let empty = FieldSelector::parse("spec.nodeName=", "", "pods").expect("ok");
        assert!(empty.matches(&json!({"spec": {}})));
    }

    fn custom_def(namespaced: bool, selectable: &[&str]) -> ResourceDef {
        let crd = json!({"spec": {
            "group": "example.io",
            "names": {"plural": "widgets", "kind": "Widget"},
            "scope": if namespaced { "Namespaced" } else { "Cluster" },
            "versions": [{"name": "v1", "served": true, "storage": true,
                "selectableFields": selectable.iter().map(|p| json!({"jsonPath": p})).collect::<Vec<_>>()}],
        }});
        crate::registry::defs_from_crd(&crd)
            .expect("a valid CRD")
            .remove(0)
    }

    #[test]
    fn a_custom_resource_is_selectable_by_its_crds_fields_only() {
        let def = custom_def(true, &[".status.node", ".spec.size"]);
        assert_eq!(def.selectable_fields, ["status.node", "spec.size"]);
        let s = FieldSelector::for_resource("status.node=n1", &def).expect("declared");
        assert!(s.matches(&json!({"status": {"node": "n1"}})));
        assert!(!s.matches(&json!({"status": {"node": "n2"}})));
        let unset = FieldSelector::for_resource("status.node=", &def).expect("declared");
        assert!(unset.matches(&json!({"status": {}})), "absent is empty");
        let s = FieldSelector::for_resource("spec.size!=3,metadata.namespace=a", &def)
            .expect("declared");
        assert!(s.matches(&json!({"metadata": {"namespace": "a"}, "spec": {"size": 4}})));
        assert!(!s.matches(&json!({"metadata": {"namespace": "a"}, "spec": {"size": 3}})));
        let err = FieldSelector::for_resource("status.phase=Bound", &def).expect_err("undeclared");
        assert_eq!(err, "field label not supported: status.phase");
        // Without selectableFields (an older CRD), only metadata.
        let old = custom_def(true, &[]);
        let err = FieldSelector::for_resource("status.node=n1", &old).expect_err("undeclared");
        assert_eq!(err, "field label not supported: status.node");
        assert!(FieldSelector::for_resource("metadata.name=x", &old).is_ok());
        // A cluster-scoped custom resource has no namespace to select by.
        let cluster = custom_def(false, &[]);
        let err = FieldSelector::for_resource("metadata.namespace=a", &cluster)
            .expect_err("cluster-scoped");
        assert_eq!(err, "field label not supported: metadata.namespace");
    }

    #[test]
    fn a_required_field_is_an_equality_only() {
        let s =
            FieldSelector::parse("status.phase!=Failed,spec.nodeName=n1", "", "pods").expect("ok");
        assert_eq!(s.required("spec.nodeName"), Some("n1"));
        assert_eq!(s.required("status.phase"), None, "a != is no requirement");
        let unscheduled = FieldSelector::parse("spec.nodeName=", "", "pods").expect("ok");
        assert_eq!(unscheduled.required("spec.nodeName"), Some(""));
        assert_eq!(FieldSelector::default().required("spec.nodeName"), None);
    }

    #[test]
    fn label_selector_object_form() {
        let s = LabelSelector::from_object(Some(&json!({
            "matchLabels": {"a": "1"},
            "matchExpressions": [{"key": "b", "operator": "In", "values": ["x"]}]
        })))
        .expect("valid");
        assert!(s.matches(&obj(json!({"a": "1", "b": "x"}))));
        assert!(!s.matches(&obj(json!({"a": "1"}))));
        assert!(
            LabelSelector::from_object(Some(
                &json!({"matchExpressions": [{"key": "b", "operator": "Bogus"}]})
            ))
            .is_err()
        );
    }
}
