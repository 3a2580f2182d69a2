//! The control plane's PKI: one CA that signs the API server's serving
//! certificate and every client certificate (admin, kubelets, controllers),
//! plus the service-account signing key. All X.509 v3 (rustls refuses v1),
//! all generated fresh per run.

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// Why a certificate or key could not be generated.
#[derive(Debug, thiserror::Error)]
#[error("cannot generate {what}: {source}")]
pub struct CertError {
    /// Which certificate or key.
    pub what: String,
    /// What rcgen reported.
    #[source]
    pub source: rcgen::Error,
}

fn cert_error(what: &str) -> impl FnOnce(rcgen::Error) -> CertError + '_ {
    move |source| CertError {
        what: what.to_owned(),
        source,
    }
}

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct CertPair {
    /// The certificate.
    pub cert_pem: String,
    /// Its PKCS#8 private key.
    pub key_pem: String,
}

/// The CA every component trusts; it signs whatever the control plane needs.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate and key (the controller-manager signs with them).
    pub pair: CertPair,
}

impl Ca {
    /// A fresh self-signed CA.
    pub fn generate() -> Result<Self, CertError> {
        let key = KeyPair::generate().map_err(cert_error("the CA key"))?;
        let key_pem = key.serialize_pem();
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(cert_error("the CA"))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "gpupool-sim-control-plane-ca");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(cert_error("the CA"))?;
        let cert_pem = issuer.pem();
        Ok(Ca {
            issuer,
            pair: CertPair { cert_pem, key_pem },
        })
    }

    /// The API server's serving certificate, for `127.0.0.1`, `localhost`,
    /// the in-cluster names of the `kubernetes` Service and `extra_names`
    /// (IP addresses or DNS names: with real nodes, the address pods reach
    /// the API server on and the Service's cluster IP).
    pub fn serving(&self, extra_names: &[String]) -> Result<CertPair, CertError> {
        let mut names: Vec<String> = [
            "127.0.0.1",
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ]
        .map(String::from)
        .to_vec();
        names.extend_from_slice(extra_names);
        self.server_certificate("kube-apiserver", names)
    }

    /// A kubelet's serving certificate for its node IP and name, so the API
    /// server can verify it (`--kubelet-certificate-authority`) when it
    /// reaches the kubelet for logs and exec.
    pub fn kubelet_serving(&self, node: &str, node_ip: &str) -> Result<CertPair, CertError> {
        self.server_certificate(
            &format!("system:node:{node}"),
            vec![node_ip.to_owned(), node.to_owned()],
        )
    }

    fn server_certificate(&self, cn: &str, names: Vec<String>) -> Result<CertPair, CertError> {
        let what = format!("the serving certificate of {cn}");
        let key = KeyPair::generate().map_err(cert_error(&what))?;
        let mut params = CertificateParams::new(names).map_err(cert_error(&what))?;
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(cert_error(&what))?;
        Ok(CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A client certificate the API server authenticates as `user` in
    /// `groups` (CN and O, as Kubernetes reads them).
    pub fn client(&self, user: &str, groups: &[&str]) -> Result<CertPair, CertError> {
        let what = format!("a client certificate for {user}");
        let key = KeyPair::generate().map_err(cert_error(&what))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_error(&what))?;
        params.distinguished_name.push(DnType::CommonName, user);
        for g in groups {
            params.distinguished_name.push(DnType::OrganizationName, *g);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(cert_error(&what))?;
        Ok(CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A fresh key for signing service-account tokens (ES256): the private
/// key and the public key the API server verifies tokens with, both PEM.
pub fn service_account_key() -> Result<(String, String), CertError> {
    KeyPair::generate()
        .map(|k| (k.serialize_pem(), k.public_key_pem()))
        .map_err(cert_error("the service-account signing key"))
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text.as_bytes())
}

/// How a kubeconfig's user authenticates.
pub enum Credentials<'a> {
    /// A client certificate.
    Cert(&'a CertPair),
    /// A bearer token.
    Token(&'a str),
}

/// A kubeconfig with one cluster, user and context named `gpupool-sim`, the
/// CA embedded, so it works from any directory.
pub fn kubeconfig(server: &str, ca_pem: &str, credentials: Credentials<'_>) -> String {
    let user = match credentials {
        Credentials::Cert(pair) => format!(
            "    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&pair.cert_pem),
            b64(&pair.key_pem)
        ),
        Credentials::Token(token) => format!("    token: {token}\n"),
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: gpupool-sim\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: gpupool-sim\n  user:\n{user}contexts:\n- name: gpupool-sim\n  context:\n    cluster: gpupool-sim\n    user: gpupool-sim\n    namespace: default\ncurrent-context: gpupool-sim\npreferences: {{}}\n",
        ca = b64(ca_pem)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_certificates_name_user_and_groups_and_kubeconfigs_parse() {
        let ca = Ca::generate().expect("ca");
        let pair = ca
            .client("system:node:node-1", &["system:nodes"])
            .expect("client cert");
        assert!(pair.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        let text = kubeconfig(
            "https://127.0.0.1:6443",
            &ca.pair.cert_pem,
            Credentials::Cert(&pair),
        );
        let parsed = kube::config::Kubeconfig::from_yaml(&text).expect("kubeconfig parses");
        let auth = parsed.auth_infos[0].auth_info.as_ref().expect("user");
        assert!(auth.client_certificate_data.is_some() && auth.client_key_data.is_some());
        let text = kubeconfig(
            "https://127.0.0.1:6443",
            &ca.pair.cert_pem,
            Credentials::Token("t"),
        );
        assert!(text.contains("token: t"));
        assert!(
            ca.serving(&["198.18.0.1".to_owned()])
                .expect("serving")
                .cert_pem
                .contains("CERTIFICATE")
        );
        let (private, public) = service_account_key().expect("key");
        assert!(private.contains("PRIVATE KEY") && public.contains("PUBLIC KEY"));
        assert!(
            ca.kubelet_serving("node-1", "198.18.0.10")
                .expect("kubelet serving")
                .cert_pem
                .contains("CERTIFICATE")
        );
    }
}
