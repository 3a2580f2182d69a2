use super::*;

fn now() -> Timestamp {
    Timestamp::from_second(1_790_000_000).expect("valid time")
}

fn service_names() -> Vec<String> {
    vec![
        "gpupool-webhook.gpupool-system.svc".to_owned(),
        "gpupool-webhook.gpupool-system.svc.cluster.local".to_owned(),
    ]
}

fn days(n: i64) -> SignedDuration {
    SignedDuration::from_hours(24 * n)
}

#[test]
fn fresh_certificate_covers_its_names_past_the_renewal_margin() {
    let bundle = generate(&service_names(), now(), None).expect("generates");
    bundle
        .check(&service_names(), now() + RENEW_BEFORE)
        .expect("valid");
    assert!(bundle.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
    assert_eq!(
        CertificateDer::pem_slice_iter(bundle.ca_pem.as_bytes()).count(),
        1
    );
}

#[test]
fn other_names_are_not_covered() {
    let bundle = generate(&service_names(), now(), None).expect("generates");
    let wanted = vec!["gpupool-webhook.other.svc".to_owned()];
    let problem = bundle.check(&wanted, now()).expect_err("other name");
    assert!(
        matches!(&problem, CertProblem::NotValid { name, .. } if name == "gpupool-webhook.other.svc"),
        "{problem}"
    );
    assert!(
        problem.to_string().contains("gpupool-webhook.other.svc"),
        "{problem}"
    );
}

#[test]
fn ip_address_names_become_ip_sans() {
    let names = vec!["127.0.0.1".to_owned()];
    let bundle = generate(&names, now(), None).expect("generates");
    bundle.check(&names, now()).expect("valid for the IP");
    let problem = bundle
        .check(&["127.0.0.2".to_owned()], now())
        .expect_err("another IP");
    assert!(matches!(problem, CertProblem::NotValid { .. }), "{problem}");
}

#[test]
fn certificate_expiring_within_the_margin_needs_renewal() {
    let issued = now() - VALIDITY + days(10);
    let bundle = generate(&service_names(), issued, None).expect("generates");
    bundle
        .check(&service_names(), now())
        .expect("still valid today");
    let problem = bundle
        .check(&service_names(), now() + RENEW_BEFORE)
        .expect_err("expires within the margin");
    assert!(
        problem.to_string().to_lowercase().contains("expired"),
        "{problem}"
    );
}

#[test]
fn certificate_not_yet_valid_is_refused() {
    let bundle = generate(&service_names(), now() + days(30), None).expect("generates");
    let problem = bundle
        .check(&service_names(), now())
        .expect_err("not yet valid");
    assert!(matches!(problem, CertProblem::NotValid { .. }), "{problem}");
}

#[test]
fn key_of_another_certificate_is_refused() {
    let a = generate(&service_names(), now(), None).expect("generates");
    let b = generate(&service_names(), now(), None).expect("generates");
    let mixed = TlsBundle {
        key_pem: b.key_pem,
        ..a
    };
    let problem = mixed.check(&service_names(), now()).expect_err("mismatch");
    assert!(matches!(problem, CertProblem::KeyMismatch(_)), "{problem}");
}

#[test]
fn certificate_from_another_ca_is_refused() {
    let a = generate(&service_names(), now(), None).expect("generates");
    let b = generate(&service_names(), now(), None).expect("generates");
    let foreign = TlsBundle {
        ca_pem: b.ca_pem,
        ..a
    };
    let problem = foreign
        .check(&service_names(), now())
        .expect_err("unknown issuer");
    assert!(matches!(problem, CertProblem::NotValid { .. }), "{problem}");
}

#[test]
fn renewal_keeps_the_previous_ca_in_the_bundle() {
    let old = generate(&service_names(), now(), None).expect("generates");
    let new = generate(&service_names(), now(), Some(&old.ca_pem)).expect("generates");
    assert_eq!(
        CertificateDer::pem_slice_iter(new.ca_pem.as_bytes()).count(),
        2
    );
    // A replica still serving the old certificate is trusted by the new bundle.
    let lagging = TlsBundle {
        ca_pem: new.ca_pem.clone(),
        ..old.clone()
    };
    lagging
        .check(&service_names(), now())
        .expect("old cert trusted");
    new.check(&service_names(), now())
        .expect("new cert trusted");
    // Only one previous CA is carried along, never a growing chain.
    let newer = generate(&service_names(), now(), Some(&new.ca_pem)).expect("generates");
    assert_eq!(
        CertificateDer::pem_slice_iter(newer.ca_pem.as_bytes()).count(),
        2
    );
    // An unreadable previous bundle is dropped rather than copied.
    let fresh = generate(&service_names(), now(), Some("junk")).expect("generates");
    assert_eq!(
        CertificateDer::pem_slice_iter(fresh.ca_pem.as_bytes()).count(),
        1
    );
}

#[test]
fn secret_round_trip() {
    let bundle = generate(&service_names(), now(), None).expect("generates");
    let secret = bundle.to_secret("gpupool-system", SECRET_NAME);
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    assert_eq!(secret.metadata.name.as_deref(), Some(SECRET_NAME));
    assert_eq!(secret.metadata.namespace.as_deref(), Some("gpupool-system"));
    let json = serde_json::to_value(&secret).expect("serializes");
    let back: Secret = serde_json::from_value(json).expect("deserializes");
    assert_eq!(TlsBundle::from_secret(&back).expect("reads"), bundle);
}

#[test]
fn incomplete_or_garbled_secrets_name_the_key() {
    let bundle = generate(&service_names(), now(), None).expect("generates");
    let mut secret = bundle.to_secret("ns", SECRET_NAME);
    secret.data.as_mut().expect("data").remove(KEY_PRIVATE_KEY);
    let problem = TlsBundle::from_secret(&secret).expect_err("missing key");
    assert_eq!(problem.to_string(), "tls.key is missing");

    let garbled = TlsBundle {
        ca_pem: "not a certificate".to_owned(),
        ..bundle.clone()
    };
    let problem = garbled.check(&service_names(), now()).expect_err("garbled");
    assert!(
        matches!(
            problem,
            CertProblem::Unreadable {
                key: KEY_CA_BUNDLE,
                ..
            }
        ),
        "{problem}"
    );

    let garbled = TlsBundle {
        key_pem: "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".to_owned(),
        ..bundle
    };
    let problem = garbled.certified_key().expect_err("garbled key");
    assert!(
        matches!(
            problem,
            CertProblem::Unreadable {
                key: KEY_PRIVATE_KEY,
                ..
            }
        ),
        "{problem}"
    );
}

#[test]
fn names_that_cannot_be_in_a_certificate_are_refused() {
    let err = generate(&["bad name!".to_owned()], now(), None).expect_err("bad name");
    assert!(err.to_string().contains("bad name!"), "{err}");
}
