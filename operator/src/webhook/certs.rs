//! The webhook's serving certificate: generated with rcgen, kept in a Secret
//! in the operator's namespace so that every replica serves the same one, and
//! renewed when it nears expiry or no longer covers the webhook's names.
//!
//! The Secret (type `kubernetes.io/tls`) holds `tls.crt`, `tls.key` and
//! `ca.crt`. `ca.crt` is the CA bundle written into the webhook
//! configurations: the CA that signed `tls.crt` and, after a renewal, the
//! previous CA too, so a replica still serving the old certificate keeps
//! being trusted until it reloads the Secret.

use std::sync::Arc;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, crypto::ring};

/// Name of the Secret that holds the serving certificate.
pub const SECRET_NAME: &str = "gpupool-webhook-tls";
/// Secret key of the serving certificate (PEM).
pub const KEY_CERT: &str = "tls.crt";
/// Secret key of the serving certificate's private key (PEM).
pub const KEY_PRIVATE_KEY: &str = "tls.key";
/// Secret key of the CA bundle (PEM) the webhook configurations carry.
pub const KEY_CA_BUNDLE: &str = "ca.crt";

/// How long a generated certificate (and its CA) is valid.
pub const VALIDITY: SignedDuration = SignedDuration::from_hours(365 * 24);
/// A certificate that expires within this much time is renewed.
pub const RENEW_BEFORE: SignedDuration = SignedDuration::from_hours(30 * 24);

/// Why the serving certificate could not be made, read or stored.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen failed to generate a key or certificate.
    #[error("cannot generate the webhook certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// A subject name is neither a DNS name nor an IP address.
    #[error("{name:?} cannot be a certificate name: {reason}")]
    BadName {
        /// The name.
        name: String,
        /// Why.
        reason: String,
    },
    /// The API server refused to read or write the Secret.
    #[error("cannot read or write Secret {namespace}/{name}: {source}")]
    Secret {
        /// Namespace of the Secret.
        namespace: String,
        /// Name of the Secret.
        name: String,
        /// What the API server said.
        #[source]
        source: kube::Error,
    },
    /// Other replicas kept changing the Secret under this one.
    #[error(
        "Secret {namespace}/{name} kept changing while being renewed; gave up after {attempts} attempts"
    )]
    Contended {
        /// Namespace of the Secret.
        namespace: String,
        /// Name of the Secret.
        name: String,
        /// Attempts made.
        attempts: usize,
    },
}

/// Why a stored certificate cannot be used as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertProblem {
    /// A Secret key is absent.
    #[error("{0} is missing")]
    Missing(&'static str),
    /// A Secret key does not hold a readable PEM object.
    #[error("{key} is unreadable: {reason}")]
    Unreadable {
        /// The key.
        key: &'static str,
        /// What failed.
        reason: String,
    },
    /// `tls.key` is not the key of `tls.crt`.
    #[error("tls.key does not belong to tls.crt: {0}")]
    KeyMismatch(String),
    /// The certificate does not verify for a name at the checked time
    /// (expired or expiring, not issued for the name, not signed by the CA).
    #[error("tls.crt is not valid for {name} until {until}: {reason}")]
    NotValid {
        /// The name checked.
        name: String,
        /// The time it must still be valid at.
        until: Timestamp,
        /// What the verifier said.
        reason: String,
    },
}

/// A serving certificate, its key, and the CA bundle clients verify it with.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsBundle {
    /// PEM of the serving certificate.
    pub cert_pem: String,
    /// PEM of its private key.
    pub key_pem: String,
    /// PEM of the CA bundle (the signing CA first).
    pub ca_pem: String,
}

impl std::fmt::Debug for TlsBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsBundle")
            .field("cert_pem", &self.cert_pem)
            .field("ca_pem", &self.ca_pem)
            .finish_non_exhaustive()
    }
}

impl TlsBundle {
    /// The rustls key the server presents, checked to match the certificate.
    pub fn certified_key(&self) -> Result<Arc<CertifiedKey>, CertProblem> {
        let chain = certs(KEY_CERT, &self.cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|e| {
            CertProblem::Unreadable {
                key: KEY_PRIVATE_KEY,
                reason: e.to_string(),
            }
        })?;
        let signer = ring::sign::any_supported_type(&key).map_err(|e| CertProblem::Unreadable {
            key: KEY_PRIVATE_KEY,
            reason: e.to_string(),
        })?;
        let certified = CertifiedKey::new(chain, signer);
        certified
            .keys_match()
            .map_err(|e| CertProblem::KeyMismatch(e.to_string()))?;
        Ok(Arc::new(certified))
    }

    /// Checks that the key matches and the certificate verifies against the
    /// CA bundle for every one of `names` at `at`.
    pub fn check(&self, names: &[String], at: Timestamp) -> Result<(), CertProblem> {
        let certified = self.certified_key()?;
        let Some(leaf) = certified.cert.first() else {
            return Err(CertProblem::Missing(KEY_CERT));
        };
        let mut roots = RootCertStore::empty();
        for ca in certs(KEY_CA_BUNDLE, &self.ca_pem)? {
            roots.add(ca).map_err(|e| CertProblem::Unreadable {
                key: KEY_CA_BUNDLE,
                reason: e.to_string(),
            })?;
        }
        let verifier = WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(ring::default_provider()),
        )
        .build()
        .map_err(|e| CertProblem::Unreadable {
            key: KEY_CA_BUNDLE,
            reason: e.to_string(),
        })?;
        let when = UnixTime::since_unix_epoch(std::time::Duration::from_secs(
            u64::try_from(at.as_second()).unwrap_or(0),
        ));
        for name in names {
            let not_valid = |reason: String| CertProblem::NotValid {
                name: name.clone(),
                until: at,
                reason,
            };
            let server_name =
                ServerName::try_from(name.as_str()).map_err(|e| not_valid(e.to_string()))?;
            verifier
                .verify_server_cert(leaf, &certified.cert[1..], &server_name, &[], when)
                .map_err(|e| not_valid(e.to_string()))?;
        }
        Ok(())
    }

    /// Reads the bundle from a Secret's data.
    pub fn from_secret(secret: &Secret) -> Result<Self, CertProblem> {
        let field = |key: &'static str| -> Result<String, CertProblem> {
            let bytes = secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .ok_or(CertProblem::Missing(key))?;
            String::from_utf8(bytes.0.clone()).map_err(|e| CertProblem::Unreadable {
                key,
                reason: e.to_string(),
            })
        };
        Ok(Self {
            cert_pem: field(KEY_CERT)?,
            key_pem: field(KEY_PRIVATE_KEY)?,
            ca_pem: field(KEY_CA_BUNDLE)?,
        })
    }

    /// A `kubernetes.io/tls` Secret holding the bundle.
    pub fn to_secret(&self, namespace: &str, name: &str) -> Secret {
        let data = [
            (KEY_CERT, &self.cert_pem),
            (KEY_PRIVATE_KEY, &self.key_pem),
            (KEY_CA_BUNDLE, &self.ca_pem),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
        .collect();
        Secret {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(namespace.to_owned()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_owned(),
                        gpupool_api::names::FIELD_MANAGER_OPERATOR.to_owned(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            type_: Some("kubernetes.io/tls".to_owned()),
            data: Some(data),
            ..Default::default()
        }
    }
}

fn certs(key: &'static str, pem: &str) -> Result<Vec<CertificateDer<'static>>, CertProblem> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertProblem::Unreadable {
            key,
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(CertProblem::Unreadable {
            key,
            reason: "no PEM certificate in it".to_owned(),
        });
    }
    Ok(certs)
}

/// Generates a fresh CA and a serving certificate for `names` (DNS names or
/// IP addresses), valid from the day before `now` (tolerating clock skew
/// between replicas and the API server) for [`VALIDITY`]. `previous_ca`, the
/// CA bundle being replaced, has its first (signing) certificate kept after
/// the new CA in the bundle.
pub fn generate(
    names: &[String],
    now: Timestamp,
    previous_ca: Option<&str>,
) -> Result<TlsBundle, CertError> {
    for name in names {
        ServerName::try_from(name.as_str()).map_err(|e| CertError::BadName {
            name: name.clone(),
            reason: e.to_string(),
        })?;
    }
    // rcgen takes whole UTC days.
    let day = |at: Timestamp| {
        let d = at.to_zoned(jiff::tz::TimeZone::UTC).date();
        rcgen::date_time_ymd(
            i32::from(d.year()),
            d.month().unsigned_abs(),
            d.day().unsigned_abs(),
        )
    };
    let not_before = day(now - SignedDuration::from_hours(24));
    let not_after = day(now + VALIDITY);

    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.distinguished_name = common_name("gpupool webhook CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca_params.not_before = not_before;
    ca_params.not_after = not_after;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.to_vec())?;
    params.distinguished_name =
        common_name(names.first().map_or("gpupool-webhook", String::as_str));
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = not_after;
    let cert = params.signed_by(&key, &issuer)?;

    let mut ca_pem = ca_cert.pem();
    if let Some(previous) = previous_ca.and_then(signing_ca) {
        ca_pem.push_str(previous);
        ca_pem.push('\n');
    }
    Ok(TlsBundle {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        ca_pem,
    })
}

/// The first PEM certificate of a CA bundle, when it reads as one.
fn signing_ca(bundle: &str) -> Option<&str> {
    const END: &str = "-----END CERTIFICATE-----";
    let end = bundle.find(END)? + END.len();
    let first = bundle[..end].trim_start();
    certs(KEY_CA_BUNDLE, first).ok().map(|_| first)
}

fn common_name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

/// How many times [`ensure_secret`] re-reads a Secret other replicas keep changing.
const ATTEMPTS: usize = 5;

/// Returns the serving certificate stored in Secret `namespace/name`,
/// creating the Secret when absent and renewing it when it fails
/// [`TlsBundle::check`] for `names` at `now + RENEW_BEFORE`. When another
/// replica creates or renews it first, that replica's certificate is used.
pub async fn ensure_secret(
    client: kube::Client,
    namespace: &str,
    name: &str,
    names: &[String],
    now: Timestamp,
) -> Result<TlsBundle, CertError> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let secret_error = |source| CertError::Secret {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    for _ in 0..ATTEMPTS {
        let existing = api.get_opt(name).await.map_err(secret_error)?;
        let Some(existing) = existing else {
            let bundle = generate(names, now, None)?;
            match api
                .create(&PostParams::default(), &bundle.to_secret(namespace, name))
                .await
            {
                Ok(_) => {
                    tracing::info!(secret = name, namespace, "created the webhook certificate");
                    return Ok(bundle);
                }
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(secret_error(e)),
            }
        };
        let stored = TlsBundle::from_secret(&existing);
        let problem = match &stored {
            Ok(bundle) => match bundle.check(names, now + RENEW_BEFORE) {
                Ok(()) => return Ok(bundle.clone()),
                Err(problem) => problem,
            },
            Err(problem) => problem.clone(),
        };
        tracing::info!(secret = name, namespace, %problem, "renewing the webhook certificate");
        let previous = stored.as_ref().ok().map(|b| b.ca_pem.as_str());
        let bundle = generate(names, now, previous)?;
        let mut replacement = bundle.to_secret(namespace, name);
        replacement.metadata.resource_version = existing.metadata.resource_version.clone();
        match api
            .replace(name, &PostParams::default(), &replacement)
            .await
        {
            Ok(_) => return Ok(bundle),
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(secret_error(e)),
        }
    }
    Err(CertError::Contended {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        attempts: ATTEMPTS,
    })
}

/// AlreadyExists and Conflict both answer 409: someone else wrote first.
pub(crate) fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 409)
}

#[cfg(test)]
#[path = "certs_tests.rs"]
mod tests;
