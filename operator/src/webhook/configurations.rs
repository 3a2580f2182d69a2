//! The MutatingWebhookConfiguration and ValidatingWebhookConfiguration that
//! route pod CREATEs and UPDATEs to the webhook (DESIGN §8).

use std::fmt::Debug;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations,
    ServiceReference, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, OwnerReference,
};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::certs::is_conflict;
use super::config::{
    CLASS_PATH, LEASE_PATH, MUTATE_PATH, VALIDATE_PATH, WebhookConfig, WebhookEndpoint,
};

/// Name of the mutating webhook; users see it in denials as
/// `admission webhook "queue.pods.gpupool.io" denied the request: ...`.
pub const MUTATING_WEBHOOK_NAME: &str = "queue.pods.gpupool.io";
/// Name of the validating pod webhook (gate removal, queue labels).
pub const VALIDATING_WEBHOOK_NAME: &str = "gate.pods.gpupool.io";
/// Name of the validating GpuLease webhook.
pub const LEASE_WEBHOOK_NAME: &str = "leases.gpupool.io";
/// Name of the validating GpuLeaseClass webhook.
pub const CLASS_WEBHOOK_NAME: &str = "classes.gpupool.io";
/// CEL condition of the mutating pod webhook: only pods asking for a
/// domain-qualified extended resource (a name with a `/`, as every device
/// plugin's is) in any container or init container are sent. A pod that
/// asks for no such resource never waits on the operator, so an outage of
/// gpupool cannot block it. The webhook decides the rest itself (which of
/// those resources are gpupool's), so API servers that ignore match
/// conditions stay correct.
pub const ASKS_FOR_AN_EXTENDED_RESOURCE: &str = concat!(
    "object.spec.containers.exists(c, has(c.resources)",
    " && ((has(c.resources.limits) && c.resources.limits.exists(r, r.contains('/')))",
    " || (has(c.resources.requests) && c.resources.requests.exists(r, r.contains('/')))))",
    " || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.resources)",
    " && ((has(c.resources.limits) && c.resources.limits.exists(r, r.contains('/')))",
    " || (has(c.resources.requests) && c.resources.requests.exists(r, r.contains('/'))))))",
);

/// CEL condition of the validating pod webhook: only updates that touch what
/// the webhook guards are sent (pods that carry the gate, or a change of the
/// class or role label or of the enqueue stamp), so ordinary pod updates
/// never depend on the webhook being up. The webhook checks the same itself,
/// so API servers that ignore match conditions stay correct.
pub const GUARDED_POD_UPDATES: &str = concat!(
    "(has(oldObject.spec.schedulingGates) && oldObject.spec.schedulingGates.exists(g, g.name == 'gpupool.io/admission'))",
    " || (has(oldObject.metadata.labels) && 'gpupool.io/class' in oldObject.metadata.labels ? oldObject.metadata.labels['gpupool.io/class'] : '')",
    " != (has(object.metadata.labels) && 'gpupool.io/class' in object.metadata.labels ? object.metadata.labels['gpupool.io/class'] : '')",
    " || (has(oldObject.metadata.labels) && 'gpupool.io/role' in oldObject.metadata.labels ? oldObject.metadata.labels['gpupool.io/role'] : '')",
    " != (has(object.metadata.labels) && 'gpupool.io/role' in object.metadata.labels ? object.metadata.labels['gpupool.io/role'] : '')",
    " || (has(oldObject.metadata.annotations) && 'gpupool.io/enqueued-at' in oldObject.metadata.annotations ? oldObject.metadata.annotations['gpupool.io/enqueued-at'] : '')",
    " != (has(object.metadata.annotations) && 'gpupool.io/enqueued-at' in object.metadata.annotations ? object.metadata.annotations['gpupool.io/enqueued-at'] : '')",
);
/// Seconds the API server waits for an answer before failing the request.
pub const TIMEOUT_SECONDS: i32 = 5;

/// The webhook configurations could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ConfigurationError {
    /// The API server refused a read or write.
    #[error("cannot write {kind} {name:?}: {source}")]
    Api {
        /// The kind.
        kind: &'static str,
        /// The object's name.
        name: String,
        /// What the API server said.
        #[source]
        source: kube::Error,
    },
    /// The ClusterRole meant to own the configurations does not exist.
    #[error(
        "ClusterRole {name:?} (--webhook-owner-cluster-role) does not exist; the webhook configurations need it as their owner"
    )]
    OwnerMissing {
        /// The ClusterRole's name.
        name: String,
    },
    /// Other writers kept changing the object.
    #[error("{kind} {name:?} kept changing while being updated; gave up after {attempts} attempts")]
    Contended {
        /// The kind.
        kind: &'static str,
        /// The object's name.
        name: String,
        /// Attempts made.
        attempts: usize,
    },
}

fn client_config(endpoint: &WebhookEndpoint, path: &str, ca_bundle: &str) -> WebhookClientConfig {
    let ca_bundle = Some(ByteString(ca_bundle.as_bytes().to_vec()));
    match endpoint {
        WebhookEndpoint::Service(s) => WebhookClientConfig {
            ca_bundle,
            service: Some(ServiceReference {
                namespace: s.namespace.clone(),
                name: s.name.clone(),
                path: Some(path.to_owned()),
                port: Some(i32::from(s.port)),
            }),
            url: None,
        },
        WebhookEndpoint::Url(u) => WebhookClientConfig {
            ca_bundle,
            service: None,
            url: Some(u.join(path)),
        },
    }
}

fn pod_rule(operation: &str) -> RuleWithOperations {
    RuleWithOperations {
        api_groups: Some(vec![String::new()]),
        api_versions: Some(vec!["v1".to_owned()]),
        operations: Some(vec![operation.to_owned()]),
        resources: Some(vec!["pods".to_owned()]),
        scope: Some("Namespaced".to_owned()),
    }
}

fn gpupool_rule(resources: &[&str]) -> RuleWithOperations {
    RuleWithOperations {
        api_groups: Some(vec![gpupool_api::names::GROUP.to_owned()]),
        api_versions: Some(vec!["*".to_owned()]),
        operations: Some(vec!["CREATE".to_owned(), "UPDATE".to_owned()]),
        resources: Some(resources.iter().map(|r| (*r).to_owned()).collect()),
        scope: Some("*".to_owned()),
    }
}

/// CEL condition sending a review only for users other than the operator.
/// The webhooks guard what tenants and device plugins write; the operator's
/// own writes (its admissions above all) are trusted, so they neither wait
/// for a review nor fail when the webhook cannot be reached.
fn not_the_operator(config: &WebhookConfig) -> MatchCondition {
    let users = config
        .gate_owners
        .users()
        .iter()
        .map(|u| format!("'{}'", u.replace('\\', "\\\\").replace('\'', "\\'")))
        .collect::<Vec<_>>()
        .join(", ");
    MatchCondition {
        name: "not-the-operator".to_owned(),
        expression: format!("!(request.userInfo.username in [{users}])"),
    }
}

fn namespace_selector(config: &WebhookConfig) -> LabelSelector {
    LabelSelector {
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: "kubernetes.io/metadata.name".to_owned(),
            operator: "NotIn".to_owned(),
            values: Some(config.excluded_namespaces()),
        }]),
        match_labels: None,
    }
}

fn metadata(config: &WebhookConfig, owner: Option<&OwnerReference>) -> ObjectMeta {
    ObjectMeta {
        owner_references: owner.map(|o| vec![o.clone()]),
        name: Some(config.configuration_name.clone()),
        labels: Some(
            [(
                "app.kubernetes.io/managed-by".to_owned(),
                gpupool_api::names::FIELD_MANAGER_OPERATOR.to_owned(),
            )]
            .into(),
        ),
        ..Default::default()
    }
}

/// The MutatingWebhookConfiguration: pod CREATE to [`MUTATE_PATH`] for pods
/// asking for an extended resource ([`ASKS_FOR_AN_EXTENDED_RESOURCE`]),
/// `failurePolicy: Fail` (a GPU pod is refused while gpupool is down rather
/// than run outside its queue), 5 s timeout, no side effects, AdmissionReview
/// v1, every namespace but `kube-system` and the operator's.
pub fn mutating(
    config: &WebhookConfig,
    ca_bundle: &str,
    owner: Option<&OwnerReference>,
) -> MutatingWebhookConfiguration {
    MutatingWebhookConfiguration {
        metadata: metadata(config, owner),
        webhooks: Some(vec![MutatingWebhook {
            name: MUTATING_WEBHOOK_NAME.to_owned(),
            admission_review_versions: vec!["v1".to_owned()],
            client_config: client_config(&config.endpoint, MUTATE_PATH, ca_bundle),
            failure_policy: Some("Fail".to_owned()),
            match_conditions: Some(vec![MatchCondition {
                name: "asks-for-an-extended-resource".to_owned(),
                expression: ASKS_FOR_AN_EXTENDED_RESOURCE.to_owned(),
            }]),
            match_policy: Some("Equivalent".to_owned()),
            namespace_selector: Some(namespace_selector(config)),
            object_selector: Some(LabelSelector::default()),
            reinvocation_policy: Some("Never".to_owned()),
            rules: Some(vec![pod_rule("CREATE")]),
            side_effects: "None".to_owned(),
            timeout_seconds: Some(TIMEOUT_SECONDS),
        }]),
    }
}

/// The ValidatingWebhookConfiguration: pod UPDATE by anyone but the operator
/// to [`VALIDATE_PATH`], with the same policy, timeout and namespace
/// exclusions as [`mutating`];
/// GpuLease CREATE and UPDATE (main resource and status) by anyone but the
/// operator to [`LEASE_PATH`]; GpuLeaseClass CREATE and UPDATE to
/// [`CLASS_PATH`].
pub fn validating(
    config: &WebhookConfig,
    ca_bundle: &str,
    owner: Option<&OwnerReference>,
) -> ValidatingWebhookConfiguration {
    ValidatingWebhookConfiguration {
        metadata: metadata(config, owner),
        webhooks: Some(vec![
            ValidatingWebhook {
                name: VALIDATING_WEBHOOK_NAME.to_owned(),
                admission_review_versions: vec!["v1".to_owned()],
                client_config: client_config(&config.endpoint, VALIDATE_PATH, ca_bundle),
                failure_policy: Some("Fail".to_owned()),
                match_conditions: Some(vec![
                    MatchCondition {
                        name: "guarded-pod-updates".to_owned(),
                        expression: GUARDED_POD_UPDATES.to_owned(),
                    },
                    not_the_operator(config),
                ]),
                match_policy: Some("Equivalent".to_owned()),
                namespace_selector: Some(namespace_selector(config)),
                object_selector: Some(LabelSelector::default()),
                rules: Some(vec![pod_rule("UPDATE")]),
                side_effects: "None".to_owned(),
                timeout_seconds: Some(TIMEOUT_SECONDS),
            },
            ValidatingWebhook {
                name: LEASE_WEBHOOK_NAME.to_owned(),
                admission_review_versions: vec!["v1".to_owned()],
                client_config: client_config(&config.endpoint, LEASE_PATH, ca_bundle),
                failure_policy: Some("Fail".to_owned()),
                match_conditions: Some(vec![not_the_operator(config)]),
                match_policy: Some("Equivalent".to_owned()),
                // Written out as the API server defaults them, so a stored
                // configuration compares equal and is not rewritten in a loop.
                namespace_selector: Some(LabelSelector::default()),
                object_selector: Some(LabelSelector::default()),
                rules: Some(vec![gpupool_rule(&["gpuleases", "gpuleases/status"])]),
                side_effects: "None".to_owned(),
                timeout_seconds: Some(TIMEOUT_SECONDS),
            },
            ValidatingWebhook {
                name: CLASS_WEBHOOK_NAME.to_owned(),
                admission_review_versions: vec!["v1".to_owned()],
                client_config: client_config(&config.endpoint, CLASS_PATH, ca_bundle),
                failure_policy: Some("Fail".to_owned()),
                match_policy: Some("Equivalent".to_owned()),
                // Written out as the API server defaults them, so a stored
                // configuration compares equal and is not rewritten in a loop.
                namespace_selector: Some(LabelSelector::default()),
                object_selector: Some(LabelSelector::default()),
                rules: Some(vec![gpupool_rule(&["gpuleaseclasses"])]),
                side_effects: "None".to_owned(),
                timeout_seconds: Some(TIMEOUT_SECONDS),
                ..Default::default()
            },
        ]),
    }
}

const ATTEMPTS: usize = 5;

/// What [`apply`] found and did to one configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// It was as wanted; nothing was written.
    Unchanged,
    /// It was missing and was created.
    Created,
    /// It differed (edited by someone, or an older certificate) and was replaced.
    Replaced,
}

/// What [`apply`] did: (MutatingWebhookConfiguration, ValidatingWebhookConfiguration).
pub type Applied = (Written, Written);

/// Creates or replaces both configurations so they carry `ca_bundle`, point
/// at `config.endpoint` and, with `config.owner_cluster_role`, name that
/// ClusterRole as their owner. Writes nothing when an object already matches.
pub async fn apply(
    client: kube::Client,
    config: &WebhookConfig,
    ca_bundle: &str,
) -> Result<Applied, ConfigurationError> {
    let owner = match &config.owner_cluster_role {
        Some(name) => Some(owner_reference(client.clone(), name).await?),
        None => None,
    };
    let mutating = create_or_replace(
        &Api::all(client.clone()),
        "MutatingWebhookConfiguration",
        mutating(config, ca_bundle, owner.as_ref()),
        |have, want| have.webhooks == want.webhooks && same_owners(have, want),
    )
    .await?;
    let validating = create_or_replace(
        &Api::all(client),
        "ValidatingWebhookConfiguration",
        validating(config, ca_bundle, owner.as_ref()),
        |have, want| have.webhooks == want.webhooks && same_owners(have, want),
    )
    .await?;
    Ok((mutating, validating))
}

/// The owner reference to ClusterRole `name`, which must exist (its uid is
/// part of the reference). Not a controller reference and no
/// blockOwnerDeletion: the role is only an anchor for garbage collection.
async fn owner_reference(
    client: kube::Client,
    name: &str,
) -> Result<OwnerReference, ConfigurationError> {
    let roles: Api<ClusterRole> = Api::all(client);
    let role = roles
        .get_opt(name)
        .await
        .map_err(|source| ConfigurationError::Api {
            kind: "ClusterRole",
            name: name.to_owned(),
            source,
        })?
        .ok_or_else(|| ConfigurationError::OwnerMissing {
            name: name.to_owned(),
        })?;
    Ok(OwnerReference {
        api_version: "rbac.authorization.k8s.io/v1".to_owned(),
        kind: "ClusterRole".to_owned(),
        name: name.to_owned(),
        uid: role.metadata.uid.unwrap_or_default(),
        ..OwnerReference::default()
    })
}

fn same_owners<K: Resource>(have: &K, want: &K) -> bool {
    have.meta().owner_references.as_deref().unwrap_or_default()
        == want.meta().owner_references.as_deref().unwrap_or_default()
}

async fn create_or_replace<K>(
    api: &Api<K>,
    kind: &'static str,
    mut want: K,
    same: impl Fn(&K, &K) -> bool,
) -> Result<Written, ConfigurationError>
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    let name = want.name_any();
    let api_error = |source| ConfigurationError::Api {
        kind,
        name: name.clone(),
        source,
    };
    for _ in 0..ATTEMPTS {
        let (result, written) = match api.get_opt(&name).await.map_err(api_error)? {
            None => (
                api.create(&PostParams::default(), &want).await,
                Written::Created,
            ),
            Some(have) if same(&have, &want) => return Ok(Written::Unchanged),
            Some(have) => {
                want.meta_mut().resource_version = have.resource_version();
                (
                    api.replace(&name, &PostParams::default(), &want).await,
                    Written::Replaced,
                )
            }
        };
        match result {
            Ok(_) => {
                tracing::info!(kind, name, ?written, "webhook configuration written");
                return Ok(written);
            }
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(api_error(e)),
        }
    }
    Err(ConfigurationError::Contended {
        kind,
        name,
        attempts: ATTEMPTS,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::review::Users;
    use serde_json::json;

    fn config(endpoint: &str) -> WebhookConfig {
        let endpoint = if endpoint.starts_with("https://") {
            WebhookEndpoint::Url(endpoint.parse().expect("url"))
        } else {
            WebhookEndpoint::Service(endpoint.parse().expect("service"))
        };
        WebhookConfig::new(9443, "gpupool-system", endpoint, Vec::<String>::new())
    }

    const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    #[test]
    fn mutating_configuration_for_a_service() {
        let c = config("gpupool-system/gpupool-webhook");
        let v = serde_json::to_value(mutating(&c, CA, None)).expect("serializes");
        assert_eq!(v["metadata"]["name"], json!("gpupool"));
        let hook = &v["webhooks"][0];
        assert_eq!(hook["name"], json!(MUTATING_WEBHOOK_NAME));
        assert_eq!(hook["failurePolicy"], json!("Fail"));
        assert_eq!(hook["timeoutSeconds"], json!(5));
        assert_eq!(hook["sideEffects"], json!("None"));
        assert_eq!(hook["admissionReviewVersions"], json!(["v1"]));
        assert_eq!(
            hook["rules"],
            json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"}])
        );
        assert_eq!(
            hook["matchConditions"],
            json!([{"name": "asks-for-an-extended-resource", "expression": ASKS_FOR_AN_EXTENDED_RESOURCE}])
        );
        assert_eq!(
            hook["namespaceSelector"],
            json!({"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["gpupool-system", "kube-system"]}]})
        );
        assert_eq!(
            hook["clientConfig"]["service"],
            json!({"namespace": "gpupool-system", "name": "gpupool-webhook", "path": "/mutate-pods", "port": 443})
        );
        assert!(hook["clientConfig"].get("url").is_none());
        // caBundle is base64 of the PEM, as the API expects.
        let ca: ByteString =
            serde_json::from_value(hook["clientConfig"]["caBundle"].clone()).expect("base64");
        assert_eq!(ca.0, CA.as_bytes());
    }

    #[test]
    fn validating_configuration_for_a_url() {
        let c = config("https://127.0.0.1:9443");
        let v = serde_json::to_value(validating(&c, CA, None)).expect("serializes");
        let hook = &v["webhooks"][0];
        assert_eq!(hook["name"], json!(VALIDATING_WEBHOOK_NAME));
        assert_eq!(hook["failurePolicy"], json!("Fail"));
        assert_eq!(hook["timeoutSeconds"], json!(5));
        assert_eq!(hook["rules"][0]["operations"], json!(["UPDATE"]));
        assert_eq!(
            hook["clientConfig"]["url"],
            json!("https://127.0.0.1:9443/validate-pods")
        );
        assert!(hook["clientConfig"].get("service").is_none());
        assert_eq!(
            hook["matchConditions"],
            json!([
                {"name": "guarded-pod-updates", "expression": GUARDED_POD_UPDATES},
                {
                    "name": "not-the-operator",
                    "expression": "!(request.userInfo.username in ['system:serviceaccount:gpupool-system:gpupool-operator'])"
                }
            ])
        );
        assert_eq!(
            hook["namespaceSelector"]["matchExpressions"][0]["values"],
            json!(["gpupool-system", "kube-system"])
        );
    }

    #[test]
    fn match_condition_names_the_gate_and_the_guarded_keys() {
        for key in [
            gpupool_api::names::SCHEDULING_GATE,
            gpupool_api::names::LABEL_CLASS,
            gpupool_api::names::LABEL_ROLE,
            gpupool_api::names::ANNOTATION_ENQUEUED_AT,
        ] {
            let quoted = format!("'{key}'");
            assert!(GUARDED_POD_UPDATES.contains(&quoted), "{key}");
        }
    }

    #[test]
    fn lease_and_class_webhooks_route_gpupool_objects() {
        let c = config("https://127.0.0.1:9443");
        let v = serde_json::to_value(validating(&c, CA, None)).expect("json");
        let hooks = v["webhooks"].as_array().expect("webhooks");
        assert_eq!(hooks.len(), 3);
        let lease = &hooks[1];
        assert_eq!(lease["name"], json!(LEASE_WEBHOOK_NAME));
        assert_eq!(
            lease["rules"][0]["resources"],
            json!(["gpuleases", "gpuleases/status"])
        );
        assert_eq!(lease["rules"][0]["apiGroups"], json!(["gpupool.io"]));
        assert_eq!(lease["rules"][0]["operations"], json!(["CREATE", "UPDATE"]));
        assert_eq!(
            lease["clientConfig"]["url"],
            json!("https://127.0.0.1:9443/validate-gpuleases")
        );
        assert_eq!(
            lease["matchConditions"][0]["expression"],
            json!(
                "!(request.userInfo.username in ['system:serviceaccount:gpupool-system:gpupool-operator'])"
            )
        );
        let class = &hooks[2];
        assert_eq!(class["name"], json!(CLASS_WEBHOOK_NAME));
        assert_eq!(class["rules"][0]["resources"], json!(["gpuleaseclasses"]));
        assert_eq!(
            class["clientConfig"]["url"],
            json!("https://127.0.0.1:9443/validate-gpuleaseclasses")
        );
    }

    #[test]
    fn service_port_is_carried() {
        let c = config("ns/hook:8443");
        let m = mutating(&c, CA, None);
        let port = m
            .webhooks
            .as_ref()
            .and_then(|w| w[0].client_config.service.as_ref())
            .and_then(|s| s.port);
        assert_eq!(port, Some(8443));
        assert_eq!(
            c.gate_owners,
            Users::new(["system:serviceaccount:gpupool-system:gpupool-operator".to_owned()])
        );
    }
}
