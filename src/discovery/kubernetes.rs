//! Kubernetes discovery: a watch of a Service's `discovery.k8s.io/v1` EndpointSlices (label
//! `kubernetes.io/service-name`), as kube-proxy, Envoy's control planes and llm-d follow pods.
//! `kube`'s watcher lists, then watches from the list's `resourceVersion`, relists when the
//! watch is lost or expired (410 Gone), and backs off on errors (0.8 s doubling to 30 s).
//!
//! An endpoint that is `ready` takes requests; one that is `serving` or `terminating` but not
//! ready is drained (no new request, running streams finish); one that is gone leaves once
//! nothing runs on it. Changes are debounced (`debounce`), so a rollout's burst of events is
//! applied as one update.
//!
//! Every call is bounded: an API server (or a balancer in front of one) that accepts and never
//! answers would otherwise freeze the pool's membership for good. A list must end within
//! [`LIST_TIMEOUT`], else the watcher starts over (counted); a watch is asked to end after
//! [`WATCH_SECONDS`] (the server closes it, the watcher resumes it), so no read of a healthy
//! server waits longer than that, and the client's read timeout ([`READ_TIMEOUT`]) ends one
//! that does: a watch whose start is never answered among them.

use super::{apply, report_error, report_recovery};
use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use sluice_sdk::{Pool, Wanted};
use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// `pools[].discovery.kubernetes`.
#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesSource {
    pub service: String,
    /// `None`: the namespace of the credentials (in-cluster: Sluice's own).
    pub namespace: Option<String>,
    pub port: PortRef,
    /// `None`: `$KUBECONFIG`, `~/.kube/config`, or the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    pub debounce: Duration,
}

/// The backends' port: by number, or by the name the slices give it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRef {
    Number(u16),
    Name(String),
}

impl fmt::Display for PortRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortRef::Number(n) => write!(f, "{n}"),
            PortRef::Name(name) => f.write_str(name),
        }
    }
}

/// The longest wait before trying again to build a client that could not be built.
const CLIENT_RETRY_MAX: Duration = Duration::from_secs(30);

/// How long a list (all of its pages) may take before the watcher starts over.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the server keeps one watch open (its `timeoutSeconds`).
pub(super) const WATCH_SECONDS: u32 = 60;

/// The longest silence on a connection: past a watch's end, with a margin.
const READ_TIMEOUT: Duration = Duration::from_secs(WATCH_SECONDS as u64 + 15);

/// A client from `kubeconfig`, else from the environment (`$KUBECONFIG`, `~/.kube/config`,
/// in-cluster), whose reads end after [`READ_TIMEOUT`].
pub(super) async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, String> {
    let mut config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("cannot read the kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| format!("the kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| format!("no Kubernetes credentials (in-cluster or kubeconfig): {e}"))?,
    };
    config.read_timeout = Some(READ_TIMEOUT);
    Client::try_from(config).map_err(|e| format!("cannot build the Kubernetes client: {e}"))
}

/// Follows `source` for `pool`, for ever (until the service aborts it).
pub async fn follow(pool: Arc<Pool>, source: KubernetesSource) {
    let mut streak = None;
    let mut retry = Duration::from_secs(1);
    let client = loop {
        match client(source.kubeconfig.as_deref()).await {
            Ok(client) => break client,
            Err(e) => {
                report_error(&pool, "kubernetes", &e, &mut streak);
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(CLIENT_RETRY_MAX);
            }
        }
    };
    let api: Api<EndpointSlice> = match &source.namespace {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::default_namespaced(client),
    };
    let selector = format!("kubernetes.io/service-name={}", source.service);
    let watch = || {
        let config = watcher::Config::default()
            .labels(&selector)
            .timeout(WATCH_SECONDS);
        watcher::watcher(api.clone(), config)
            .default_backoff()
            .boxed()
    };
    let mut events = watch();
    // Whether a list is under way (the watcher's start, or a relist): it is bounded.
    let mut listing = true;
    // The slices as last seen, by name; a relist builds the next set aside until it is whole.
    let mut slices: BTreeMap<String, Vec<Wanted>> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<String, Vec<Wanted>>> = None;
    // When the changes seen since the last update are applied: a debounce window that
    // starts with the first of them (a steady trickle of events cannot hold it off).
    let mut apply_at: Option<tokio::time::Instant> = None;
    let mut list_deadline = tokio::time::Instant::now() + LIST_TIMEOUT;
    loop {
        // The nearest of the debounce's end and the list's bound.
        let wake = match (apply_at, listing) {
            (Some(at), true) => Some(at.min(list_deadline)),
            (Some(at), false) => Some(at),
            (None, true) => Some(list_deadline),
            (None, false) => None,
        };
        let next = match wake {
            Some(at) => match tokio::time::timeout_at(at, events.next()).await {
                Ok(next) => next,
                Err(_) if listing && tokio::time::Instant::now() >= list_deadline => {
                    let e =
                        format!("the API server did not answer the list within {LIST_TIMEOUT:?}");
                    report_error(&pool, "kubernetes", &e, &mut streak);
                    events = watch();
                    relisting = None;
                    list_deadline = tokio::time::Instant::now() + LIST_TIMEOUT;
                    continue;
                }
                Err(_) => {
                    apply_at = None;
                    let wanted: Vec<Wanted> = slices.values().flatten().cloned().collect();
                    apply(&pool, "kubernetes", &wanted);
                    continue;
                }
            },
            None => events.next().await,
        };
        let Some(event) = next else {
            return; // The watcher never ends by itself.
        };
        match event {
            Ok(event) => {
                report_recovery(&pool, "kubernetes", &mut streak);
                match event {
                    Event::Init => {
                        relisting = Some(BTreeMap::new());
                        listing = true;
                        list_deadline = tokio::time::Instant::now() + LIST_TIMEOUT;
                    }
                    Event::InitApply(slice) => {
                        if let Some(next) = relisting.as_mut() {
                            next.insert(slice_name(&slice), wanted(&pool, &source, &slice));
                        }
                    }
                    Event::InitDone => {
                        listing = false;
                        if let Some(next) = relisting.take() {
                            slices = next;
                            apply_at.get_or_insert_with(|| {
                                tokio::time::Instant::now() + source.debounce
                            });
                        }
                    }
                    Event::Apply(slice) => {
                        slices.insert(slice_name(&slice), wanted(&pool, &source, &slice));
                        apply_at
                            .get_or_insert_with(|| tokio::time::Instant::now() + source.debounce);
                    }
                    Event::Delete(slice) => {
                        slices.remove(&slice_name(&slice));
                        apply_at
                            .get_or_insert_with(|| tokio::time::Instant::now() + source.debounce);
                    }
                }
            }
            Err(e) => {
                report_error(&pool, "kubernetes", &e.to_string(), &mut streak);
                // The watcher backs off (up to 30 s) before it lists again: its answer is
                // bounded from then.
                if listing {
                    list_deadline =
                        tokio::time::Instant::now() + LIST_TIMEOUT + Duration::from_secs(30);
                }
            }
        }
    }
}

fn slice_name(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// The backends one slice lists: its endpoints' addresses at the source's port, ready or
/// draining. A slice without the port lists none (and says so).
///
/// Public for the property tests of what discovery does with an API server's answers
/// (`tests/discovery_answers.rs`); only [`follow`] uses it.
pub fn wanted(pool: &Pool, source: &KubernetesSource, slice: &EndpointSlice) -> Vec<Wanted> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = match &source.port {
        PortRef::Number(n) => Some(*n),
        PortRef::Name(name) => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0),
    };
    let Some(port) = port else {
        tracing::warn!(
            pool = &*pool.name,
            slice = slice_name(slice),
            "the EndpointSlice has no port named `{}`; its endpoints are left out",
            source.port
        );
        return Vec::new();
    };
    let mut out = Vec::new();
    for endpoint in &slice.endpoints {
        let conditions = endpoint.conditions.as_ref();
        // As the API says: an unset `ready` means ready, an unset `terminating` means not.
        let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
        let ready = conditions.and_then(|c| c.ready).unwrap_or(true) && !terminating;
        for address in &endpoint.addresses {
            let Ok(ip) = address.parse::<IpAddr>() else {
                continue; // An FQDN slice: not an address Sluice connects to per pod.
            };
            out.push(Wanted::discovered(SocketAddr::new(ip, port), ready));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn slice(endpoints: Vec<(&str, Option<bool>, Option<bool>)>) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: endpoints
                .into_iter()
                .map(|(ip, ready, terminating)| Endpoint {
                    addresses: vec![ip.into()],
                    conditions: Some(EndpointConditions {
                        ready,
                        serving: Some(true),
                        terminating,
                    }),
                    ..Endpoint::default()
                })
                .collect(),
            ports: Some(vec![EndpointPort {
                name: Some("http".into()),
                port: Some(8000),
                ..EndpointPort::default()
            }]),
            ..EndpointSlice::default()
        }
    }

    fn source(port: PortRef) -> KubernetesSource {
        KubernetesSource {
            service: "vllm".into(),
            namespace: None,
            port,
            kubeconfig: None,
            debounce: Duration::from_millis(10),
        }
    }

    #[test]
    fn ready_endpoints_take_requests_and_terminating_ones_drain() {
        let pool = Pool::new(sluice_sdk::PoolSettings::new("p", vec![], vec![]));
        let s = slice(vec![
            ("10.0.0.1", Some(true), None),
            ("10.0.0.2", Some(false), Some(true)),
            ("10.0.0.3", None, None),
        ]);
        let listed = wanted(&pool, &source(PortRef::Name("http".into())), &s);
        let got: Vec<(String, bool)> = listed
            .iter()
            .map(|w| (w.spec.address.clone(), w.ready))
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.1:8000".to_string(), true),
                ("10.0.0.2:8000".to_string(), false),
                ("10.0.0.3:8000".to_string(), true),
            ]
        );
        assert!(wanted(&pool, &source(PortRef::Name("grpc".into())), &s).is_empty());
        let by_number = wanted(&pool, &source(PortRef::Number(9000)), &s);
        assert_eq!(by_number[0].spec.resolved.port(), 9000);
    }
}
