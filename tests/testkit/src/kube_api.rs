//! A fake Kubernetes API server for `discovery.k8s.io/v1` EndpointSlices, core `v1` Pods and
//! the Gateway API Inference Extension's `inference.networking.k8s.io/v1` InferencePools: the
//! list and watch protocol a real API server speaks, on a local port, scripted by the test.
//! Each kind has its paths (`/api/v1/namespaces/{ns}/pods`, ...); what follows is said of
//! EndpointSlices and holds for each.
//!
//! No real API server can run on a test machine, and no crate offers a scriptable fake that
//! speaks the watch protocol (kube-rs's own tests mock at the `tower` service layer, below
//! HTTP), so this one is written by hand, after the real server's behaviour:
//!
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` (and the cluster-wide
//!   `/apis/discovery.k8s.io/v1/endpointslices`) lists, filtered by `labelSelector` (`k=v`,
//!   `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, comma-joined) and
//!   `fieldSelector` (`metadata.name`, `metadata.namespace`), paged by `limit` and `continue`
//!   (a consistent snapshot, as etcd serves it; a continue token older than a [`compact`]
//!   gets `410 Expired`), at `resourceVersion` with `resourceVersionMatch` (`Exact` reads the
//!   past; older than a compaction is `410`). List items carry no `kind`/`apiVersion`, as the
//!   real server sends them.
//! - The same path with `watch=true` (or `watch=1`, or under `/apis/discovery.k8s.io/v1/watch/`)
//!   watches: `200`, then a chunked `application/json` stream of newline-separated events
//!   `{"type":"ADDED|MODIFIED|DELETED|BOOKMARK|ERROR","object":{...}}`. From a
//!   `resourceVersion` it replays the history after it; from none or `"0"` it first sends the
//!   current state as `ADDED` events; with `sendInitialEvents=true` (a streaming list) that,
//!   then a `BOOKMARK` annotated `k8s.io/initial-events-end`. A version older than a
//!   [`compact`] gets an `ERROR` event with a `410 Expired` Status, and the stream ends. A
//!   change that makes an object stop (start) matching the selector is sent as `DELETED`
//!   (`ADDED`), as the watch cache does. `timeoutSeconds` ends the stream cleanly.
//! - Every change takes the next value of one global `resourceVersion` counter.
//! - Errors are real `Status` objects (`{"kind":"Status","apiVersion":"v1",...,"code":403}`).
//! - Requests must carry the bearer token of [`FakeKubeApi::kubeconfig`], else `401`.
//!
//! [`compact`]: FakeKubeApi::compact

use base64::Engine as _;
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

/// The bearer token the kubeconfig carries and the server requires.
const TOKEN: &str = "sluice-fake-kube-token";
const GROUP_VERSION: &str = "discovery.k8s.io/v1";
const API_PREFIX: &str = "/apis/discovery.k8s.io/v1";

/// A kind of object the server serves.
#[derive(Debug, PartialEq, Eq)]
pub struct Resource {
    /// `discovery.k8s.io`; empty for the core group.
    group: &'static str,
    api_version: &'static str,
    /// Where its paths start: `/apis/<group>/<version>`, or `/api/v1` for the core group.
    prefix: &'static str,
    kind: &'static str,
    plural: &'static str,
}

/// `discovery.k8s.io/v1` EndpointSlices.
pub const ENDPOINT_SLICES: Resource = Resource {
    group: "discovery.k8s.io",
    api_version: GROUP_VERSION,
    prefix: API_PREFIX,
    kind: "EndpointSlice",
    plural: "endpointslices",
};

/// Core `v1` Pods.
pub const PODS: Resource = Resource {
    group: "",
    api_version: "v1",
    prefix: "/api/v1",
    kind: "Pod",
    plural: "pods",
};

/// The Gateway API Inference Extension's `inference.networking.k8s.io/v1` InferencePools.
pub const INFERENCE_POOLS: Resource = Resource {
    group: "inference.networking.k8s.io",
    api_version: "inference.networking.k8s.io/v1",
    prefix: "/apis/inference.networking.k8s.io/v1",
    kind: "InferencePool",
    plural: "inferencepools",
};

const RESOURCES: [&Resource; 3] = [&ENDPOINT_SLICES, &PODS, &INFERENCE_POOLS];

impl Resource {
    fn of_kind(kind: &str) -> Option<&'static Resource> {
        RESOURCES.into_iter().find(|r| r.kind == kind)
    }

    /// `endpointslices.discovery.k8s.io`, `pods`: as the server names it in messages.
    fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}
/// Where the resourceVersion counter starts: a real cluster's is never small.
const FIRST_RESOURCE_VERSION: u64 = 1000;
/// A watch without `timeoutSeconds`: the real server's `--min-request-timeout` default.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// One endpoint of [`endpoint_slice`]: an address and its conditions (`None`: left out, as
/// the API allows).
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub ip: String,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

impl Endpoint {
    /// A running, ready pod: `ready`, `serving`, not `terminating`.
    pub fn ready(ip: &str) -> Endpoint {
        Endpoint::with(ip, true, true, false)
    }

    /// A pod shutting down that still serves: not `ready`, `serving`, `terminating`.
    pub fn terminating(ip: &str) -> Endpoint {
        Endpoint::with(ip, false, true, true)
    }

    /// A pod whose readiness probe fails: not `ready`, not `serving`, not `terminating`.
    pub fn not_ready(ip: &str) -> Endpoint {
        Endpoint::with(ip, false, false, false)
    }

    fn with(ip: &str, ready: bool, serving: bool, terminating: bool) -> Endpoint {
        Endpoint {
            ip: ip.to_string(),
            ready: Some(ready),
            serving: Some(serving),
            terminating: Some(terminating),
        }
    }
}

/// One EndpointSlice as the API server returns it, as the EndpointSlice controller makes it
/// for `service`: labels `kubernetes.io/service-name` and `endpointslice.kubernetes.io/managed-by`,
/// `addressType: IPv4`, one TCP port, each endpoint with its conditions and a Pod `targetRef`.
/// [`FakeKubeApi::apply`] adds the server-set metadata (`resourceVersion`, `uid`, ...).
pub fn endpoint_slice(
    namespace: &str,
    service: &str,
    name: &str,
    port_name: &str,
    port: u16,
    endpoints: &[Endpoint],
) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|e| {
            let mut conditions = serde_json::Map::new();
            for (key, value) in [
                ("ready", e.ready),
                ("serving", e.serving),
                ("terminating", e.terminating),
            ] {
                if let Some(value) = value {
                    conditions.insert(key.to_string(), Value::Bool(value));
                }
            }
            let pod = format!("{service}-{}", e.ip.replace(['.', ':'], "-"));
            json!({
                "addresses": [e.ip],
                "conditions": conditions,
                "targetRef": {
                    "kind": "Pod",
                    "namespace": namespace,
                    "name": pod,
                    "uid": uuid(fnv(pod.as_bytes())),
                },
            })
        })
        .collect();
    json!({
        "apiVersion": GROUP_VERSION,
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "generateName": format!("{service}-"),
            "namespace": namespace,
            "labels": {
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": service,
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    })
}

/// A pod as the kubelet reports it: `labels`, its IP (`None`: not scheduled yet), `Ready`
/// or not, and being deleted (`deletionTimestamp` set: terminating) or not.
pub fn pod(
    namespace: &str,
    name: &str,
    labels: &[(&str, &str)],
    ip: Option<&str>,
    ready: bool,
    terminating: bool,
) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    let mut pod = json!({
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                 "ports": [{"containerPort": 8000, "protocol": "TCP"}]}]},
        "status": {
            "phase": if ip.is_some() { "Running" } else { "Pending" },
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": if ready { "True" } else { "False" }},
            ],
        },
    });
    if let Some(ip) = ip {
        pod["status"]["podIP"] = json!(ip);
        pod["status"]["podIPs"] = json!([{"ip": ip}]);
    }
    if terminating {
        pod["metadata"]["deletionTimestamp"] = json!(rfc3339_now());
        pod["metadata"]["deletionGracePeriodSeconds"] = json!(30);
    }
    pod
}

/// An `inference.networking.k8s.io/v1` InferencePool: the pods matching `match_labels`,
/// serving on `target_ports` (one per data-parallel rank).
pub fn inference_pool(
    namespace: &str,
    name: &str,
    match_labels: &[(&str, &str)],
    target_ports: &[u16],
) -> Value {
    let labels: serde_json::Map<String, Value> = match_labels
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    let ports: Vec<Value> = target_ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": ports,
            "endpointPickerRef": {"name": format!("{name}-epp"), "port": {"number": 9002}},
        },
    })
}

/// A fake Kubernetes API server serving EndpointSlices on `127.0.0.1`, scripted by the test;
/// it stops (and drops every connection) on drop. See the module docs for the protocol.
pub struct FakeKubeApi {
    addr: SocketAddr,
    shared: Arc<Mutex<Inner>>,
    accept: AbortHandle,
}

impl FakeKubeApi {
    /// Starts the server on a free port (it binds port 0 and keeps the socket).
    pub async fn start() -> FakeKubeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake Kubernetes API");
        let addr = listener.local_addr().expect("local addr");
        let shared = Arc::new(Mutex::new(Inner::new()));
        let state = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                serve_connection(&state, stream);
            }
        })
        .abort_handle();
        FakeKubeApi {
            addr,
            shared,
            accept,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig into `dir`: one cluster (`server: url()`), one user with the bearer
    /// token the server requires, one current context with `namespace`. Returns its path.
    pub fn kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let path = dir.join(format!("kubeconfig-{}", self.addr.port()));
        let text = format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: fake\n  cluster:\n    server: {url}\n\
             contexts:\n\
             - name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\n\
             users:\n\
             - name: fake\n  user:\n    token: {TOKEN}\n\
             preferences: {{}}\n",
            url = self.url(),
        );
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    /// Creates or replaces an object (an EndpointSlice unless its `kind` says another this
    /// server serves: [`PODS`], [`INFERENCE_POOLS`]) (an `ADDED` or `MODIFIED` event) at a new resourceVersion,
    /// with the metadata the server sets (`resourceVersion`, `uid`, `creationTimestamp`,
    /// `generation`). Unlike a real server, a replacement identical to the stored slice is an
    /// event too.
    pub fn apply(&self, object: Value) {
        let mut inner = self.lock();
        let resource = object["kind"]
            .as_str()
            .map_or(Some(&ENDPOINT_SLICES), Resource::of_kind)
            .unwrap_or_else(|| panic!("apply: a kind this server does not serve: {object}"));
        let key = key_of(resource, &object);
        let prev = inner.objects.get(&key).cloned();
        inner.rv += 1;
        let rv = inner.rv;
        let mut obj = object;
        obj["apiVersion"] = json!(resource.api_version);
        obj["kind"] = json!(resource.kind);
        let meta = &mut obj["metadata"];
        meta["resourceVersion"] = json!(rv.to_string());
        match &prev {
            Some(prev) => {
                let generation = prev["metadata"]["generation"].as_u64().unwrap_or(0) + 1;
                meta["uid"] = prev["metadata"]["uid"].clone();
                meta["creationTimestamp"] = prev["metadata"]["creationTimestamp"].clone();
                meta["generation"] = json!(generation);
            }
            None => {
                inner.uid_seq += 1;
                meta["uid"] = json!(uuid(fnv(format!("{rv}/{}", inner.uid_seq).as_bytes())));
                meta["creationTimestamp"] = json!(rfc3339_now());
                meta["generation"] = json!(1);
            }
        }
        inner.objects.insert(key.clone(), obj.clone());
        inner.record(Change {
            rv,
            key,
            cur: Some(obj),
            prev,
        });
    }

    /// Deletes the slice (a `DELETED` event carrying its last state at the deletion's
    /// resourceVersion). Panics if there is no such slice.
    pub fn delete(&self, namespace: &str, name: &str) {
        self.delete_object(&ENDPOINT_SLICES, namespace, name);
    }

    /// Deletes an object of `resource` (see [`FakeKubeApi::delete`]).
    pub fn delete_object(&self, resource: &'static Resource, namespace: &str, name: &str) {
        let mut inner = self.lock();
        let key = (resource.kind, namespace.to_string(), name.to_string());
        let prev = inner
            .objects
            .remove(&key)
            .unwrap_or_else(|| panic!("delete: no {} {namespace}/{name}", resource.kind));
        inner.rv += 1;
        let rv = inner.rv;
        inner.record(Change {
            rv,
            key,
            cur: None,
            prev: Some(prev),
        });
    }

    /// Forgets the event history, as an etcd compaction does: from now on a watch from a
    /// resourceVersion older than the current one gets an `ERROR` event with a `410 Expired`
    /// Status (and ends), and so does a list `continue` token or an `Exact` list read from
    /// before now (HTTP `410`). Watches already open go on. A watcher that has seen every
    /// event resumes fine (as on a real cluster); to make one relist through this, keep it
    /// behind: e.g. [`fail_with`](Self::fail_with) and [`drop_watches`](Self::drop_watches),
    /// change something, compact, then `fail_with(None)`.
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.history.clear();
        inner.oldest = inner.rv;
    }

    /// Sends an `ERROR` event with a `410 Expired` Status to every open watch, then ends each
    /// stream (cleanly): what a watcher gets when the server's watch window has passed it by.
    pub fn expire_watches(&self) {
        let mut inner = self.lock();
        let line = event_line(
            "ERROR",
            &status(
                410,
                "The resourceVersion for the provided watch is too old.",
                None,
            ),
        );
        for (_, watch) in inner.watches.drain() {
            let _ = watch.tx.send(line.clone());
        }
    }

    /// Closes every open watch connection abruptly: the TCP connection is dropped in the
    /// middle of the chunked stream, with no terminating chunk.
    pub fn drop_watches(&self) {
        let mut inner = self.lock();
        let watches: Vec<Watch> = inner.watches.drain().map(|(_, w)| w).collect();
        for watch in watches {
            if let Some(conn) = inner.conns.remove(&watch.conn) {
                conn.abort();
            }
        }
    }

    /// Sends a `BOOKMARK` event at the current resourceVersion to every watch opened with
    /// `allowWatchBookmarks=true`. Its object is what the real server sends: an empty
    /// EndpointSlice but for `metadata.resourceVersion`.
    pub fn bookmark(&self) {
        let inner = self.lock();
        for watch in inner.watches.values().filter(|w| w.bookmarks) {
            let line = event_line(
                "BOOKMARK",
                &bookmark_object(watch.filter.resource, inner.rv, false),
            );
            let _ = watch.tx.send(line);
        }
    }

    /// From now on, answers every request (list, watch, get) with this HTTP status and a real
    /// `Status` body (e.g. `403 Forbidden`, `500 InternalError`); `None`: serves again. Open
    /// watches go on.
    pub fn fail_with(&self, status: Option<u16>) {
        self.lock().fail = status;
    }

    /// From now on (while `true`), reads every request and never answers it: an API server,
    /// or a balancer in front of one, that accepts and stalls. Requests already answered or
    /// watches already open go on.
    pub fn stall(&self, stall: bool) {
        self.lock().stall = stall;
    }

    /// The requests received so far, in order, each as `METHOD path?query` with the query as
    /// sent (percent-encoded).
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    /// How many watches are open now.
    pub fn open_watches(&self) -> usize {
        self.lock().watches.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        lock(&self.shared)
    }
}

impl Drop for FakeKubeApi {
    fn drop(&mut self) {
        self.accept.abort();
        let mut inner = lock(&self.shared);
        inner.watches.clear();
        for (_, conn) in inner.conns.drain() {
            conn.abort();
        }
    }
}

fn lock(shared: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// (kind, namespace, name)
type Key = (&'static str, String, String);

/// One change, as etcd keeps it: the object after (`None`: deleted) and before (`None`:
/// created).
struct Change {
    rv: u64,
    key: Key,
    cur: Option<Value>,
    prev: Option<Value>,
}

struct Watch {
    conn: u64,
    filter: Filter,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Bytes>,
}

struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// Every change after `oldest`, in order.
    history: Vec<Change>,
    /// The resourceVersion of the last compaction: nothing older can be read or watched from.
    oldest: u64,
    watches: HashMap<u64, Watch>,
    next_watch: u64,
    conns: HashMap<u64, AbortHandle>,
    next_conn: u64,
    fail: Option<u16>,
    stall: bool,
    requests: Vec<String>,
    uid_seq: u64,
}

impl Inner {
    fn new() -> Inner {
        Inner {
            rv: FIRST_RESOURCE_VERSION,
            objects: BTreeMap::new(),
            history: Vec::new(),
            oldest: FIRST_RESOURCE_VERSION,
            watches: HashMap::new(),
            next_watch: 0,
            conns: HashMap::new(),
            next_conn: 0,
            fail: None,
            stall: false,
            requests: Vec::new(),
            uid_seq: 0,
        }
    }

    /// Keeps `change` and sends it to every watch it concerns.
    fn record(&mut self, change: Change) {
        self.watches
            .retain(|_, watch| match watch.filter.event(&change) {
                Some(line) => watch.tx.send(line).is_ok(),
                None => !watch.tx.is_closed(),
            });
        self.history.push(change);
    }

    /// The objects as they were at `rv` (not older than `oldest`), sorted by etcd key.
    fn objects_at(&self, rv: u64) -> Vec<Value> {
        let mut objects = self.objects.clone();
        for change in self.history.iter().rev().take_while(|c| c.rv > rv) {
            match &change.prev {
                Some(prev) => objects.insert(change.key.clone(), prev.clone()),
                None => objects.remove(&change.key),
            };
        }
        objects.into_values().collect()
    }
}

/// Serves one accepted connection in its own task, kept so that [`FakeKubeApi::drop_watches`]
/// can drop it.
fn serve_connection(shared: &Arc<Mutex<Inner>>, stream: tokio::net::TcpStream) {
    let mut inner = lock(shared);
    let conn = inner.next_conn;
    inner.next_conn += 1;
    let state = shared.clone();
    let task = tokio::spawn(async move {
        let service_state = state.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let stalled = lock(&service_state).stall;
            let response = (!stalled).then(|| handle(&service_state, conn, &req));
            async move {
                match response {
                    Some(response) => Ok::<_, Infallible>(response),
                    // Accepted, read, and never answered: the connection stays open.
                    None => std::future::pending().await,
                }
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
            .await;
        lock(&state).conns.remove(&conn);
    });
    inner.conns.insert(conn, task.abort_handle());
}

/// What a request selects: a kind, a namespace (or all), labels, fields.
struct Filter {
    resource: &'static Resource,
    namespace: Option<String>,
    labels: Vec<Requirement>,
    fields: Vec<(String, bool, String)>,
}

enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Filter {
    fn parse(
        resource: &'static Resource,
        namespace: Option<String>,
        q: &Query,
    ) -> Result<Filter, String> {
        let labels = match q.get("labelSelector") {
            Some(s) => parse_label_selector(s)?,
            None => Vec::new(),
        };
        let mut fields = Vec::new();
        for term in q.get("fieldSelector").unwrap_or("").split(',') {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            let (key, equal, value) = if let Some((k, v)) = term.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = term.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = term.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{term}'; can't understand '{term}'"
                ));
            };
            if key != "metadata.name" && key != "metadata.namespace" {
                return Err(format!("field label not supported: {key}"));
            }
            fields.push((key.to_string(), equal, value.to_string()));
        }
        Ok(Filter {
            resource,
            namespace,
            labels,
            fields,
        })
    }

    fn has_selectors(&self) -> bool {
        !self.labels.is_empty() || !self.fields.is_empty()
    }

    fn matches(&self, obj: &Value) -> bool {
        if obj["kind"].as_str() != Some(self.resource.kind) {
            return false;
        }
        let meta = &obj["metadata"];
        let namespace = meta["namespace"].as_str().unwrap_or("");
        if self.namespace.as_deref().is_some_and(|ns| ns != namespace) {
            return false;
        }
        let fields_match = self.fields.iter().all(|(key, equal, value)| {
            let actual = match key.as_str() {
                "metadata.name" => meta["name"].as_str().unwrap_or(""),
                _ => namespace,
            };
            (actual == value) == *equal
        });
        let label = |k: &str| meta["labels"][k].as_str();
        fields_match
            && self.labels.iter().all(|r| match r {
                Requirement::Equals(k, v) => label(k) == Some(v),
                Requirement::NotEquals(k, v) => label(k) != Some(v),
                Requirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
                Requirement::NotIn(k, vs) => !label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
                Requirement::Exists(k) => label(k).is_some(),
                Requirement::NotExists(k) => label(k).is_none(),
            })
    }

    /// The event a watch with this filter gets for `change`, as the watch cache converts it.
    fn event(&self, change: &Change) -> Option<Bytes> {
        let cur = change.cur.as_ref().filter(|o| self.matches(o));
        let prev = change.prev.as_ref().filter(|o| self.matches(o));
        match (cur, prev) {
            (Some(cur), None) => Some(event_line("ADDED", cur)),
            (Some(cur), Some(_)) => Some(event_line("MODIFIED", cur)),
            (None, Some(prev)) => {
                let mut obj = prev.clone();
                obj["metadata"]["resourceVersion"] = json!(change.rv.to_string());
                Some(event_line("DELETED", &obj))
            }
            (None, None) => None,
        }
    }
}

fn parse_label_selector(selector: &str) -> Result<Vec<Requirement>, String> {
    let bad = |term: &str| format!("unable to parse requirement: found '{term}'");
    // Split on the commas outside parentheses.
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    let mut requirements = Vec::new();
    for term in terms.into_iter().map(str::trim).filter(|t| !t.is_empty()) {
        let set = |rest: &str| -> Result<Vec<String>, String> {
            let rest = rest.trim();
            let inner = rest
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(|| bad(term))?;
            Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
        };
        let requirement = if let Some((k, v)) = term.split_once("!=") {
            Requirement::NotEquals(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = term.split_once("==") {
            Requirement::Equals(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = term.split_once('=') {
            Requirement::Equals(k.trim().into(), v.trim().into())
        } else if let Some((k, rest)) = term.split_once(" notin ") {
            Requirement::NotIn(k.trim().into(), set(rest)?)
        } else if let Some((k, rest)) = term.split_once(" in ") {
            Requirement::In(k.trim().into(), set(rest)?)
        } else if let Some(k) = term.strip_prefix('!') {
            Requirement::NotExists(k.trim().into())
        } else if term.contains([' ', '(', ')', '<', '>']) {
            return Err(bad(term));
        } else {
            Requirement::Exists(term.into())
        };
        requirements.push(requirement);
    }
    Ok(requirements)
}

/// A request's query parameters, decoded.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(query: Option<&str>) -> Query {
        Query(
            query
                .unwrap_or("")
                .split('&')
                .filter(|p| !p.is_empty())
                .map(|pair| {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A boolean parameter, parsed as Go's `strconv.ParseBool`.
    fn flag(&self, key: &str) -> bool {
        matches!(
            self.get(key),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        )
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(b)) => {
                out.push(b);
                i += 2;
            }
            (b, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What a request asks for.
enum Target {
    /// The collection in one namespace, or in all (`None`).
    Collection(Option<String>),
    /// One slice: (namespace, name).
    Object(String, String),
}

fn route(path: &str) -> Option<(&'static Resource, Target, bool)> {
    RESOURCES.into_iter().find_map(|resource| {
        let rest = path.strip_prefix(resource.prefix)?;
        let (rest, watch_path) = match rest.strip_prefix("/watch") {
            Some(rest) => (rest, true),
            None => (rest, false),
        };
        let parts: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
        let plural = resource.plural;
        let target = match parts.as_slice() {
            [p] if *p == plural => Target::Collection(None),
            ["namespaces", ns, p] if *p == plural => Target::Collection(Some(ns.to_string())),
            ["namespaces", ns, p, name] if *p == plural => {
                Target::Object(ns.to_string(), name.to_string())
            }
            _ => return None,
        };
        Some((resource, target, watch_path))
    })
}

fn handle(shared: &Arc<Mutex<Inner>>, conn: u64, req: &Request<Incoming>) -> Response<ApiBody> {
    let mut inner = lock(shared);
    let path_and_query = req.uri().path_and_query().map_or_else(
        || req.uri().path().to_string(),
        |pq| pq.as_str().to_string(),
    );
    inner
        .requests
        .push(format!("{} {path_and_query}", req.method()));

    let authorized = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {TOKEN}"));
    if !authorized {
        return status_response(401, "Unauthorized", None);
    }
    let Some((resource, target, watch_path)) = route(req.uri().path()) else {
        return status_response(
            404,
            "the server could not find the requested resource",
            None,
        );
    };
    let q = Query::parse(req.uri().query());
    let watch = watch_path || q.flag("watch");
    let namespace = match &target {
        Target::Collection(ns) => ns.clone(),
        Target::Object(ns, _) => Some(ns.clone()),
    };
    let verb = match (&target, watch) {
        (_, true) => "watch",
        (Target::Collection(_), false) => "list",
        (Target::Object(..), false) => "get",
    };
    if let Some(code) = inner.fail {
        return failure(resource, code, verb, namespace.as_deref());
    }
    if req.method() != Method::GET {
        return status_response(
            405,
            "the server does not allow this method on the requested resource",
            None,
        );
    }
    match target {
        // A watch of one object: the collection's, narrowed to its name.
        Target::Object(ns, name) if watch => match Filter::parse(resource, Some(ns), &q) {
            Ok(mut filter) => {
                filter.fields.push(("metadata.name".into(), true, name));
                start_watch(shared, &mut inner, conn, filter, &q)
            }
            Err(message) => status_response(400, &message, None),
        },
        Target::Object(ns, name) => match inner.objects.get(&(resource.kind, ns, name.clone())) {
            Some(obj) => json_response(StatusCode::OK, obj),
            None => status_response(
                404,
                &format!("{} \"{name}\" not found", resource.qualified()),
                Some(json!({"name": name, "group": resource.group, "kind": resource.plural})),
            ),
        },
        Target::Collection(ns) => {
            let filter = match Filter::parse(resource, ns, &q) {
                Ok(filter) => filter,
                Err(message) => return status_response(400, &message, None),
            };
            if watch {
                start_watch(shared, &mut inner, conn, filter, &q)
            } else {
                list(&inner, &filter, &q)
            }
        }
    }
}

fn list(inner: &Inner, filter: &Filter, q: &Query) -> Response<ApiBody> {
    let rv_param = q.get("resourceVersion").filter(|v| !v.is_empty());
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|&l| l > 0);
    let (at, start) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            if rv_param.is_some() {
                return status_response(
                    400,
                    "specifying resource version is not allowed when using continue",
                    None,
                );
            }
            let Some((rv, start)) = decode_continue(token) else {
                return status_response(400, "continue key is not valid", None);
            };
            if rv < inner.oldest {
                return status_response(410, CONTINUE_EXPIRED, None);
            }
            (rv, Some(start))
        }
        None => match (rv_param, q.get("resourceVersionMatch")) {
            (Some(rv), Some("Exact")) => {
                let Ok(rv) = rv.parse::<u64>() else {
                    return status_response(400, &format!("invalid resource version: {rv}"), None);
                };
                if rv < inner.oldest {
                    return status_response(
                        410,
                        "The resourceVersion for the provided list is too old.",
                        None,
                    );
                }
                (rv.min(inner.rv), None)
            }
            _ => (inner.rv, None),
        },
    };
    let objects = if at == inner.rv {
        inner.objects.values().cloned().collect()
    } else {
        inner.objects_at(at)
    };
    // etcd's order: by key relative to the listed prefix.
    let mut items: Vec<(String, Value)> = objects
        .into_iter()
        .filter(|o| filter.matches(o))
        .map(|o| {
            let meta = &o["metadata"];
            let name = meta["name"].as_str().unwrap_or("");
            let key = match filter.namespace {
                Some(_) => name.to_string(),
                None => format!("{}/{name}", meta["namespace"].as_str().unwrap_or("")),
            };
            (key, o)
        })
        .filter(|(key, _)| start.as_deref().is_none_or(|s| key.as_str() >= s))
        .collect();
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let mut metadata = json!({"resourceVersion": at.to_string()});
    if let Some(limit) = limit.filter(|&l| items.len() > l) {
        let remaining = items.len() - limit;
        items.truncate(limit);
        let last = items.last().map(|(k, _)| k.clone()).unwrap_or_default();
        metadata["continue"] = json!(encode_continue(at, &format!("{last}\u{0}")));
        if !filter.has_selectors() {
            metadata["remainingItemCount"] = json!(remaining);
        }
    }
    let items: Vec<Value> = items
        .into_iter()
        .map(|(_, mut o)| {
            if let Some(map) = o.as_object_mut() {
                map.remove("kind");
                map.remove("apiVersion");
            }
            o
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "kind": format!("{}List", filter.resource.kind),
            "apiVersion": filter.resource.api_version,
            "metadata": metadata,
            "items": items,
        }),
    )
}

const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a \
    consistent list result. You can start a new list without the continue parameter, or use \
    the continue token in this response to retrieve the remainder of the results. Continuing \
    with the provided token results in an inconsistent list - objects that were created, \
    modified, or deleted between the time the first chunk was returned and now may show up in \
    the list.";

/// The real server's token: raw-URL base64 of `{"v":"meta.k8s.io/v1","rv":N,"start":KEY}`.
fn encode_continue(rv: u64, start: &str) -> String {
    // Written out rather than through `json!`, to keep the real server's key order.
    let token = format!(
        r#"{{"v":"meta.k8s.io/v1","rv":{rv},"start":{}}}"#,
        json!(start)
    );
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(token)
}

fn decode_continue(token: &str) -> Option<(u64, String)> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.trim_end_matches('='))
        .ok()?;
    let token: Value = serde_json::from_slice(&bytes).ok()?;
    Some((token["rv"].as_u64()?, token["start"].as_str()?.to_string()))
}

fn start_watch(
    shared: &Arc<Mutex<Inner>>,
    inner: &mut Inner,
    conn: u64,
    filter: Filter,
    q: &Query,
) -> Response<ApiBody> {
    let bookmarks = q.flag("allowWatchBookmarks");
    let initial_events = q.flag("sendInitialEvents");
    if initial_events && (!bookmarks || q.get("resourceVersionMatch") != Some("NotOlderThan")) {
        return status_response(
            422,
            "Invalid value: sendInitialEvents requires allowWatchBookmarks=true and \
             resourceVersionMatch=NotOlderThan",
            None,
        );
    }
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(DEFAULT_WATCH_TIMEOUT, Duration::from_secs);
    let (tx, rx) = mpsc::unbounded_channel();
    let from = q
        .get("resourceVersion")
        .filter(|v| !v.is_empty() && *v != "0");
    match from {
        Some(from) if !initial_events => {
            let Ok(from) = from.parse::<u64>() else {
                return status_response(400, &format!("invalid resource version: {from}"), None);
            };
            if from < inner.oldest {
                let message = format!("too old resource version: {from} ({})", inner.oldest);
                let _ = tx.send(event_line("ERROR", &status(410, &message, None)));
                drop(tx);
                return watch_response(rx, timeout, None);
            }
            for change in inner.history.iter().filter(|c| c.rv > from) {
                if let Some(line) = filter.event(change) {
                    let _ = tx.send(line);
                }
            }
        }
        _ => {
            for obj in inner.objects.values().filter(|o| filter.matches(o)) {
                let _ = tx.send(event_line("ADDED", obj));
            }
            if initial_events {
                let bookmark = bookmark_object(filter.resource, inner.rv, true);
                let _ = tx.send(event_line("BOOKMARK", &bookmark));
            }
        }
    }
    let id = inner.next_watch;
    inner.next_watch += 1;
    inner.watches.insert(
        id,
        Watch {
            conn,
            filter,
            bookmarks,
            tx,
        },
    );
    let guard = WatchGuard {
        shared: shared.clone(),
        id,
    };
    watch_response(rx, timeout, Some(guard))
}

fn bookmark_object(resource: &Resource, rv: u64, initial_events_end: bool) -> Value {
    let mut metadata = json!({"resourceVersion": rv.to_string(), "creationTimestamp": null});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    let mut object = json!({
        "kind": resource.kind,
        "apiVersion": resource.api_version,
        "metadata": metadata,
    });
    // What the real server's empty object of the kind serializes besides its metadata.
    if resource.kind == "EndpointSlice" {
        object["addressType"] = json!("");
        object["endpoints"] = Value::Null;
    } else {
        object["spec"] = json!({});
    }
    object
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    // Written out to keep the real server's order: `type`, then `object`.
    Bytes::from(format!("{{\"type\":\"{kind}\",\"object\":{object}}}\n"))
}

fn reason(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Expired",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "",
    }
}

/// A `metav1.Status` failure.
fn status(code: u16, message: &str, details: Option<Value>) -> Value {
    let mut status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason(code),
        "code": code,
    });
    if let Some(details) = details {
        status["details"] = details;
    }
    status
}

/// The failure [`FakeKubeApi::fail_with`] asked for, worded as the real server words it.
fn failure(
    resource: &Resource,
    code: u16,
    verb: &str,
    namespace: Option<&str>,
) -> Response<ApiBody> {
    let (qualified, plural, group) = (resource.qualified(), resource.plural, resource.group);
    let resource = json!({"group": group, "kind": plural});
    let (message, details) = match code {
        401 => ("Unauthorized".to_string(), None),
        403 => {
            let scope = match namespace {
                Some(ns) => format!("in the namespace \"{ns}\""),
                None => "at the cluster scope".to_string(),
            };
            let user = format!(
                "system:serviceaccount:{}:sluice",
                namespace.unwrap_or("default")
            );
            (
                format!(
                    "{qualified} is forbidden: User \"{user}\" cannot \
                     {verb} resource \"{plural}\" in API group \"{group}\" {scope}"
                ),
                Some(resource),
            )
        }
        429 => (
            "Too many requests, please try again later.".to_string(),
            Some(json!({"retryAfterSeconds": 1})),
        ),
        500 => (
            "Internal error occurred: injected by the test".to_string(),
            Some(json!({"causes": [{"message": "injected by the test"}]})),
        ),
        503 => (
            "the server is currently unable to handle the request".to_string(),
            None,
        ),
        504 => (
            "Timeout: request did not complete within the allotted timeout".to_string(),
            None,
        ),
        _ => (
            StatusCode::from_u16(code)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or("failure")
                .to_string(),
            None,
        ),
    };
    let mut response = status_response(code, &message, details);
    if code == 429 {
        response
            .headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    response
}

fn status_response(code: u16, message: &str, details: Option<Value>) -> Response<ApiBody> {
    let http = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(http, &status(code, message, details))
}

fn json_response(code: StatusCode, body: &Value) -> Response<ApiBody> {
    let mut response = Response::new(ApiBody::Full(Some(Bytes::from(body.to_string()))));
    *response.status_mut() = code;
    add_headers(&mut response);
    response
}

fn add_headers(response: &mut Response<ApiBody>) {
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache, private"));
    let audit_id = uuid(fnv(format!("{:?}", SystemTime::now()).as_bytes()));
    if let Ok(value) = HeaderValue::from_str(&audit_id) {
        headers.insert("audit-id", value);
    }
}

fn watch_response(
    rx: mpsc::UnboundedReceiver<Bytes>,
    timeout: Duration,
    guard: Option<WatchGuard>,
) -> Response<ApiBody> {
    let mut response = Response::new(ApiBody::Watch(WatchBody {
        rx,
        deadline: Box::pin(tokio::time::sleep(timeout)),
        guard,
    }));
    add_headers(&mut response);
    response
}

/// Removes its watch from the server when the response body goes (ended, or the connection
/// dropped).
struct WatchGuard {
    shared: Arc<Mutex<Inner>>,
    id: u64,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        lock(&self.shared).watches.remove(&self.id);
    }
}

struct WatchBody {
    rx: mpsc::UnboundedReceiver<Bytes>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    guard: Option<WatchGuard>,
}

/// A response body: a whole JSON document, or a watch's stream of events.
enum ApiBody {
    Full(Option<Bytes>),
    Watch(WatchBody),
}

impl Body for ApiBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ApiBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ApiBody::Watch(watch) => match watch.rx.poll_recv(cx) {
                Poll::Ready(Some(line)) => Poll::Ready(Some(Ok(Frame::data(line)))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => match watch.deadline.as_mut().poll(cx) {
                    // timeoutSeconds: the stream ends cleanly.
                    Poll::Ready(()) => {
                        watch.guard.take();
                        Poll::Ready(None)
                    }
                    Poll::Pending => Poll::Pending,
                },
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, ApiBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ApiBody::Full(Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            ApiBody::Full(None) => SizeHint::with_exact(0),
            ApiBody::Watch(_) => SizeHint::default(),
        }
    }
}

fn key_of(resource: &'static Resource, object: &Value) -> Key {
    let meta = &object["metadata"];
    let field = |f: &str| {
        meta[f]
            .as_str()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| panic!("a {} needs metadata.{f}: {object}", resource.kind))
            .to_string()
    };
    (resource.kind, field("namespace"), field("name"))
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A version-4-shaped UUID from `seed`.
fn uuid(seed: u64) -> String {
    let mix = |x: u64| {
        let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    };
    let (a, b) = (mix(seed), mix(seed.wrapping_add(0x9e37_79b9_7f4a_7c15)));
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        0x8000 | (b >> 48) & 0x3fff,
        b & 0xffff_ffff_ffff
    )
}

/// Now, as `2006-01-02T15:04:05Z`.
fn rfc3339_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(service: &str, name: &str, ip: &str) -> Value {
        endpoint_slice("prod", service, name, "http", 8000, &[Endpoint::ready(ip)])
    }

    async fn get(api: &FakeKubeApi, path_and_query: &str) -> reqwest::Response {
        reqwest::Client::new()
            .get(format!("{}{API_PREFIX}{path_and_query}", api.url()))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
    }

    async fn json(api: &FakeKubeApi, path_and_query: &str) -> (u16, Value) {
        let response = get(api, path_and_query).await;
        let code = response.status().as_u16();
        (code, response.json().await.unwrap())
    }

    fn names(list: &Value) -> Vec<&str> {
        let items = list["items"].as_array().unwrap();
        items
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap())
            .collect()
    }

    /// The next `n` events of a watch (`type name-or-code`), then whether it ended.
    async fn events(watch: &mut reqwest::Response, n: usize) -> Vec<String> {
        let mut buffer = Vec::new();
        let mut out = Vec::new();
        while out.len() < n {
            let chunk = tokio::time::timeout(Duration::from_secs(5), watch.chunk())
                .await
                .expect("a watch event within 5 s")
                .unwrap();
            let Some(chunk) = chunk else {
                out.push("END".to_string());
                break;
            };
            buffer.extend_from_slice(&chunk);
            while let Some(at) = buffer.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=at).collect();
                let event: Value = serde_json::from_slice(&line).unwrap();
                let object = &event["object"];
                let what = match object["code"].as_u64() {
                    Some(code) => code.to_string(),
                    None => object["metadata"]["name"]
                        .as_str()
                        .unwrap_or(object["metadata"]["resourceVersion"].as_str().unwrap())
                        .to_string(),
                };
                out.push(format!("{} {what}", event["type"].as_str().unwrap()));
            }
        }
        out
    }

    const NS: &str = "/namespaces/prod/endpointslices";
    const VLLM: &str = "labelSelector=kubernetes.io%2Fservice-name%3Dvllm";

    #[tokio::test]
    async fn lists_by_selector_in_consistent_pages() {
        let api = FakeKubeApi::start().await;
        for name in ["vllm-a", "vllm-b", "vllm-c"] {
            api.apply(slice("vllm", name, "10.0.0.1"));
        }
        api.apply(slice("other", "other-a", "10.0.0.9"));
        api.apply(endpoint_slice("staging", "vllm", "vllm-s", "http", 1, &[]));

        let (code, list) = json(&api, &format!("{NS}?&{VLLM}")).await;
        assert_eq!(code, 200);
        assert_eq!(list["kind"], "EndpointSliceList");
        assert_eq!(list["metadata"]["resourceVersion"], "1005");
        assert_eq!(names(&list), ["vllm-a", "vllm-b", "vllm-c"]);
        assert!(
            list["items"][0].get("kind").is_none(),
            "items carry no kind"
        );

        let (_, page) = json(&api, &format!("{NS}?{VLLM}&limit=2")).await;
        assert_eq!(names(&page), ["vllm-a", "vllm-b"]);
        let token = page["metadata"]["continue"].as_str().unwrap().to_string();
        api.delete("prod", "vllm-c");
        let (_, rest) = json(&api, &format!("{NS}?{VLLM}&limit=2&continue={token}")).await;
        assert_eq!(names(&rest), ["vllm-c"], "the snapshot of the first page");
        assert_eq!(rest["metadata"]["resourceVersion"], "1005");

        api.compact();
        let (code, status) = json(&api, &format!("{NS}?{VLLM}&limit=2&continue={token}")).await;
        assert_eq!((code, status["reason"].as_str()), (410, Some("Expired")));

        api.fail_with(Some(403));
        let (code, status) = json(&api, NS).await;
        assert_eq!((code, status["kind"].as_str()), (403, Some("Status")));
        assert_eq!(status["reason"], "Forbidden");
        api.fail_with(None);
        let response = reqwest::get(format!("{}{API_PREFIX}{NS}", api.url()))
            .await
            .unwrap();
        assert_eq!(response.status(), 401, "no bearer token");
        assert_eq!(api.requests()[0], format!("GET {API_PREFIX}{NS}?&{VLLM}"));
    }

    #[tokio::test]
    async fn watches_replay_follow_and_end() {
        let api = FakeKubeApi::start().await;
        api.apply(slice("vllm", "vllm-a", "10.0.0.1"));
        api.apply(slice("vllm", "vllm-b", "10.0.0.2"));
        let query = format!("{NS}?watch=true&{VLLM}&allowWatchBookmarks=true&timeoutSeconds=2");

        let mut watch = get(&api, &format!("{query}&resourceVersion=1001")).await;
        assert_eq!(watch.status(), 200);
        assert_eq!(events(&mut watch, 1).await, ["ADDED vllm-b"]);
        assert_eq!(api.open_watches(), 1);
        api.apply(slice("other", "other-a", "10.0.0.9"));
        api.apply(slice("other", "vllm-a", "10.0.0.1")); // relabelled away
        api.apply(slice("vllm", "vllm-b", "10.0.0.3"));
        api.bookmark();
        api.delete("prod", "vllm-b");
        let expected = [
            "DELETED vllm-a",
            "MODIFIED vllm-b",
            "BOOKMARK 1005",
            "DELETED vllm-b",
        ];
        assert_eq!(events(&mut watch, 4).await, expected);
        // timeoutSeconds=2 ends the stream cleanly.
        assert_eq!(events(&mut watch, 1).await, ["END"]);
        assert_eq!(api.open_watches(), 0);

        let mut watch = get(&api, &format!("{query}&resourceVersion=0")).await;
        api.apply(slice("vllm", "vllm-c", "10.0.0.4"));
        assert_eq!(events(&mut watch, 1).await, ["ADDED vllm-c"]);
        api.expire_watches();
        assert_eq!(events(&mut watch, 2).await, ["ERROR 410", "END"]);

        let mut watch = get(&api, &format!("{query}&resourceVersion=1007")).await;
        api.compact();
        api.drop_watches();
        assert!(
            tokio::time::timeout(Duration::from_secs(5), watch.chunk())
                .await
                .unwrap()
                .is_err(),
            "a dropped connection, not a clean end"
        );
        let mut watch = get(&api, &format!("{query}&resourceVersion=1006")).await;
        assert_eq!(watch.status(), 200);
        assert_eq!(events(&mut watch, 2).await, ["ERROR 410", "END"]);
    }
}
