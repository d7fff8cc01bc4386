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

use super::kubernetes::{client, WATCH_SECONDS};
use super::{apply, report_error, report_recovery};
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use sluice_sdk::{Pool, Wanted};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    const KIND: &str = "inference_pool";
    let mut streak = None;
    let mut retry = Duration::from_secs(1);
    let client: Client = loop {
        match client(source.kubeconfig.as_deref()).await {
            Ok(client) => break client,
            Err(e) => {
                report_error(&pool, KIND, &e, &mut streak);
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(Duration::from_secs(30));
            }
        }
    };
    let resource = inference_pools();
    let (pools, pods): (Api<DynamicObject>, Api<Pod>) = match &source.namespace {
        Some(ns) => (
            Api::namespaced_with(client.clone(), ns, &resource),
            Api::namespaced(client, ns),
        ),
        None => (
            Api::default_namespaced_with(client.clone(), &resource),
            Api::default_namespaced(client),
        ),
    };
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", source.name));
    let mut pool_events = watcher::watcher(pools, by_name.timeout(WATCH_SECONDS))
        .default_backoff()
        .boxed();
    let mut spec: Option<PoolSpec> = None;
    // Whether a list of the pool object (the watcher's start, or a relist) found it.
    let mut pool_listed = false;
    let mut pod_events: Option<BoxStream<'static, watcher::Result<Event<Pod>>>> = None;
    // The pods as last seen, by name; a relist builds the next set aside until it is whole.
    let mut listed: BTreeMap<String, Vec<Wanted>> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<String, Vec<Wanted>>> = None;
    let mut apply_at: Option<tokio::time::Instant> = None;
    loop {
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
                apply_at = None;
                let wanted: Vec<Wanted> = listed.values().flatten().cloned().collect();
                apply(&pool, KIND, &wanted);
            }
            event = pool_events.next() => {
                let Some(event) = event else { return };
                let object = match event {
                    Ok(Event::Init) => {
                        pool_listed = false;
                        continue;
                    }
                    Ok(Event::InitApply(o)) => {
                        pool_listed = true;
                        Some(o)
                    }
                    Ok(Event::Apply(o)) => Some(o),
                    Ok(Event::Delete(_)) => None,
                    // A relist without it: deleted while the watch was away.
                    Ok(Event::InitDone) if !pool_listed => None,
                    Ok(Event::InitDone) => continue,
                    Err(e) => {
                        report_error(&pool, KIND, &e.to_string(), &mut streak);
                        continue;
                    }
                };
                report_recovery(&pool, KIND, &mut streak);
                let next = match object {
                    Some(o) => match spec_of(&serde_json::json!({"spec": o.data.get("spec")})) {
                        Ok(next) => Some(next),
                        Err(e) => {
                            let e = format!("the InferencePool `{}`: {e}", source.name);
                            report_error(&pool, KIND, &e, &mut streak);
                            // What it had is kept: a bad edit does not empty the pool.
                            continue;
                        }
                    },
                    None => None,
                };
                if next == spec {
                    continue;
                }
                spec = next;
                // Its pods change with its selector or ports: watch them anew. What it had
                // stays until the new list is whole (a list that fails empties nothing); the
                // object gone, its backends go.
                relisting = None;
                pod_events = spec.as_ref().map(|s| {
                    watch_of(&pods, watcher::Config::default().labels(&s.selector))
                });
                if spec.is_none() {
                    listed.clear();
                    apply_at.get_or_insert_with(|| tokio::time::Instant::now() + source.debounce);
                }
            }
            event = next_pod => {
                let Some(event) = event else {
                    pod_events = None;
                    continue;
                };
                let ports = spec.as_ref().map(|s| s.ports.clone()).unwrap_or_default();
                match event {
                    Ok(event) => {
                        report_recovery(&pool, KIND, &mut streak);
                        match event {
                            Event::Init => relisting = Some(BTreeMap::new()),
                            Event::InitApply(pod) => {
                                if let Some(next) = relisting.as_mut() {
                                    next.insert(name_of(&pod), pod_backends(&pod, &ports));
                                }
                            }
                            Event::InitDone => {
                                if let Some(next) = relisting.take() {
                                    listed = next;
                                    apply_at.get_or_insert_with(|| {
                                        tokio::time::Instant::now() + source.debounce
                                    });
                                }
                            }
                            Event::Apply(pod) => {
                                listed.insert(name_of(&pod), pod_backends(&pod, &ports));
                                apply_at.get_or_insert_with(|| {
                                    tokio::time::Instant::now() + source.debounce
                                });
                            }
                            Event::Delete(pod) => {
                                listed.remove(&name_of(&pod));
                                apply_at.get_or_insert_with(|| {
                                    tokio::time::Instant::now() + source.debounce
                                });
                            }
                        }
                    }
                    Err(e) => report_error(&pool, KIND, &e.to_string(), &mut streak),
                }
            }
        }
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
