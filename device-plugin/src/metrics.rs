//! Prometheus metrics and the `/metrics` + `/healthz` HTTP endpoint.

use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::slots::{HEALTHY, SlotTable, UNHEALTHY};

/// Label set of the per-health device gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthLabel {
    /// `Healthy` or `Unhealthy`.
    pub health: &'static str,
}

/// Label set of counters split by outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok` or `error`.
    pub result: &'static str,
}

/// Label set of the report-error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReportLabel {
    /// What failed: `podresources`, `client`, `lease` or `node`.
    pub target: &'static str,
}

/// The plugin's metrics. Cheap to clone; every clone updates the same series.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    devices: Family<HealthLabel, Gauge>,
    gpus: Family<HealthLabel, Gauge>,
    allocations_ok: Counter,
    allocations_failed: Counter,
    registrations: Family<ResultLabel, Counter>,
    report_errors: Family<ReportLabel, Counter>,
    reports: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every series.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpupool_device_plugin");
        let devices = Family::<HealthLabel, Gauge>::default();
        let gpus = Family::<HealthLabel, Gauge>::default();
        let allocations = Family::<ResultLabel, Counter>::default();
        let registrations = Family::<ResultLabel, Counter>::default();
        let report_errors = Family::<ReportLabel, Counter>::default();
        let reports = Counter::default();
        registry.register(
            "devices",
            "Advertised slots (kubelet devices) by health",
            devices.clone(),
        );
        registry.register("gpus", "Discovered GPUs by health", gpus.clone());
        registry.register(
            "allocations",
            "Allocate calls answered, by result",
            allocations.clone(),
        );
        registry.register(
            "registrations",
            "Registration attempts with the kubelet, by result",
            registrations.clone(),
        );
        registry.register(
            "report_errors",
            "Failed reports to PodResources or the API server, by target",
            report_errors.clone(),
        );
        registry.register(
            "lease_reports",
            "GpuLease status patches written",
            reports.clone(),
        );
        // Both health series exist from the start, so a dashboard sees 0, not nothing.
        for health in [HEALTHY, UNHEALTHY] {
            devices.get_or_create(&HealthLabel { health }).set(0);
            gpus.get_or_create(&HealthLabel { health }).set(0);
        }
        // Allocate is on the kubelet's critical path: its counters are
        // resolved once here, so a call only bumps an atomic.
        let allocations_ok = allocations
            .get_or_create(&ResultLabel { result: "ok" })
            .clone();
        let allocations_failed = allocations
            .get_or_create(&ResultLabel { result: "error" })
            .clone();
        Metrics {
            registry: Arc::new(registry),
            devices,
            gpus,
            allocations_ok,
            allocations_failed,
            registrations,
            report_errors,
            reports,
        }
    }

    /// Sets the device and GPU gauges from `table`.
    pub fn observe_table(&self, table: &SlotTable) {
        let healthy_gpus = table.gpus().iter().filter(|g| g.node.healthy).count();
        let unhealthy_gpus = table.gpus().len() - healthy_gpus;
        let per_gpu = i64::from(table.sessions_per_gpu());
        for (health, count) in [(HEALTHY, healthy_gpus), (UNHEALTHY, unhealthy_gpus)] {
            let count = i64::try_from(count).unwrap_or(i64::MAX);
            self.gpus.get_or_create(&HealthLabel { health }).set(count);
            self.devices
                .get_or_create(&HealthLabel { health })
                .set(count.saturating_mul(per_gpu));
        }
    }

    /// Counts one Allocate call.
    pub fn allocation(&self, ok: bool) {
        if ok {
            self.allocations_ok.inc();
        } else {
            self.allocations_failed.inc();
        }
    }

    /// Counts one registration attempt.
    pub fn registration(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.registrations
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Counts one failed report.
    pub fn report_error(&self, target: &'static str) {
        self.report_errors
            .get_or_create(&ReportLabel { target })
            .inc();
    }

    /// Counts one lease status patch.
    pub fn lease_reported(&self) {
        self.reports.inc();
    }

    /// The metrics in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        text
    }
}

/// Serves `/metrics` and `/healthz` on `listener` until `shutdown` fires,
/// within [`gpupool_http_endpoint::Limits::default`], so no peer can run
/// the plugin out of memory or file descriptors through this port.
pub async fn serve(listener: TcpListener, metrics: Metrics, shutdown: CancellationToken) {
    gpupool_http_endpoint::serve(
        listener,
        gpupool_http_endpoint::Limits::default(),
        move |request: &Request<Incoming>| respond(&metrics, request),
        shutdown.cancelled_owned(),
    )
    .await;
}

/// Binds the metrics endpoint.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

fn respond(metrics: &Metrics, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        (&Method::GET, "/healthz") => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics or /healthz\n".to_owned(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Gpu;
    use gpupool_api::NodeGpu;

    #[test]
    fn encodes_devices_by_health_and_counters() {
        let metrics = Metrics::new();
        let gpus = [true, false, true]
            .into_iter()
            .enumerate()
            .map(|(i, healthy)| {
                Gpu::from(NodeGpu {
                    index: i as u32,
                    uuid: format!("GPU-{i}"),
                    product: String::new(),
                    vendor: String::new(),
                    memory_mib: 0,
                    healthy,
                })
            });
        metrics.observe_table(&SlotTable::new(gpus.collect(), 2));
        metrics.allocation(true);
        metrics.allocation(true);
        metrics.registration(false);
        metrics.report_error("node");
        let text = metrics.encode();
        for line in [
            r#"gpupool_device_plugin_devices{health="Healthy"} 4"#,
            r#"gpupool_device_plugin_devices{health="Unhealthy"} 2"#,
            r#"gpupool_device_plugin_gpus{health="Unhealthy"} 1"#,
            r#"gpupool_device_plugin_allocations_total{result="ok"} 2"#,
            r#"gpupool_device_plugin_allocations_total{result="error"} 0"#,
            r#"gpupool_device_plugin_registrations_total{result="error"} 1"#,
            r#"gpupool_device_plugin_report_errors_total{target="node"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
