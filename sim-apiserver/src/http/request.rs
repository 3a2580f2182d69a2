//! What the handlers see of a request, and how responses are built: shared
//! by the REST verbs and watch streams, so neither depends on the other.

use std::collections::HashMap;
use std::convert::Infallible;

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use serde_json::Value;

use crate::UserInfo;
use crate::error::{ApiError, FieldCause, Reason};
use crate::http::protobuf;
use crate::objects::{FieldValidation, WriteCtx};
use crate::registry::ResourceDef;
use crate::selectors::{FieldSelector, LabelSelector};

/// The response body type: whole JSON documents or watch streams.
pub type Body = BoxBody<Bytes, Infallible>;

/// A JSON response.
pub fn json_response(code: u16, body: &Value) -> Response<Body> {
    bytes_response(
        code,
        Bytes::from(serde_json::to_vec(body).unwrap_or_default()),
    )
}

pub(crate) fn bytes_response(code: u16, body: Bytes) -> Response<Body> {
    let mut r = Response::new(Full::new(body).boxed());
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The `Status` response of an error.
pub fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = json_response(e.http_code(), &e.status_body());
    if let Some(secs) = e
        .details
        .as_ref()
        .and_then(|d| d.get("retryAfterSeconds"))
        .and_then(Value::as_u64)
        && let Ok(v) = HeaderValue::from_str(&secs.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

/// What the handlers need from a request.
pub struct Req {
    /// Method.
    pub method: Method,
    /// Path segments.
    pub segments: Vec<String>,
    /// Decoded query parameters.
    pub query: HashMap<String, String>,
    /// Accept header.
    pub accept: String,
    /// Content-Type header.
    pub content_type: String,
    /// The authenticated user.
    pub user: UserInfo,
    /// The User-Agent header.
    pub user_agent: String,
    /// The body.
    pub body: Bytes,
}

impl Req {
    pub(crate) fn q(&self, k: &str) -> Option<&str> {
        self.query
            .get(k)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }

    pub(crate) fn flag(&self, k: &str) -> bool {
        matches!(self.q(k), Some("1" | "true" | "True"))
    }

    pub(crate) fn wants_table(&self) -> bool {
        // kubectl lists the Table form first and plain JSON as a fallback.
        self.accept
            .split(',')
            .next()
            .is_some_and(|first| first.contains("as=Table"))
    }

    pub(crate) fn write_ctx(&self) -> Result<WriteCtx, ApiError> {
        let dry_run = match self.q("dryRun") {
            None => false,
            Some("All") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "Invalid dryRun: \"{other}\": supported values: \"All\""
                )));
            }
        };
        let validation = match self.q("fieldValidation") {
            Some("Ignore") => FieldValidation::Ignore,
            None | Some("Warn") => FieldValidation::Warn,
            Some("Strict") => FieldValidation::Strict,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "fieldValidation: Invalid value: \"{other}\": fieldValidation must be one of \"Ignore\", \"Warn\", or \"Strict\""
                )));
            }
        };
        let options = match self.method {
            Method::POST => "CreateOptions",
            Method::PUT => "UpdateOptions",
            Method::DELETE => "DeleteOptions",
            _ => "PatchOptions",
        };
        let invalid =
            |cause: FieldCause| ApiError::invalid("meta.k8s.io", options, "", vec![cause]);
        let field_manager = self.q("fieldManager").map(str::to_string);
        if let Some(m) = &field_manager {
            if m.chars().count() > MAX_FIELD_MANAGER {
                return Err(invalid(FieldCause::invalid(
                    "fieldManager",
                    &Value::String(m.clone()),
                    format!("must have at most {MAX_FIELD_MANAGER} characters"),
                )));
            }
            if let Some((i, c)) = m.chars().enumerate().find(|(_, c)| c.is_control()) {
                return Err(invalid(FieldCause::invalid(
                    "fieldManager",
                    &Value::String(m.clone()),
                    format!("invalid character {c:?} (at position {i})"),
                )));
            }
        }
        let force = match self.q("force") {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "force: invalid value {other:?}: must be true or false"
                )));
            }
        };
        if self.method == Method::PATCH {
            let apply = self
                .content_type
                .split(';')
                .next()
                .is_some_and(|ct| ct.trim() == "application/apply-patch+yaml");
            if apply && field_manager.is_none() {
                return Err(invalid(FieldCause::required(
                    "fieldManager",
                    "is required for apply patch",
                )));
            }
            if !apply && self.q("force").is_some() {
                return Err(invalid(FieldCause::forbidden(
                    "force",
                    "may not be specified for non-apply patch",
                )));
            }
        }
        Ok(WriteCtx {
            user: self.user.clone(),
            dry_run,
            validation,
            warnings: Default::default(),
            field_manager,
            user_agent: manager_from_user_agent(&self.user_agent),
            force,
        })
    }

    pub(crate) fn json_body(&self) -> Result<Value, ApiError> {
        let ct = self
            .content_type
            .split(';')
            .next()
            .unwrap_or_default()
            .trim();
        if ct == protobuf::CONTENT_TYPE {
            return protobuf::decode(&self.body);
        }
        if !ct.is_empty() && ct != "application/json" && ct != "*/*" {
            return Err(ApiError::new(
                Reason::UnsupportedMediaType,
                format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json (got \"{ct}\"; the simulated API server speaks JSON only)"
                ),
            ));
        }
        serde_json::from_slice(&self.body).map_err(|e| {
            ApiError::bad_request(format!("json: cannot unmarshal the request body: {e}"))
        })
    }
}

/// The longest field manager name the real server accepts.
const MAX_FIELD_MANAGER: usize = 128;

/// The program name of a user agent (`kubectl/v1.32 (linux/amd64) …` →
/// `kubectl`), as the real server names the manager of a write without a
/// `fieldManager`; control characters dropped, at most 128 characters.
fn manager_from_user_agent(ua: &str) -> String {
    ua.split('/')
        .next()
        .unwrap_or_default()
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_FIELD_MANAGER)
        .collect()
}

/// Selectors of a list or watch.
pub struct Filter {
    /// Labels.
    pub labels: LabelSelector,
    /// Fields.
    pub fields: FieldSelector,
}

impl Filter {
    /// From `labelSelector` and `fieldSelector`.
    pub fn from_req(def: &ResourceDef, r: &Req) -> Result<Self, ApiError> {
        let labels = LabelSelector::parse(r.q("labelSelector").unwrap_or_default())
            .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?;
        let fields = FieldSelector::for_resource(r.q("fieldSelector").unwrap_or_default(), def)
            .map_err(ApiError::bad_request)?;
        Ok(Filter { labels, fields })
    }

    /// Whether an object is selected.
    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }
}

/// Reads the resourceVersion list/watch parameter.
pub fn parse_rv(r: &Req) -> Result<Option<u64>, ApiError> {
    match r.q("resourceVersion") {
        None => Ok(None),
        Some(s) => s.parse::<u64>().map(Some).map_err(|_| {
            ApiError::bad_request(format!(
                "resourceVersion: Invalid value: \"{s}\": must be a non-negative integer"
            ))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: Method, query: &[(&str, &str)], content_type: &str) -> Req {
        Req {
            method,
            segments: Vec::new(),
            query: query
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            accept: String::new(),
            content_type: content_type.into(),
            user: crate::admin_user(),
            user_agent: "kubectl/v1.32.4 (linux/amd64) kubernetes/abc".into(),
            body: Bytes::new(),
        }
    }

    const APPLY: &str = "application/apply-patch+yaml";

    #[test]
    fn managers_default_to_the_user_agent_program() {
        let ctx = req(Method::PUT, &[], "application/json")
            .write_ctx()
            .expect("valid");
        assert_eq!(ctx.manager(), "kubectl");
        let ctx = req(Method::POST, &[("fieldManager", "kubectl-create")], "")
            .write_ctx()
            .expect("valid");
        assert_eq!(ctx.manager(), "kubectl-create");
        assert_eq!(manager_from_user_agent("helm\u{7}x/4"), "helmx");
    }

    #[test]
    fn apply_needs_a_field_manager_and_only_apply_takes_force() {
        let e = req(Method::PATCH, &[], APPLY)
            .write_ctx()
            .expect_err("no manager");
        assert_eq!(e.http_code(), 422);
        assert_eq!(
            e.message,
            "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch"
        );
        let ctx = req(
            Method::PATCH,
            &[("fieldManager", "m"), ("force", "true")],
            APPLY,
        )
        .write_ctx()
        .expect("valid");
        assert!(ctx.force);
        let e = req(
            Method::PATCH,
            &[("force", "true")],
            "application/merge-patch+json",
        )
        .write_ctx()
        .expect_err("force");
        assert_eq!(e.http_code(), 422);
        assert!(e.message.contains("force: Forbidden"), "{}", e.message);
        let e = req(
            Method::PATCH,
            &[("fieldManager", "m"), ("force", "yes")],
            APPLY,
        )
        .write_ctx()
        .expect_err("bad force");
        assert_eq!(e.http_code(), 400);
        let long = "m".repeat(129);
        let e = req(Method::POST, &[("fieldManager", long.as_str())], "")
            .write_ctx()
            .expect_err("too long");
        assert!(
            e.message.starts_with("CreateOptions.meta.k8s.io"),
            "{}",
            e.message
        );
        let e = req(Method::PUT, &[("fieldManager", "a\u{1}b")], "")
            .write_ctx()
            .expect_err("control character");
        assert!(e.message.contains("invalid character"), "{}", e.message);
    }
}
