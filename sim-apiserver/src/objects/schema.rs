//! Validation of custom resources against their CRD's `openAPIV3Schema`:
//! types, required, enum, bounds, lengths, patterns, item counts, nullable;
//! defaults are applied and unknown fields pruned.

use serde_json::{Map, Value, json};

use crate::error::{FieldCause, FieldErrorKind};

/// The outcome of checking one object.
#[derive(Debug, Default)]
pub struct Checked {
    /// Field errors (422).
    pub causes: Vec<FieldCause>,
    /// Paths of fields the schema does not declare (pruned unless strict).
    pub unknown: Vec<String>,
}

/// Validates `obj` against `schema`, applying defaults and pruning unknown
/// fields (which are listed in [`Checked::unknown`]).
pub fn check_object(schema: &Value, obj: &mut Value) -> Checked {
    let mut out = Checked::default();
    if let (Some(props), Some(map)) = (
        schema.get("properties").and_then(Value::as_object),
        obj.as_object_mut(),
    ) {
        let keys: Vec<String> = map.keys().cloned().collect();
        for k in keys {
            if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                continue;
            }
            match props.get(&k) {
                Some(sub) => {
                    if let Some(v) = map.get_mut(&k) {
                        check(sub, v, &k, &mut out);
                    }
                }
                None if preserves(schema) => {}
                None => {
                    out.unknown.push(k.clone());
                    map.remove(&k);
                }
            }
        }
        apply_defaults(props, map);
        check_required(schema, map, "", &mut out);
    }
    out
}

/// Validates and returns the 422 causes; unknown fields are pruned (the
/// request's own unknown fields were reported before admission).
pub fn validate_object(schema: &Value, obj: &mut Value) -> Vec<FieldCause> {
    check_object(schema, obj).causes
}

fn preserves(schema: &Value) -> bool {
    schema
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        == Some(true)
        || schema.get("additionalProperties").and_then(Value::as_bool) == Some(true)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        Some(f) => f.to_string(),
        None => v.to_string(),
    }
}

fn apply_defaults(props: &Map<String, Value>, map: &mut Map<String, Value>) {
    for (k, sub) in props {
        if !map.contains_key(k)
            && let Some(d) = sub.get("default")
        {
            map.insert(k.clone(), d.clone());
        }
    }
}

fn check_required(schema: &Value, map: &Map<String, Value>, path: &str, out: &mut Checked) {
    if let Some(req) = schema.get("required").and_then(Value::as_array) {
        for r in req.iter().filter_map(Value::as_str) {
            if !map.contains_key(r) {
                out.causes.push(FieldCause::required(join(path, r), ""));
            }
        }
    }
}

fn check(schema: &Value, v: &mut Value, path: &str, out: &mut Checked) {
    if v.is_null() {
        if schema.get("nullable").and_then(Value::as_bool) == Some(true) {
            return;
        }
        if let Some(t) = schema.get("type").and_then(Value::as_str) {
            out.causes.push(FieldCause::invalid(
                path,
                &json!("null"),
                format!("{path} in body must be of type {t}: \"null\""),
            ));
        }
        return;
    }
    let int_or_string = schema
        .get("x-kubernetes-int-or-string")
        .and_then(Value::as_bool)
        == Some(true);
    if let Some(t) = schema.get("type").and_then(Value::as_str) {
        let actual = type_name(v);
        let ok = actual == t
            || (t == "number" && actual == "integer")
            || (t == "integer" && v.as_f64().is_some_and(|f| f.fract() == 0.0))
            || (int_or_string && (actual == "integer" || actual == "string"));
        if !ok {
            out.causes.push(FieldCause::invalid(
                path,
                &json!(actual),
                format!("{path} in body must be of type {t}: \"{actual}\""),
            ));
            return;
        }
    } else if int_or_string && !matches!(type_name(v), "integer" | "string") {
        out.causes.push(FieldCause::invalid(
            path,
            v,
            format!("{path} in body must be of type integer or string"),
        ));
        return;
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(v)
    {
        out.causes.push(FieldCause {
            kind: FieldErrorKind::NotSupported,
            field: path.to_string(),
            value: Some(match &*v {
                Value::String(s) => format!("\"{s}\""),
                other => other.to_string(),
            }),
            detail: format!(
                "supported values: {}",
                allowed
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    match v {
        Value::Number(_) | Value::String(_) => check_scalar(schema, v, path, out),
        Value::Array(items) => {
            let n = items.len() as u64;
            if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
                && n > max
            {
                out.causes.push(FieldCause {
                    kind: FieldErrorKind::TooMany,
                    field: path.to_string(),
                    value: Some(n.to_string()),
                    detail: format!("must have at most {max} items"),
                });
            }
            if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
                && n < min
            {
                out.causes.push(FieldCause::invalid(
                    path,
                    &json!(n),
                    format!("{path} in body should have at least {min} items"),
                ));
            }
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    check(item_schema, item, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            let keys: Vec<String> = map.keys().cloned().collect();
            for k in keys {
                let child = join(path, &k);
                let sub = props.and_then(|p| p.get(&k)).or(additional);
                match sub {
                    Some(sub) => {
                        if let Some(val) = map.get_mut(&k) {
                            check(sub, val, &child, out);
                        }
                    }
                    None if preserves(schema)
                        || (props.is_none() && schema.get("type").is_none()) => {}
                    None => {
                        out.unknown.push(child);
                        map.remove(&k);
                    }
                }
            }
            if let Some(p) = props {
                apply_defaults(p, map);
            }
            check_required(schema, map, path, out);
        }
        _ => {}
    }
}

fn check_scalar(schema: &Value, v: &Value, path: &str, out: &mut Checked) {
    match v {
        Value::Number(_) => {
            let x = v.as_f64().unwrap_or_default();
            if let Some(min) = schema.get("minimum") {
                let exclusive =
                    schema.get("exclusiveMinimum").and_then(Value::as_bool) == Some(true);
                let m = min.as_f64().unwrap_or(f64::MIN);
                if x < m || (exclusive && x == m) {
                    let rel = if exclusive {
                        "greater than"
                    } else {
                        "greater than or equal to"
                    };
                    out.causes.push(FieldCause::invalid(
                        path,
                        v,
                        format!("{path} in body should be {rel} {}", num(min)),
                    ));
                }
            }
            if let Some(max) = schema.get("maximum") {
                let exclusive =
                    schema.get("exclusiveMaximum").and_then(Value::as_bool) == Some(true);
                let m = max.as_f64().unwrap_or(f64::MAX);
                if x > m || (exclusive && x == m) {
                    let rel = if exclusive {
                        "less than"
                    } else {
                        "less than or equal to"
                    };
                    out.causes.push(FieldCause::invalid(
                        path,
                        v,
                        format!("{path} in body should be {rel} {}", num(max)),
                    ));
                }
            }
        }
        Value::String(s) => {
            let len = s.chars().count() as u64;
            if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
                && len < min
            {
                out.causes.push(FieldCause::invalid(
                    path,
                    v,
                    format!("{path} in body should be at least {min} chars long"),
                ));
            }
            if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
                && len > max
            {
                out.causes.push(FieldCause {
                    kind: FieldErrorKind::TooLong,
                    field: path.to_string(),
                    value: None,
                    detail: format!("may not be more than {max} bytes"),
                });
            }
            if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
                match regex::Regex::new(p) {
                    Ok(re) if !re.is_match(s) => {
                        out.causes.push(FieldCause::invalid(
                            path,
                            v,
                            format!("{path} in body should match '{p}'"),
                        ));
                    }
                    Ok(_) => {}
                    Err(e) => out.causes.push(FieldCause::invalid(
                        path,
                        v,
                        format!("the schema's pattern '{p}' is invalid: {e}"),
                    )),
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> Value {
        json!({"type": "object", "properties": {"spec": {"type": "object", "required": ["slots"], "properties": {
            "slots": {"type": "integer", "minimum": 1.0},
            "role": {"type": "string", "enum": ["primary", "helper"], "default": "primary"},
            "name": {"type": "string", "minLength": 1, "pattern": "^[a-z]+$"},
            "list": {"type": "array", "maxItems": 1, "items": {"type": "integer"}},
            "opt": {"type": "object", "nullable": true},
            "short": {"type": "string", "maxLength": 3}
        }}}})
    }

    #[test]
    fn minimum_error_names_field_like_the_real_server() {
        let mut obj = json!({"spec": {"slots": 0}});
        let causes = validate_object(&schema(), &mut obj);
        assert_eq!(
            causes[0].to_string(),
            "spec.slots: Invalid value: 0: spec.slots in body should be greater than or equal to 1"
        );
        assert_eq!(obj["spec"]["role"], "primary", "default applied");
    }

    #[test]
    fn each_rule_reports_its_field() {
        let mut obj = json!({"spec": {"slots": "x", "role": "boss", "name": "A", "list": [1, 2], "opt": null, "extra": 1, "short": "abcd"}});
        let causes = validate_object(&schema(), &mut obj);
        let text: Vec<String> = causes.iter().map(ToString::to_string).collect();
        assert!(
            text.iter()
                .any(|t| t.contains("spec.slots in body must be of type integer")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.starts_with("spec.role: Unsupported value: \"boss\"")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("spec.name in body should match")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.starts_with("spec.list: Too many: 2: must have at most 1 items")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t == "spec.short: Too long: may not be more than 3 bytes"),
            "{text:?}"
        );
        assert!(obj["spec"].get("extra").is_none(), "pruned");
        let mut missing = json!({"spec": {}});
        let causes = validate_object(&schema(), &mut missing);
        assert_eq!(causes[0].to_string(), "spec.slots: Required value");
    }

    #[test]
    fn unknown_fields_are_listed_and_pruned() {
        let mut obj = json!({"spec": {"slots": 1, "extra": 1}});
        let checked = check_object(&schema(), &mut obj);
        assert!(checked.causes.is_empty());
        assert_eq!(checked.unknown, ["spec.extra"]);
        assert!(obj["spec"].get("extra").is_none());
    }
}
