//! Traces: Sluice with every plugin on exports a server span per request and a client span per
//! upstream attempt (GenAI conventions) to a real OTLP receiver the test starts, over HTTP and
//! gRPC; a client's `traceparent` is continued (or not, when told), the engine gets a
//! `traceparent` naming the attempt's span, an escalated request shows its two attempts, a
//! shed request its shed event, and a collector that is down costs no request anything while
//! its dropped spans are counted; a proxy that stops sends the spans it still holds. A plain
//! route's tries are spans and attempts too, its upstream given the answering try's trace
//! context when the request is traced and the client's headers when it is not.
// Test code: a panic is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use sluice_testkit::*;
use std::time::Duration;
use vllm_sim::{Faults, SimConfig};

const MODEL: &str = "traced";
const KEY: &str = "sk-traced";
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

async fn sim() -> vllm_sim::Sim {
    vllm_sim::start(
        SimConfig::default()
            .with_model(MODEL)
            .with_kv(1000, 16)
            .with_record_requests(64),
    )
    .await
    .unwrap()
}

/// Every plugin on; the draft pool first, the target after it.
fn config(draft: &vllm_sim::Sim, target: &vllm_sim::Sim, telemetry: Value) -> Value {
    json!({
        "pools": [
            pool("draft", &[MODEL], &[draft.addr()])
                .with("outlier_detection", json!({"consecutive_failures": 0})),
            pool("target", &[MODEL], &[target.addr()]),
        ],
        "plugins": {
            "request_id": {"enabled": true},
            "tenants": {"enabled": true, "tenants": {"team": {"keys": [key_digest(KEY)]}}},
            "cache": {"enabled": true},
            "speculative": {"enabled": true, "models": [
                {"model": MODEL, "drafts": [{"pool": "draft"}], "target": "target"}]},
            "kv_breaker": {"enabled": true},
        },
        "telemetry": telemetry,
    })
}

fn auth() -> (&'static str, String) {
    ("authorization", format!("Bearer {KEY}"))
}

async fn ask_with(proxy: &Proxy, body: &Value, extra: &[(&str, &str)]) -> Answer {
    let (name, value) = auth();
    let mut headers = vec![(name, value.as_str())];
    headers.extend_from_slice(extra);
    proxy.ask(body, &headers).await
}

/// The last chat request the engine got (health checks and scrapes come too).
fn last_chat(sim: &vllm_sim::Sim) -> vllm_sim::RecordedRequest {
    let stats = sim.stats();
    stats
        .recent
        .iter()
        .rev()
        .find(|r| r.path == "/v1/chat/completions")
        .cloned()
        .unwrap()
}

fn spans_of<'a>(spans: &'a [ReceivedSpan], trace: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| s.trace_id() == trace).collect()
}

/// The server span of a trace and its attempt spans, once they have all come.
async fn trace_of(
    receiver: &OtlpReceiver,
    trace: &str,
    attempts: usize,
) -> (ReceivedSpan, Vec<ReceivedSpan>) {
    let spans = receiver
        .spans_when(Duration::from_secs(10), |spans| {
            let of = spans_of(spans, trace);
            of.iter().filter(|s| s.span.kind == 2).count() == 1
                && of.iter().filter(|s| s.span.kind == 3).count() == attempts
        })
        .await;
    let of = spans_of(&spans, trace);
    let server = of
        .iter()
        .find(|s| s.span.kind == 2)
        .unwrap_or_else(|| panic!("no server span in {of:#?}"));
    let clients: Vec<ReceivedSpan> = of
        .iter()
        .filter(|s| s.span.kind == 3)
        .map(|s| (*s).clone())
        .collect();
    assert_eq!(clients.len(), attempts, "{of:#?}");
    ((*server).clone(), clients)
}

/// The trace id of an answer, from the access log's line for its request id (written as the
/// request ends, just after the client has its answer: waited for).
async fn trace_in_log(proxy: &Proxy, answer: &Answer) -> String {
    let id = answer.headers["x-request-id"].to_str().unwrap().to_string();
    let line = || {
        proxy
            .logs()
            .lines()
            .find(|l| l.contains("sluice::access") && l.contains(&id))
            .map(str::to_string)
    };
    wait_for(Duration::from_secs(5), || async { line().is_some() }).await;
    let line = line().unwrap_or_else(|| panic!("no access line for {id}"));
    let trace = line.split("trace_id=").nth(1).unwrap();
    trace.split_whitespace().next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_attempts_are_traced_over_http() {
    let receiver = OtlpReceiver::http().await;
    let (draft, target) = (sim().await, sim().await);
    let proxy = Proxy::start(config(
        &draft,
        &target,
        json!({"otlp": receiver.config(), "sampling": 1.0, "service_name": "sluice-test"}),
    ))
    .await;

    // A client's trace is continued; the attempt is a client span under the request's.
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let mut body = chat(MODEL, "what is traced", true);
    body["max_tokens"] = json!(12);
    let answer = ask_with(&proxy, &body, &[("traceparent", &traceparent)]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let (server, attempts) = trace_of(&receiver, CLIENT_TRACE, 1).await;
    assert_eq!(server.service, "sluice-test");
    assert_eq!(server.parent_id(), CLIENT_SPAN);
    assert_eq!(server.span.name, "POST /v1/chat/completions");
    assert_eq!(server.attribute("sluice.pool").as_deref(), Some("draft"));
    assert_eq!(server.attribute("sluice.tenant").as_deref(), Some("team"));
    assert_eq!(server.attribute("sluice.cache").as_deref(), Some("miss"));
    assert_eq!(
        server.attribute("http.response.status_code").as_deref(),
        Some("200")
    );
    assert!(server.attribute("sluice.admission.wait_ms").is_some());
    assert_eq!(server.attribute("sluice.model").as_deref(), Some(MODEL));
    let attempt = &attempts[0];
    assert_eq!(attempt.parent_id(), server.span_id());
    assert_eq!(attempt.span.name, format!("chat {MODEL}"));
    for (key, want) in [
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.provider.name", "vllm"),
        ("gen_ai.request.model", MODEL),
        ("gen_ai.response.model", MODEL),
        ("gen_ai.request.max_tokens", "12"),
        ("server.address", "127.0.0.1"),
        ("http.response.status_code", "200"),
        ("sluice.outcome", "response"),
        ("sluice.attempt", "1"),
    ] {
        assert_eq!(attempt.attribute(key).as_deref(), Some(want), "{key}");
    }
    assert_eq!(
        attempt.attribute("server.port"),
        Some(draft.addr().port().to_string())
    );
    // The stream's usage, read as it passed.
    let output: u64 = attempt
        .attribute("gen_ai.usage.output_tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=12).contains(&output), "{output}");
    assert!(attempt.attribute("gen_ai.usage.input_tokens").is_some());
    assert!(attempt.events().contains(&"first_token".to_string()));
    // The gen_ai attributes are the attempt's alone.
    assert!(server.attribute("gen_ai.request.model").is_none());
    // The engine got a traceparent naming the attempt's span, not the client's.
    let sent = last_chat(&draft);
    assert_eq!(
        sent.header("traceparent"),
        Some(format!("00-{CLIENT_TRACE}-{}-01", attempt.span_id()).as_str())
    );
    // The access log line names the trace.
    assert_eq!(trace_in_log(&proxy, &answer).await, CLIENT_TRACE);

    // Escalated: the draft fails, the target answers; two attempts, the escalation noted.
    draft.set_faults(Faults::error_rate(1.0, 503));
    let answer = ask_with(&proxy, &chat(MODEL, "escalate me", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let trace = trace_in_log(&proxy, &answer).await;
    let (server, attempts) = trace_of(&receiver, &trace, 2).await;
    let pools: Vec<_> = attempts
        .iter()
        .map(|a| a.attribute("sluice.pool").unwrap())
        .collect();
    assert!(
        pools.contains(&"draft".into()) && pools.contains(&"target".into()),
        "{pools:?}"
    );
    assert_eq!(
        server.attribute("sluice.escalation.reason").as_deref(),
        Some("draft-error")
    );
    let events: Vec<String> = attempts.iter().flat_map(ReceivedSpan::events).collect();
    assert!(events.contains(&"escalated".to_string()), "{events:?}");
    draft.set_faults(Faults::default());

    // Shed: a request that can never fit the draft's KV cache is refused with the event.
    let mut huge = chat(MODEL, "too big", false);
    huge["max_tokens"] = json!(100_000);
    let answer = ask_with(&proxy, &huge, &[]).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    let trace = trace_in_log(&proxy, &answer).await;
    let spans = receiver
        .spans_when(Duration::from_secs(10), |spans| {
            spans_of(spans, &trace).iter().any(|s| s.span.kind == 2)
        })
        .await;
    let server = spans_of(&spans, &trace)
        .into_iter()
        .find(|s| s.span.kind == 2)
        .unwrap()
        .clone();
    assert!(server.events().contains(&"shed".to_string()), "{server:#?}");
    assert_eq!(
        server.attribute("http.response.status_code").as_deref(),
        Some("503")
    );
    // Span events are the trace's, never lines of the log (at `info`, as they are).
    assert!(
        !proxy.logs().contains(sluice_sdk::SPAN_EVENTS),
        "{}",
        proxy.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_export_and_an_edge_that_starts_its_own_traces() {
    let receiver = OtlpReceiver::grpc().await;
    let (draft, target) = (sim().await, sim().await);
    let proxy = Proxy::start(config(
        &draft,
        &target,
        json!({"otlp": receiver.config(), "client_traces": "ignore"}),
    ))
    .await;
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let answer = ask_with(
        &proxy,
        &chat(MODEL, "at the edge", false),
        &[("traceparent", &traceparent)],
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let trace = trace_in_log(&proxy, &answer).await;
    assert_ne!(trace, CLIENT_TRACE, "a client's trace was continued");
    let (server, attempts) = trace_of(&receiver, &trace, 1).await;
    assert_eq!(server.service, "sluice");
    assert!(server.span.parent_span_id.is_empty(), "a root span");
    assert_eq!(
        attempts[0].attribute("gen_ai.operation.name").as_deref(),
        Some("chat")
    );
    let sent = last_chat(&draft);
    assert!(sent.header("traceparent").unwrap().contains(&trace));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_keeps_a_share_of_traces_and_no_client_forces_one() {
    let receiver = OtlpReceiver::http().await;
    let (draft, target) = (sim().await, sim().await);
    let proxy = Proxy::start(config(
        &draft,
        &target,
        json!({"otlp": receiver.config(), "sampling": 0.0}),
    ))
    .await;
    for i in 0..5 {
        let answer = ask_with(&proxy, &chat(MODEL, &format!("unsampled {i}"), false), &[]).await;
        assert_eq!(answer.status, 200);
        // Not sampled: the engine is told so.
        let sent = last_chat(&draft);
        assert!(sent.header("traceparent").unwrap().ends_with("-00"));
    }
    // A client's trace headers never reach the engine, and a client's sampled flag counts
    // only up to the operator's ratio: at 0, no client makes a span (any client could
    // otherwise make every request of its own a span, and fill the export queue).
    for flags in ["00", "01"] {
        let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-{flags}");
        let answer = ask_with(
            &proxy,
            &chat(MODEL, &format!("flagged {flags} by the client"), false),
            &[("traceparent", &traceparent), ("tracestate", "vendor=x")],
        )
        .await;
        assert_eq!(answer.status, 200);
        let sent = last_chat(&draft);
        let sent_parent = sent.header("traceparent").unwrap();
        assert!(
            sent_parent.ends_with("-00") && !sent_parent.contains(CLIENT_TRACE),
            "{sent_parent}"
        );
        // A sampled request's engine is told the attempt's span, flagged sampled.
        assert_eq!(sent.header("tracestate"), None);
    }

    // At 0.5, about half the new traces are kept (100 requests: 25 to 75 of them, a bound
    // that a fair draw misses once in millions of runs), each whole.
    let receiver = OtlpReceiver::http().await;
    let proxy = Proxy::start(config(
        &draft,
        &target,
        json!({"otlp": receiver.config(), "sampling": 0.5}),
    ))
    .await;
    let mut sampled = Vec::new();
    for i in 0..100 {
        let answer = ask_with(&proxy, &chat(MODEL, &format!("half {i}"), false), &[]).await;
        assert_eq!(answer.status, 200);
        let sent = last_chat(&draft);
        let sent = sent.header("traceparent").unwrap();
        if sent.ends_with("-01") {
            sampled.push(sent.split('-').nth(1).unwrap().to_string());
        }
    }
    assert!(
        (25..=75).contains(&sampled.len()),
        "{} of 100",
        sampled.len()
    );
    let spans = receiver
        .spans_when(Duration::from_secs(10), |spans| {
            spans.len() >= 2 * sampled.len()
        })
        .await;
    let mut traces: Vec<String> = spans.iter().map(|s| s.trace_id()).collect();
    traces.sort();
    traces.dedup();
    sampled.sort();
    assert_eq!(
        traces, sampled,
        "the traces exported are those the engine was told of"
    );
    assert_eq!(
        spans.len(),
        2 * sampled.len(),
        "a request and an attempt span each"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_costs_no_request_and_its_spans_are_counted() {
    let down = reserve_port();
    let (draft, target) = (sim().await, sim().await);
    let proxy = Proxy::start(config(
        &draft,
        &target,
        json!({"otlp": {"endpoint": format!("http://{}", down.addr())}}),
    ))
    .await;
    for i in 0..10 {
        let answer = ask_with(&proxy, &chat(MODEL, &format!("lost {i}"), false), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    // 10 requests, 2 spans each, refused by the collector's closed port.
    let dropped = wait_for(Duration::from_secs(15), || async {
        proxy
            .metric(r#"sluice_trace_spans_total{result="dropped_export_failed"}"#)
            .await
            .unwrap_or(0.0)
            >= 20.0
    })
    .await;
    assert!(dropped.is_some(), "{}", proxy.metrics().await);
    assert_eq!(
        proxy
            .metric(r#"sluice_trace_spans_total{result="exported"}"#)
            .await,
        Some(0.0)
    );
}

/// A proxy told to stop sends the spans it still holds before it exits (they wait up to a
/// second for a batch otherwise, and a drained proxy exits as soon as nothing is in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_proxy_sends_the_spans_it_holds() {
    let receiver = OtlpReceiver::http().await;
    let (draft, target) = (sim().await, sim().await);
    let mut proxy = Proxy::start(config(&draft, &target, json!({"otlp": receiver.config()}))).await;
    let answer = ask_with(&proxy, &chat(MODEL, "the last one", false), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let trace = trace_in_log(&proxy, &answer).await;
    let mut child = proxy.take_child();
    signal(child.id(), "TERM");
    exits_within(&mut child, Duration::from_secs(20)).await;
    let spans = receiver.spans();
    assert_eq!(spans_of(&spans, &trace).len(), 2, "{spans:#?}");
}

/// What a client sends stays small on a span, its trace headers stay behind, and a traced
/// stream's usage is on its attempt whether or not the client asked for it:
/// - a request with a 2 KB path made a span named with all of it (a 1 MB one, a megabyte in
///   the export queue);
/// - a client's `tracestate`, `baggage` and `X-data-parallel-rank` reached the engine, with
///   telemetry on or off;
/// - a stream whose client did not set `stream_options.include_usage` had no
///   `gen_ai.usage.*` on its attempt span (the engine is now asked, and the usage chunk is
///   kept from the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_request_stays_small_on_its_span_and_its_trace_headers_stay_behind() {
    let receiver = OtlpReceiver::http().await;
    let engine = sim().await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[engine.addr()])],
        "telemetry": {"otlp": receiver.config(), "sampling": 1.0},
    }))
    .await;
    let headers = [
        ("tracestate", "vendor=client"),
        ("baggage", "user=mallory"),
        ("x-data-parallel-rank", "7"),
    ];
    let answer = proxy
        .ask(&chat(MODEL, "count my tokens", true), &headers)
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(
        !answer.body.contains("\"usage\":{"),
        "the client did not ask for the usage chunk: {}",
        answer.body
    );
    let sent = last_chat(&engine);
    for (name, value) in headers {
        // The exporter writes a `tracestate` of its own, empty.
        let got = sent.header(name).filter(|v| !v.is_empty());
        assert_eq!(got, None, "{name}: {value} reached the engine");
    }
    let traceparent = sent.header("traceparent").unwrap().to_string();
    let trace = traceparent.split('-').nth(1).unwrap().to_string();
    let (_, attempts) = trace_of(&receiver, &trace, 1).await;
    let output: u64 = attempts[0]
        .attribute("gen_ai.usage.output_tokens")
        .expect("the stream's usage on its attempt")
        .parse()
        .unwrap();
    assert!(output > 0);

    let long = format!("/{}", "a".repeat(2000));
    let answer = client().get(proxy.url(&long)).send().await.unwrap();
    assert_eq!(answer.status(), 404);
    let spans = receiver
        .spans_when(Duration::from_secs(10), |spans| {
            spans.iter().any(|s| s.span.name.starts_with("GET /aaa"))
        })
        .await;
    let named = spans
        .iter()
        .find(|s| s.span.name.starts_with("GET /aaa"))
        .expect("the long path's span");
    assert!(
        named.span.name.len() <= 260,
        "{} bytes",
        named.span.name.len()
    );

    // Without telemetry, the same headers and a client's traceparent stay behind too.
    let untraced = Proxy::start(json!({"pools": [pool("main", &[MODEL], &[engine.addr()])]})).await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let mut all = headers.to_vec();
    all.push(("traceparent", &parent));
    let answer = untraced.ask(&chat(MODEL, "untraced", false), &all).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let sent = last_chat(&engine);
    for (name, _) in all {
        assert_eq!(sent.header(name), None, "{name} reached the engine");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_routes_tries_are_traced_and_counted_each() {
    let receiver = OtlpReceiver::http().await;
    let upstream = sim().await;
    let dead = reserve_port();
    // Round robin over a refused port and the engine: of every two requests, at least one
    // tries the refused port first, then the engine.
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[dead.addr(), upstream.addr()])
            .without_health_checks()
            .with("balancing", json!({"strategy": "round_robin"}))],
        "routes": [{"path_prefix": "/version", "pool": "main"}],
        "plugins": {"request_id": {"enabled": true}},
        "telemetry": {"otlp": receiver.config(), "sampling": 1.0},
    }))
    .await;
    let client = client();
    const REQUESTS: usize = 4;
    let mut traces = Vec::new();
    for i in 0..REQUESTS {
        // A trace of its own each: the client's trace id, its last digit the request's.
        let traceparent = format!("00-{}{i}-{CLIENT_SPAN}-01", &CLIENT_TRACE[..31]);
        let answer = client
            .get(proxy.url(&format!("/version?try={i}")))
            .header("traceparent", &traceparent)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        traces.push(traceparent[3..35].to_string());
    }
    // Each trace: the request's span and one span per try; the upstream got the trace
    // context of the try that reached it, not the client's.
    let mut outcomes = Vec::new();
    for (i, trace) in traces.iter().enumerate() {
        let spans = receiver
            .spans_when(Duration::from_secs(10), |spans| {
                let of = spans_of(spans, trace);
                of.iter().any(|s| s.span.kind == 2)
                    && of
                        .iter()
                        .filter(|s| s.span.kind == 3)
                        .any(|s| s.attribute("sluice.outcome").as_deref() == Some("response"))
            })
            .await;
        let tries: Vec<&ReceivedSpan> = spans_of(&spans, trace)
            .into_iter()
            .filter(|s| s.span.kind == 3)
            .collect();
        let answered = tries
            .iter()
            .find(|s| s.attribute("sluice.outcome").as_deref() == Some("response"))
            .unwrap();
        assert_eq!(
            answered.attribute("http.response.status_code").as_deref(),
            Some("200")
        );
        let sent = upstream
            .stats()
            .recent
            .iter()
            .rev()
            .find(|r| r.path == format!("/version?try={i}"))
            .cloned()
            .unwrap();
        assert_eq!(
            sent.header("traceparent"),
            Some(format!("00-{trace}-{}-01", answered.span_id()).as_str())
        );
        outcomes.extend(tries.iter().map(|s| s.attribute("sluice.outcome").unwrap()));
    }
    let count = |outcome: &str| outcomes.iter().filter(|o| *o == outcome).count();
    let refused = count("connect_error");
    assert_eq!(count("response"), REQUESTS, "{outcomes:?}");
    assert!(refused >= REQUESTS / 2, "{outcomes:?}");
    assert_eq!(refused + REQUESTS, outcomes.len(), "{outcomes:?}");
    // Each try is counted as it ended, the refused ones too.
    for (outcome, want) in [("connect_error", refused), ("response", REQUESTS)] {
        let series =
            format!(r#"sluice_upstream_attempts_total{{outcome="{outcome}",pool="main"}}"#);
        assert_eq!(proxy.metric(&series).await, Some(want as f64), "{series}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_plain_request_keeps_the_clients_trace_headers() {
    let receiver = OtlpReceiver::http().await;
    let upstream = sim().await;
    let proxy = Proxy::start(json!({
        "pools": [pool("main", &[MODEL], &[upstream.addr()]).without_health_checks()],
        "routes": [{"path_prefix": "/version", "pool": "main"}],
        "telemetry": {"otlp": receiver.config(), "sampling": 0.0},
    }))
    .await;
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00");
    let answer = client()
        .get(proxy.url("/version?unsampled"))
        .header("traceparent", &traceparent)
        .header("tracestate", "vendor=x")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let sent = upstream
        .stats()
        .recent
        .iter()
        .rev()
        .find(|r| r.path == "/version?unsampled")
        .cloned()
        .unwrap();
    assert_eq!(sent.header("traceparent"), Some(traceparent.as_str()));
    assert_eq!(sent.header("tracestate"), Some("vendor=x"));
}
