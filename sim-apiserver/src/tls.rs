//! The serving certificate: a fresh CA per server and a certificate for
//! `127.0.0.1` and `localhost` signed by it. kubectl only sends bearer tokens
//! over TLS, so the server serves HTTPS unless told otherwise.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA and the server configuration using a certificate it signed.
pub struct Serving {
    /// PEM of the CA certificate (for kubeconfigs and clients).
    pub ca_pem: String,
    /// The rustls server configuration.
    pub config: Arc<rustls::ServerConfig>,
}

/// Generates the CA and the serving certificate.
pub fn generate() -> Result<Serving, String> {
    let err = |e: rcgen::Error| format!("cannot generate the serving certificate: {e}");
    let ca_key = KeyPair::generate().map_err(err)?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "gpupool-sim-ca");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).map_err(err)?;
    let key = KeyPair::generate().map_err(err)?;
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .map_err(err)?;
    params
        .distinguished_name
        .push(DnType::CommonName, "gpupool-sim-apiserver");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &ca).map_err(err)?;
    let chain: Vec<CertificateDer<'static>> = vec![cert.der().clone()];
    let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_no_client_auth()
    .with_single_cert(chain, private)
    .map_err(|e| format!("cannot use the serving certificate: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Serving {
        ca_pem: ca.pem(),
        config: Arc::new(config),
    })
}
