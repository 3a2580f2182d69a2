//! Fault injection: failing a fraction of requests, added latency and
//! dropping every watch stream. All off by default; the random choices come
//! from a seeded generator so a run can be repeated.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{ApiError, Reason};
use crate::util::SplitMix;

/// What to inject. The default injects nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FaultConfig {
    /// Fraction (0..=1) of API requests that fail.
    pub error_rate: f64,
    /// The status failed requests get: 500, 429 or 409.
    pub error_code: u16,
    /// Latency added to every API request, in milliseconds.
    pub latency_ms: u64,
    /// Whether watch requests may fail too (their start is refused).
    pub include_watches: bool,
    /// The next this many requests fail, whatever `error_rate` says; each
    /// one that fails counts it down. Lets a test fail exactly the request
    /// it means to.
    pub fail_next: u32,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            error_rate: 0.0,
            error_code: 500,
            latency_ms: 0,
            include_watches: false,
            fail_next: 0,
        }
    }
}

impl FaultConfig {
    /// Checks the values, naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.error_rate) {
            return Err(format!(
                "errorRate must be between 0 and 1, got {}",
                self.error_rate
            ));
        }
        if ![500, 429, 409].contains(&self.error_code) {
            return Err(format!(
                "errorCode must be 500, 429 or 409, got {}",
                self.error_code
            ));
        }
        Ok(())
    }
}

struct Inner {
    config: Mutex<FaultConfig>,
    rng: SplitMix,
    drops: tokio::sync::watch::Sender<u64>,
}

/// The fault controls of one server; cheap to clone.
#[derive(Clone)]
pub struct Faults {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults")
            .field("config", &self.config())
            .finish()
    }
}

impl Faults {
    /// No faults, with a seeded generator.
    pub fn new(seed: u64) -> Self {
        let (drops, _) = tokio::sync::watch::channel(0);
        Faults {
            inner: Arc::new(Inner {
                config: Mutex::new(FaultConfig::default()),
                rng: SplitMix::new(seed),
                drops,
            }),
        }
    }

    /// The current settings.
    pub fn config(&self) -> FaultConfig {
        self.inner
            .config
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the settings (rejecting invalid ones).
    pub fn set(&self, config: FaultConfig) -> Result<(), String> {
        config.validate()?;
        *self.inner.config.lock().unwrap_or_else(|p| p.into_inner()) = config;
        Ok(())
    }

    /// Turns every fault off.
    pub fn clear(&self) {
        *self.inner.config.lock().unwrap_or_else(|p| p.into_inner()) = FaultConfig::default();
    }

    /// Ends every open watch stream now (clients see the connection end and
    /// must re-watch).
    pub fn drop_watches(&self) {
        self.inner.drops.send_modify(|n| *n += 1);
    }

    /// Signals [`Self::drop_watches`].
    pub(crate) fn drop_signal(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.drops.subscribe()
    }

    /// Applies latency and decides whether this request fails.
    pub(crate) async fn before_request(&self, is_watch: bool) -> Result<(), ApiError> {
        let latency = self.config().latency_ms;
        if latency > 0 {
            tokio::time::sleep(Duration::from_millis(latency)).await;
        }
        let code = {
            let mut cfg = self.inner.config.lock().unwrap_or_else(|p| p.into_inner());
            if is_watch && !cfg.include_watches {
                return Ok(());
            }
            if cfg.fail_next > 0 {
                cfg.fail_next -= 1;
            } else if cfg.error_rate <= 0.0 || self.inner.rng.next_f64() >= cfg.error_rate {
                return Ok(());
            }
            cfg.error_code
        };
        let msg = "fault injected by the simulated API server";
        Err(match code {
            429 => ApiError {
                reason: Reason::TooManyRequests,
                message: format!("{msg}: too many requests, please try again later"),
                details: Some(serde_json::json!({"retryAfterSeconds": 1})),
                code: None,
            },
            409 => ApiError::new(
                Reason::Conflict,
                format!(
                    "{msg}: the object has been modified; please apply your changes to the latest version and try again"
                ),
            ),
            _ => ApiError::internal(format!("{msg}: internal error")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn off_by_default_and_rate_one_always_fails() {
        let f = Faults::new(3);
        assert!(f.before_request(false).await.is_ok());
        f.set(FaultConfig {
            error_rate: 1.0,
            error_code: 429,
            ..Default::default()
        })
        .expect("valid");
        let e = f.before_request(false).await.expect_err("fails");
        assert_eq!(e.http_code(), 429);
        assert!(
            f.before_request(true).await.is_ok(),
            "watches spared by default"
        );
        f.clear();
        assert!(f.before_request(false).await.is_ok());
    }

    #[tokio::test]
    async fn the_next_requests_fail_as_many_as_asked() {
        let f = Faults::new(5);
        f.set(FaultConfig {
            fail_next: 2,
            error_code: 409,
            ..Default::default()
        })
        .expect("valid");
        assert!(f.before_request(true).await.is_ok(), "watches spared");
        for _ in 0..2 {
            let e = f.before_request(false).await.expect_err("fails");
            assert_eq!(e.http_code(), 409);
        }
        assert_eq!(f.config().fail_next, 0, "counted down");
        assert!(f.before_request(false).await.is_ok());
    }

    #[test]
    fn invalid_settings_are_named() {
        let f = Faults::new(1);
        let err = f
            .set(FaultConfig {
                error_code: 418,
                ..Default::default()
            })
            .expect_err("bad code");
        assert!(err.contains("errorCode"));
        let err = f
            .set(FaultConfig {
                error_rate: 2.0,
                ..Default::default()
            })
            .expect_err("bad rate");
        assert!(err.contains("errorRate"));
    }

    #[test]
    fn seeded_rate_is_roughly_honoured() {
        let f = Faults::new(42);
        let n = (0..10_000).filter(|_| f.inner.rng.next_f64() < 0.3).count();
        assert!((2_700..3_300).contains(&n), "{n}");
    }
}
