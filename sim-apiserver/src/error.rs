//! API errors and the `Status` bodies the real API server answers with.

use serde_json::{Value, json};

/// The `reason` of a failed request, as the real API server spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// 400.
    BadRequest,
    /// 401.
    Unauthorized,
    /// 403.
    Forbidden,
    /// 404.
    NotFound,
    /// 405.
    MethodNotAllowed,
    /// 406.
    NotAcceptable,
    /// 409, the object exists.
    AlreadyExists,
    /// 409, a stale resourceVersion or a failed precondition.
    Conflict,
    /// 410, the requested resourceVersion is older than the retained window.
    Gone,
    /// 415.
    UnsupportedMediaType,
    /// 422.
    Invalid,
    /// 429.
    TooManyRequests,
    /// 500.
    InternalError,
    /// 501.
    NotImplemented,
    /// 504.
    Timeout,
}

impl Reason {
    /// The HTTP status code of this reason.
    pub fn code(self) -> u16 {
        match self {
            Reason::BadRequest => 400,
            Reason::Unauthorized => 401,
            Reason::Forbidden => 403,
            Reason::NotFound => 404,
            Reason::MethodNotAllowed => 405,
            Reason::NotAcceptable => 406,
            Reason::AlreadyExists | Reason::Conflict => 409,
            Reason::Gone => 410,
            Reason::UnsupportedMediaType => 415,
            Reason::Invalid => 422,
            Reason::TooManyRequests => 429,
            Reason::InternalError => 500,
            Reason::NotImplemented => 501,
            Reason::Timeout => 504,
        }
    }

    /// The `reason` string of a `Status` body.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BadRequest => "BadRequest",
            Reason::Unauthorized => "Unauthorized",
            Reason::Forbidden => "Forbidden",
            Reason::NotFound => "NotFound",
            Reason::MethodNotAllowed => "MethodNotAllowed",
            Reason::NotAcceptable => "NotAcceptable",
            Reason::AlreadyExists => "AlreadyExists",
            Reason::Conflict => "Conflict",
            Reason::Gone => "Expired",
            Reason::UnsupportedMediaType => "UnsupportedMediaType",
            Reason::Invalid => "Invalid",
            Reason::TooManyRequests => "TooManyRequests",
            Reason::InternalError => "InternalError",
            Reason::NotImplemented => "NotImplemented",
            Reason::Timeout => "Timeout",
        }
    }
}

/// A failed API request: turned into a `Status` body with the matching code.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{reason:?}: {message}")]
pub struct ApiError {
    /// Why it failed.
    pub reason: Reason,
    /// The human-readable message.
    pub message: String,
    /// `details` of the Status body, if any.
    pub details: Option<Value>,
    /// Overrides the HTTP code (webhook denials carry their own).
    pub code: Option<u16>,
}

impl ApiError {
    /// An error with a reason and a message and no details.
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        ApiError {
            reason,
            message: message.into(),
            details: None,
            code: None,
        }
    }

    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(Reason::BadRequest, message)
    }

    /// 500 InternalError.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Reason::InternalError, message)
    }

    /// 404 naming the resource (`pods "x" not found`).
    pub fn not_found(group: &str, plural: &str, name: &str) -> Self {
        ApiError {
            reason: Reason::NotFound,
            message: format!("{} \"{name}\" not found", qualified(group, plural)),
            details: Some(json!({"name": name, "group": group, "kind": plural})),
            code: None,
        }
    }

    /// 409 AlreadyExists.
    pub fn already_exists(group: &str, plural: &str, name: &str) -> Self {
        ApiError {
            reason: Reason::AlreadyExists,
            message: format!("{} \"{name}\" already exists", qualified(group, plural)),
            details: Some(json!({"name": name, "group": group, "kind": plural})),
            code: None,
        }
    }

    /// 409 Conflict on a stale resourceVersion or failed precondition.
    pub fn conflict(group: &str, plural: &str, name: &str, why: &str) -> Self {
        ApiError {
            reason: Reason::Conflict,
            message: format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                qualified(group, plural)
            ),
            details: Some(json!({"name": name, "group": group, "kind": plural})),
            code: None,
        }
    }

    /// 422 Invalid with the field causes, worded like the real server:
    /// `Kind.group "name" is invalid: [cause1, cause2]`.
    pub fn invalid(group: &str, kind: &str, name: &str, causes: Vec<FieldCause>) -> Self {
        let joined = if causes.len() == 1 {
            causes[0].to_string()
        } else {
            format!(
                "[{}]",
                causes
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let gk = if group.is_empty() {
            kind.to_string()
        } else {
            format!("{kind}.{group}")
        };
        ApiError {
            reason: Reason::Invalid,
            message: format!("{gk} \"{name}\" is invalid: {joined}"),
            details: Some(json!({
                "name": name,
                "group": group,
                "kind": kind,
                "causes": causes.iter().map(|c| json!({
                    "reason": c.kind.reason(),
                    "message": c.message_only(),
                    "field": c.field,
                })).collect::<Vec<_>>(),
            })),
            code: None,
        }
    }

    /// The `Status` body the real server sends for this error.
    pub fn status_body(&self) -> Value {
        let mut body = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason.as_str(),
            "code": self.http_code(),
        });
        if let Some(details) = &self.details {
            body["details"] = details.clone();
        }
        body
    }

    /// The HTTP code to answer with.
    pub fn http_code(&self) -> u16 {
        self.code.unwrap_or_else(|| self.reason.code())
    }
}

/// `pods` or `gpuleases.gpupool.io`, as the real server names resources in messages.
pub fn qualified(group: &str, plural: &str) -> String {
    if group.is_empty() {
        plural.to_string()
    } else {
        format!("{plural}.{group}")
    }
}

/// The kind of a field error, as in the real server's field.ErrorType.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// `Invalid value`.
    Invalid,
    /// `Required value`.
    Required,
    /// `Unsupported value`.
    NotSupported,
    /// `Forbidden`.
    Forbidden,
    /// `Too many`.
    TooMany,
    /// `Too long`.
    TooLong,
}

impl FieldErrorKind {
    fn reason(self) -> &'static str {
        match self {
            FieldErrorKind::Invalid => "FieldValueInvalid",
            FieldErrorKind::Required => "FieldValueRequired",
            FieldErrorKind::NotSupported => "FieldValueNotSupported",
            FieldErrorKind::Forbidden => "FieldValueForbidden",
            FieldErrorKind::TooMany => "FieldValueTooMany",
            FieldErrorKind::TooLong => "FieldValueTooLong",
        }
    }
}

/// One field error of a 422 answer.
#[derive(Debug, Clone)]
pub struct FieldCause {
    /// What is wrong.
    pub kind: FieldErrorKind,
    /// The field path, e.g. `spec.slots`.
    pub field: String,
    /// The offending value, rendered, where the real server shows it.
    pub value: Option<String>,
    /// The detail.
    pub detail: String,
}

impl FieldCause {
    /// `field: Invalid value: VALUE: detail`.
    pub fn invalid(field: impl Into<String>, value: &Value, detail: impl Into<String>) -> Self {
        FieldCause {
            kind: FieldErrorKind::Invalid,
            field: field.into(),
            value: Some(render_value(value)),
            detail: detail.into(),
        }
    }

    /// `field: Forbidden: detail`.
    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        FieldCause {
            kind: FieldErrorKind::Forbidden,
            field: field.into(),
            value: None,
            detail: detail.into(),
        }
    }

    /// `field: Required value` (with an optional detail).
    pub fn required(field: impl Into<String>, detail: impl Into<String>) -> Self {
        FieldCause {
            kind: FieldErrorKind::Required,
            field: field.into(),
            value: None,
            detail: detail.into(),
        }
    }

    fn message_only(&self) -> String {
        let label = match self.kind {
            FieldErrorKind::Invalid => "Invalid value",
            FieldErrorKind::Required => "Required value",
            FieldErrorKind::NotSupported => "Unsupported value",
            FieldErrorKind::Forbidden => "Forbidden",
            FieldErrorKind::TooMany => "Too many",
            FieldErrorKind::TooLong => "Too long",
        };
        let mut out = label.to_string();
        if let Some(v) = &self.value {
            out.push_str(": ");
            out.push_str(v);
        }
        if !self.detail.is_empty() {
            out.push_str(": ");
            out.push_str(&self.detail);
        }
        out
    }
}

impl std::fmt::Display for FieldCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message_only())
    }
}

fn render_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("\"{s}\""),
        Value::Null => "null".into(),
        other => other.to_string(),
    }
}

/// A `Status` body for a successful delete or eviction.
pub fn success_status(code: u16, details: Option<Value>) -> Value {
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": code,
    });
    if let Some(d) = details {
        body["details"] = d;
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_message_matches_real_server_wording() {
        let e = ApiError::invalid(
            "gpupool.io",
            "GpuLease",
            "x",
            vec![FieldCause::invalid(
                "spec.slots",
                &json!(0),
                "spec.slots in body should be greater than or equal to 1",
            )],
        );
        assert_eq!(
            e.message,
            "GpuLease.gpupool.io \"x\" is invalid: spec.slots: Invalid value: 0: spec.slots in body should be greater than or equal to 1"
        );
        assert_eq!(e.status_body()["code"], 422);
        assert_eq!(e.status_body()["reason"], "Invalid");
    }

    #[test]
    fn not_found_names_group_and_resource() {
        let e = ApiError::not_found("", "pods", "p");
        assert_eq!(e.message, "pods \"p\" not found");
        assert_eq!(e.http_code(), 404);
    }
}
