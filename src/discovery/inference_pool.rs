//! Discovery from the Gateway API Inference Extension's `InferencePool`
//! (`inference.networking.k8s.io/v1`): the pool object names its pods by a label selector
//! (`spec.selector.matchLabels`) and the ports they serve on (`spec.targetPorts`, one per
//! data-parallel rank), so operators who already describe their model servers that way point
//! Sluice at the same object. One backend per pod and port.
//!
//! Two watches, with `kube`'s watcher (list, then watch from the list's `resourceVersion`,
//! relist on a lost or expired watch, back off on errors): the InferencePool itself (by name),
//! and the pods its selector picks, started again whenever the selector or the ports change.
//! A pod that is `Ready` and not being deleted takes requests; one being deleted
//! (`deletionTimestamp`) or not ready is drained; one that is gone leaves once nothing runs on
//! it. Changes are debounced as the EndpointSlice source does. The object is read as JSON
//! (`DynamicObject`): k8s-openapi has no type for it, and the few fields read here are stable
//! in v1. A stalled API server is bounded by the client's read timeout (75 s: past a watch's
//! end), not by the EndpointSlice source's shorter list bound.

use super::kubernetes::{made_client, WATCH_SECONDS};
use super::{apply, report_error, report_recovery, Listed};
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use sluice_sdk::{Pool, Wanted};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The source's name in logs and metrics.
const KIND: &str = "inference_pool";

/// `pools[].discovery.inference_pool`.
#[derive(Debug, Clone, PartialEq)]
pub struct InferencePoolSource {
    /// The InferencePool's name.
    pub name: String,
    /// `None`: the namespace of the credentials (in-cluster: Sluice's own).
    pub namespace: Option<String>,
    /// `None`: `$KUBECONFIG`, `~/.kube/config`, or the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    pub debounce: Duration,
}

/// What of an InferencePool says which backends it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// `k=v,k=v`, as a list's `labelSelector`.
    pub selector: String,
    pub ports: Vec<u16>,
}

/// The most `targetPorts` the v1 API allows.
const MAX_TARGET_PORTS: usize = 8;

fn inference_pools() -> ApiResource {
    ApiResource {
        group: "inference.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "inference.networking.k8s.io/v1".into(),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
    }
}

/// The selector and ports of an InferencePool object, or why they cannot be used.
pub fn spec_of(object: &serde_json::Value) -> Result<PoolSpec, String> {
    let spec = &object["spec"];
    let labels = spec["selector"]["matchLabels"]
        .as_object()
        .filter(|m| !m.is_empty())
        .ok_or("its spec.selector.matchLabels is missing or empty")?;
    let mut selector = Vec::with_capacity(labels.len());
    for (key, value) in labels {
        let value = value
            .as_str()
            .ok_or_else(|| format!("the label `{key}` of its selector is not a string"))?;
        // As the API server checks labels: a selector made of anything else would be refused
        // (or, worse, read as another selector).
        let fine = |text: &str, extra: &[char], max: usize| {
            text.len() <= max
                && text.chars().all(|c| {
                    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') || extra.contains(&c)
                })
        };
        if key.is_empty() || !fine(key, &['/'], 317) || !fine(value, &[], 63) {
            return Err(format!(
                "its selector's label `{key}: {value}` is not a label"
            ));
        }
        selector.push(format!("{key}={value}"));
    }
    let ports: Vec<u16> = spec["targetPorts"]
        .as_array()
        .map(|ports| {
            ports
                .iter()
                .filter_map(|p| p["number"].as_u64())
                .filter_map(|n| u16::try_from(n).ok())
                .filter(|n| *n > 0)
                .collect()
        })
        .unwrap_or_default();
    if ports.is_empty() || ports.len() > MAX_TARGET_PORTS {
        return Err(format!(
            "its spec.targetPorts must list 1 to {MAX_TARGET_PORTS} port numbers"
        ));
    }
    Ok(PoolSpec {
        selector: selector.join(","),
        ports,
    })
}

/// The backends one pod gives at `ports`: ready, draining (not ready, or being deleted), or
/// none (no IP yet, or finished).
pub fn pod_backends(pod: &Pod, ports: &[u16]) -> Vec<Wanted> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return Vec::new();
    }
    let Some(ip) = status
        .pod_ip
        .as_deref()
        .and_then(|ip| ip.parse::<IpAddr>().ok())
    else {
        return Vec::new();
    };
    let deleting = pod.metadata.deletion_timestamp.is_some();
    let ready = !deleting
        && status
            .conditions
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
    ports
        .iter()
        .map(|port| Wanted::discovered(SocketAddr::new(ip, *port), ready))
        .collect()
}

fn watch_of<K>(
    api: &Api<K>,
    config: watcher::Config,
) -> BoxStream<'static, watcher::Result<Event<K>>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    watcher::watcher(api.clone(), config.timeout(WATCH_SECONDS))
        .default_backoff()
        .boxed()
}

/// Follows `source` for `pool`, for ever (until the service aborts it).
pub async fn follow(pool: Arc<Pool>, source: InferencePoolSource) {
    let mut streak = None;
    let client = made_client(&pool, KIND, source.kubeconfig.as_deref(), &mut streak).await;
    let (pools, pods) = apis(client, source.namespace.as_deref());
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", source.name));
    let mut pool_events = watcher::watcher(pools, by_name.timeout(WATCH_SECONDS))
        .default_backoff()
        .boxed();
    let mut spec: Option<PoolSpec> = None;
    // Whether a list of the pool object (the watcher's start, or a relist) found it.
    let mut pool_listed = false;
    let mut pod_events: Option<BoxStream<'static, watcher::Result<Event<Pod>>>> = None;
    let mut pods_seen = Listed::default();
    loop {
        let apply_at = pods_seen.apply_at;
        let debounce_end = async {
            match apply_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let next_pod = async {
            match pod_events.as_mut() {
                Some(events) => events.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = debounce_end => {
                apply(&pool, KIND, &pods_seen.take_wanted());
            }
            event = pool_events.next() => {
                let Some(event) = event else { return };
                let Some(next) =
                    spec_event(event, &mut pool_listed, &pool, &source.name, &mut streak)
                else {
                    continue;
                };
                if next == spec {
                    continue;
                }
                spec = next;
                // Its pods change with its selector or ports: watch them anew. What it had
                // stays until the new list is whole (a list that fails empties nothing); the
                // object gone, its backends go.
                pods_seen.abandon_relist();
                pod_events = spec.as_ref().map(|s| {
                    watch_of(&pods, watcher::Config::default().labels(&s.selector))
                });
                if spec.is_none() {
                    pods_seen.clear(source.debounce);
                }
            }
            event = next_pod => {
                let Some(event) = event else {
                    pod_events = None;
                    continue;
                };
                match event {
                    Ok(event) => {
                        report_recovery(&pool, KIND, &mut streak);
                        let ports = spec.as_ref().map_or(&[][..], |s| &s.ports[..]);
                        take_pod_event(event, &mut pods_seen, ports, source.debounce);
                    }
                    Err(e) => report_error(&pool, KIND, &e.to_string(), &mut streak),
                }
            }
        }
    }
}

/// What an event of the InferencePool object's watch says of its spec: `Some(None)`, it is
/// gone; `Some(Some(spec))`, its spec now; `None`, nothing new (a list's start, an error, or
/// a spec that cannot be read: what the pool had is kept, so a bad edit empties nothing).
/// `listed` is whether the list under way found the object.
fn spec_event(
    event: watcher::Result<Event<DynamicObject>>,
    listed: &mut bool,
    pool: &Pool,
    name: &str,
    streak: &mut Option<String>,
) -> Option<Option<PoolSpec>> {
    let object = match event {
        Ok(Event::Init) => {
            *listed = false;
            return None;
        }
        Ok(Event::InitApply(o)) => {
            *listed = true;
            Some(o)
        }
        Ok(Event::Apply(o)) => Some(o),
        Ok(Event::Delete(_)) => None,
        // A relist without it: deleted while the watch was away.
        Ok(Event::InitDone) if !*listed => None,
        Ok(Event::InitDone) => return None,
        Err(e) => {
            report_error(pool, KIND, &e.to_string(), streak);
            return None;
        }
    };
    report_recovery(pool, KIND, streak);
    let Some(o) = object else {
        return Some(None);
    };
    match spec_of(&serde_json::json!({"spec": o.data.get("spec")})) {
        Ok(spec) => Some(Some(spec)),
        Err(e) => {
            let e = format!("the InferencePool `{name}`: {e}");
            report_error(pool, KIND, &e, streak);
            None
        }
    }
}

/// The InferencePools' and the pods' APIs, in `namespace` (else the client's default).
fn apis(client: Client, namespace: Option<&str>) -> (Api<DynamicObject>, Api<Pod>) {
    let resource = inference_pools();
    match namespace {
        Some(ns) => (
            Api::namespaced_with(client.clone(), ns, &resource),
            Api::namespaced(client, ns),
        ),
        None => (
            Api::default_namespaced_with(client.clone(), &resource),
            Api::default_namespaced(client),
        ),
    }
}

/// Takes one event of the pool's pods' watch into `pods_seen`; `ports` are the pool's
/// target ports.
fn take_pod_event(event: Event<Pod>, pods_seen: &mut Listed, ports: &[u16], debounce: Duration) {
    match event {
        Event::Init => pods_seen.relist(),
        Event::InitApply(pod) => pods_seen.listed(name_of(&pod), pod_backends(&pod, ports)),
        Event::InitDone => pods_seen.relisted(debounce),
        Event::Apply(pod) => pods_seen.insert(name_of(&pod), pod_backends(&pod, ports), debounce),
        Event::Delete(pod) => pods_seen.remove(&name_of(&pod), debounce),
    }
}

fn name_of(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_pools_selector_and_ports_are_read_and_checked() {
        let object = json!({"spec": {"selector": {"matchLabels": {"app": "vllm", "model": "llama"}},
                                     "targetPorts": [{"number": 8000}, {"number": 8001}]}});
        let spec = spec_of(&object).unwrap();
        assert_eq!(spec.selector, "app=vllm,model=llama");
        assert_eq!(spec.ports, vec![8000, 8001]);
        let no_labels =
            json!({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}});
        assert!(spec_of(&no_labels).unwrap_err().contains("matchLabels"));
        let odd = json!({"spec": {"selector": {"matchLabels": {"app": "x,y=z"}}, "targetPorts": [{"number": 8000}]}});
        assert!(spec_of(&odd).unwrap_err().contains("not a label"));
        let no_ports =
            json!({"spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []}});
        assert!(spec_of(&no_ports).unwrap_err().contains("targetPorts"));
    }

    #[test]
    fn each_pod_gives_a_backend_per_port_ready_or_draining() {
        let pod = |ready: &str, deleting: bool, ip: Option<&str>| -> Pod {
            let mut v = json!({
                "metadata": {"name": "p"},
                "status": {"phase": "Running",
                           "conditions": [{"type": "Ready", "status": ready}]},
            });
            if let Some(ip) = ip {
                v["status"]["podIP"] = json!(ip);
            }
            if deleting {
                v["metadata"]["deletionTimestamp"] = json!("2026-11-29T10:00:00Z");
            }
            serde_json::from_value(v).unwrap()
        };
        let got = |p: &Pod| -> Vec<(String, bool)> {
            pod_backends(p, &[8000, 8001])
                .into_iter()
                .map(|w| (w.spec.address, w.ready))
                .collect()
        };
        assert_eq!(
            got(&pod("True", false, Some("10.0.0.1"))),
            vec![
                ("10.0.0.1:8000".into(), true),
                ("10.0.0.1:8001".into(), true)
            ]
        );
        assert!(got(&pod("True", true, Some("10.0.0.1")))
            .iter()
            .all(|(_, r)| !r));
        assert!(got(&pod("False", false, Some("10.0.0.1")))
            .iter()
            .all(|(_, r)| !r));
        assert!(got(&pod("True", false, None)).is_empty(), "no IP yet");
    }
}
