//! A real OTLP trace receiver for the tests: `opentelemetry-proto`'s own types, over HTTP
//! (`POST /v1/traces`, protobuf, as collectors take it on 4318) or gRPC (the `TraceService`
//! of collectors' 4317), on a free port. It keeps every span it receives, with its resource's
//! `service.name`.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
pub use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One received span, with the `service.name` of its resource.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub span: Span,
}

impl ReceivedSpan {
    /// The span's trace id, as hex.
    pub fn trace_id(&self) -> String {
        hex::encode(&self.span.trace_id)
    }

    pub fn span_id(&self) -> String {
        hex::encode(&self.span.span_id)
    }

    pub fn parent_id(&self) -> String {
        hex::encode(&self.span.parent_span_id)
    }

    /// An attribute's value, as text (numbers written out).
    pub fn attribute(&self, key: &str) -> Option<String> {
        value_of(&self.span.attributes, key)
    }

    /// The names of the span's events.
    pub fn events(&self) -> Vec<String> {
        self.span.events.iter().map(|e| e.name.clone()).collect()
    }
}

fn value_of(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    Some(match value.value.as_ref()? {
        AnyValue::StringValue(s) => s.clone(),
        AnyValue::IntValue(i) => i.to_string(),
        AnyValue::DoubleValue(d) => d.to_string(),
        AnyValue::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

type Spans = Arc<Mutex<Vec<ReceivedSpan>>>;

fn keep(spans: &Spans, request: ExportTraceServiceRequest) {
    let mut kept = spans.lock().unwrap_or_else(|e| e.into_inner());
    for resource in request.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .and_then(|r| value_of(&r.attributes, "service.name"))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                kept.push(ReceivedSpan {
                    service: service.clone(),
                    span,
                });
            }
        }
    }
}

/// A running receiver; stopped when dropped.
pub struct OtlpReceiver {
    pub addr: SocketAddr,
    grpc: bool,
    spans: Spans,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Grpc(Spans);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        keep(&self.0, request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl OtlpReceiver {
    /// A receiver of OTLP/HTTP (protobuf) at `http://addr/v1/traces`.
    pub async fn http() -> OtlpReceiver {
        use http_body_util::BodyExt;
        use hyper::service::service_fn;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans: Spans = Arc::default();
        let kept = Arc::clone(&spans);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let service =
                        service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                            let kept = Arc::clone(&kept);
                            async move {
                                let path_ok = request.uri().path() == "/v1/traces";
                                let body = request.into_body().collect().await?.to_bytes();
                                let status = match ExportTraceServiceRequest::decode(body) {
                                    Ok(export) if path_ok => {
                                        keep(&kept, export);
                                        200
                                    }
                                    _ => 400,
                                };
                                let answer = ExportTraceServiceResponse::default().encode_to_vec();
                                Ok::<_, hyper::Error>(
                                    hyper::Response::builder()
                                        .status(status)
                                        .header("content-type", "application/x-protobuf")
                                        .body(http_body_util::Full::new(bytes::Bytes::from(answer)))
                                        .unwrap(),
                                )
                            }
                        });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
        OtlpReceiver {
            addr,
            grpc: false,
            spans,
            task,
        }
    }

    /// A receiver of OTLP/gRPC at `http://addr`.
    pub async fn grpc() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans: Spans = Arc::default();
        let service = TraceServiceServer::new(Grpc(Arc::clone(&spans)));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        OtlpReceiver {
            addr,
            grpc: true,
            spans,
            task,
        }
    }

    /// The `telemetry.otlp` section that sends here.
    pub fn config(&self) -> serde_json::Value {
        serde_json::json!({
            "endpoint": format!("http://{}", self.addr),
            "protocol": if self.grpc { "grpc" } else { "http/protobuf" },
        })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The spans received once `done` says they are all there, or what came in `within`.
    pub async fn spans_when(
        &self,
        within: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let spans = self.spans();
            if done(&spans) || tokio::time::Instant::now() > deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
