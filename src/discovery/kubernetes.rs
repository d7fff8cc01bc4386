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

use super::{apply, report_error, report_recovery, Listed};
use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use sluice_sdk::{Pool, Wanted};
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
    let client = made_client(
        &pool,
        "kubernetes",
        source.kubeconfig.as_deref(),
        &mut streak,
    )
    .await;
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
    // The slices as last seen, and when they are next applied.
    let mut slices = Listed::default();
    let mut list_deadline = tokio::time::Instant::now() + LIST_TIMEOUT;
    loop {
        // The nearest of the debounce's end and the list's bound.
        let wake = match (slices.apply_at, listing) {
            (Some(at), true) => Some(at.min(list_deadline)),
            (at, false) => at,
            (None, true) => Some(list_deadline),
        };
        let next = match wake {
            Some(at) => match tokio::time::timeout_at(at, events.next()).await {
                Ok(next) => next,
                Err(_) if listing && tokio::time::Instant::now() >= list_deadline => {
                    let e =
                        format!("the API server did not answer the list within {LIST_TIMEOUT:?}");
                    report_error(&pool, "kubernetes", &e, &mut streak);
                    events = watch();
                    slices.abandon_relist();
                    list_deadline = tokio::time::Instant::now() + LIST_TIMEOUT;
                    continue;
                }
                Err(_) => {
                    apply(&pool, "kubernetes", &slices.take_wanted());
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
                if let Some(listing_now) = take_slice_event(event, &mut slices, &pool, &source) {
                    listing = listing_now;
                    if listing {
                        list_deadline = tokio::time::Instant::now() + LIST_TIMEOUT;
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

/// Takes one event of the EndpointSlices' watch into `slices`; whether a list is under way
/// from now, when the event says (its start or its end).
fn take_slice_event(
    event: Event<EndpointSlice>,
    slices: &mut Listed,
    pool: &Pool,
    source: &KubernetesSource,
) -> Option<bool> {
    match event {
        Event::Init => {
            slices.relist();
            return Some(true);
        }
        Event::InitApply(slice) => {
            slices.listed(slice_name(&slice), wanted(pool, source, &slice));
        }
        Event::InitDone => {
            slices.relisted(source.debounce);
            return Some(false);
        }
        Event::Apply(slice) => slices.insert(
            slice_name(&slice),
            wanted(pool, source, &slice),
            source.debounce,
        ),
        Event::Delete(slice) => slices.remove(&slice_name(&slice), source.debounce),
    }
    None
}

/// A client (see [`client`]), tried again with a growing pause, the errors reported under
/// `kind`, until one is made.
pub(super) async fn made_client(
    pool: &Pool,
    kind: &'static str,
    kubeconfig: Option<&std::path::Path>,
    streak: &mut Option<String>,
) -> Client {
    let mut retry = Duration::from_secs(1);
    loop {
        match client(kubeconfig).await {
            Ok(client) => return client,
            Err(e) => {
                report_error(pool, kind, &e, streak);
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(CLIENT_RETRY_MAX);
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
