//! Errors that Sluice answers itself.
//!
//! A hook that wants to refuse a request returns `Err(ErrorReply::...into_error())`. The
//! reply travels inside Pingora's `Error` as its cause, and the core turns it into the HTTP
//! answer in exactly one place (`fail_to_proxy`): the status, the OpenAI error body and, for
//! 429 and 503, `retry-after`. Errors that carry no `ErrorReply` (a refused connection, a
//! timeout) are mapped there too, with [`ErrorReply::from_error`].

use bytes::Bytes;
use pingora_error::{Error, ErrorType};
use std::fmt;

use crate::request::{Endpoint, InvalidRequest};
use sluice_llm::family::WireError;

/// The innermost Pingora error of `e`'s cause chain, and the reply it carries, if any.
/// Pingora nests errors as `Box<Error>` (`more_context`, `because`).
fn dig(e: &Error) -> (&Error, Option<&ErrorReply>) {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = e
        .cause
        .as_deref()
        .map(|c| c as &(dyn std::error::Error + 'static));
    while let Some(c) = cause {
        if let Some(reply) = c.downcast_ref::<ErrorReply>() {
            return (e, Some(reply));
        }
        if let Some(inner) = c.downcast_ref::<Box<Error>>() {
            return dig(inner);
        }
        if let Some(inner) = c.downcast_ref::<Error>() {
            return dig(inner);
        }
        cause = c.source();
    }
    (e, None)
}

/// `.map_err(internal)`: a header or framing error that can only be a bug, as a 500.
pub fn internal(e: impl fmt::Display) -> Box<Error> {
    ErrorReply::internal(e.to_string()).into_error()
}

/// An answer that Sluice makes itself, in OpenAI's error shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    /// The HTTP status of the answer (499 is logged, never sent).
    pub status: u16,
    /// For the client, as the OpenAI body's `error.message`, and for the log.
    pub message: String,
    /// The request parameter at fault, if any (OpenAI's `param`).
    pub param: Option<String>,
    /// Seconds for `retry-after`; always set on 429 and 503.
    pub retry_after: Option<u32>,
    /// Why, for `router_rejections_total{reason}` and the access log, in the answer's
    /// `x-sluice-rejected` header and in its body's `error.reason`.
    pub reason: Reason,
    /// More response headers (the `x-ratelimit-*` headers of a 429, say).
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

/// Why Sluice answered with an error of its own: a closed set, so that the metric's help
/// text and its pre-created series cannot drift from what the code emits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Malformed JSON, a wrong-typed field, bad HTTP framing.
    BadRequest,
    /// Over `limits.max_request_body_bytes`.
    BodyTooLarge,
    /// The client stopped sending its body, or sent it too slowly.
    BodyTimeout,
    /// The request header did not arrive within `limits.client_header_timeout`.
    HeaderTimeout,
    /// Over a connection cap: per client (429) or in total (503).
    TooManyConnections,
    /// An HTTP/2 connection whose client reset too many of the streams it opened (rapid
    /// reset, paced or not): closed.
    TooManyResets,
    /// Over a cap of requests in flight: per client (429) or in total (503).
    TooManyRequests,
    /// The budget for bytes held in the proxy's memory (bodies, held answers) is spent.
    MemoryBudget,
    /// The server is stopping: a stream still running at the end of the grace period.
    Stopping,
    /// No pool serves the requested model.
    UnknownModel,
    /// A stored response (Responses API) that no backend of the proxy's holds now.
    UnknownResponse,
    /// No route matches the path.
    NoRoute,
    /// A known path asked for with the wrong method.
    MethodNotAllowed,
    /// Every backend of the pool is unhealthy, ejected or already tried.
    NoHealthyBackend,
    /// The pool had no usable backend, and none came within its `no_backend_wait`.
    BackendWaitTimeout,
    /// No API key, or one no tenant has (401).
    Unauthorized,
    /// The tenant asked for what its policy forbids: a model, more tokens than its ceiling
    /// (403, or 400 for the tokens).
    Forbidden,
    /// The tenant is over a rate limit: requests, tokens or concurrent requests (429).
    RateLimited,
    /// The tenant spent its budget for the day or month (429).
    BudgetExceeded,
    /// Shed by the KV-pressure breaker.
    KvPressure,
    /// Waited in the breaker's admission queue for capacity, and none came in time.
    QueueTimeout,
    /// The breaker's admission queue for the pool is full.
    QueueFull,
    /// A sheddable request with a TTFT objective that no backend is predicted to meet, or
    /// that passed while it waited: refused rather than served late.
    TtftSloUnmeetable,
    /// The upstream failed and no fallback was left.
    UpstreamError,
    /// The upstream did not answer in time.
    UpstreamTimeout,
    /// An error status carried by a Pingora error without a reply of its own.
    HttpStatus,
    /// The client went away (499, never sent).
    ClientClosed,
    /// A bug or an impossible state in the proxy.
    Internal,
}

impl Reason {
    /// Every reason, so that each `reason` series can be created at zero at start-up.
    pub const ALL: [Reason; 28] = [
        Reason::BadRequest,
        Reason::BodyTooLarge,
        Reason::BodyTimeout,
        Reason::HeaderTimeout,
        Reason::TooManyConnections,
        Reason::TooManyResets,
        Reason::TooManyRequests,
        Reason::MemoryBudget,
        Reason::Stopping,
        Reason::UnknownModel,
        Reason::UnknownResponse,
        Reason::NoRoute,
        Reason::MethodNotAllowed,
        Reason::NoHealthyBackend,
        Reason::BackendWaitTimeout,
        Reason::Unauthorized,
        Reason::Forbidden,
        Reason::RateLimited,
        Reason::BudgetExceeded,
        Reason::KvPressure,
        Reason::QueueTimeout,
        Reason::QueueFull,
        Reason::TtftSloUnmeetable,
        Reason::UpstreamError,
        Reason::UpstreamTimeout,
        Reason::HttpStatus,
        Reason::ClientClosed,
        Reason::Internal,
    ];

    /// The token in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BadRequest => "bad-request",
            Reason::BodyTooLarge => "body-too-large",
            Reason::BodyTimeout => "body-timeout",
            Reason::HeaderTimeout => "header-timeout",
            Reason::TooManyConnections => "too-many-connections",
            Reason::TooManyResets => "too-many-resets",
            Reason::TooManyRequests => "too-many-requests",
            Reason::MemoryBudget => "memory-budget",
            Reason::Stopping => "stopping",
            Reason::UnknownModel => "unknown-model",
            Reason::UnknownResponse => "unknown-response",
            Reason::NoRoute => "no-route",
            Reason::MethodNotAllowed => "method-not-allowed",
            Reason::NoHealthyBackend => "no-healthy-backend",
            Reason::BackendWaitTimeout => "backend-wait-timeout",
            Reason::Unauthorized => "unauthorized",
            Reason::Forbidden => "forbidden",
            Reason::RateLimited => "rate-limited",
            Reason::BudgetExceeded => "budget-exceeded",
            Reason::KvPressure => "kv-pressure",
            Reason::QueueTimeout => "queue-timeout",
            Reason::QueueFull => "queue-full",
            Reason::TtftSloUnmeetable => "ttft-slo-unmeetable",
            Reason::UpstreamError => "upstream-error",
            Reason::UpstreamTimeout => "upstream-timeout",
            Reason::HttpStatus => "http-status",
            Reason::ClientClosed => "client-closed",
            Reason::Internal => "internal",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The most of a client's value an error message quotes.
const MAX_QUOTED_CHARS: usize = 128;

/// `retry-after` when nothing better is known.
pub const DEFAULT_RETRY_AFTER_SECS: u32 = 1;

impl ErrorReply {
    /// A reply with `status`; 429 and 503 get `retry-after` [`DEFAULT_RETRY_AFTER_SECS`].
    pub fn new(status: u16, reason: Reason, message: impl Into<String>) -> Self {
        let retry_after = matches!(status, 429 | 503).then_some(DEFAULT_RETRY_AFTER_SECS);
        Self {
            status,
            message: message.into(),
            param: None,
            retry_after,
            reason,
            headers: Vec::new(),
        }
    }

    /// 400 for a body that is not a valid LLM request, naming the parameter at fault.
    pub fn bad_request(invalid: InvalidRequest) -> Self {
        Self {
            param: invalid.param,
            ..Self::new(400, Reason::BadRequest, invalid.message)
        }
    }

    /// 404, for `reason` (no route matches, say).
    pub fn not_found(reason: Reason, message: impl Into<String>) -> Self {
        Self::new(404, reason, message)
    }

    /// 500: a state the proxy should never be in. The message is for the log and the client.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, Reason::Internal, message)
    }

    /// 404 for a `model` that no pool serves, with `param` set to `model`.
    pub fn unknown_model(model: &str) -> Self {
        // The name is the client's: quoted whole only when short (it reaches logs too).
        let shown: String = model.chars().take(MAX_QUOTED_CHARS).collect();
        let ellipsis = if shown.len() < model.len() { "…" } else { "" };
        Self {
            param: Some("model".into()),
            ..Self::new(
                404,
                Reason::UnknownModel,
                format!("The model `{shown}{ellipsis}` does not exist."),
            )
        }
    }

    /// 413 for a body over `limit` bytes (`limits.max_request_body_bytes`).
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            413,
            Reason::BodyTooLarge,
            format!("The request body is larger than the limit of {limit} bytes."),
        )
    }

    /// 503 with `retry-after`: shed, or nothing healthy to send to.
    pub fn unavailable(reason: Reason, message: impl Into<String>, retry_after: u32) -> Self {
        Self {
            retry_after: Some(retry_after.max(1)),
            ..Self::new(503, reason, message)
        }
    }

    /// 502: the upstream failed or could not be reached, and no fallback was left.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(502, Reason::UpstreamError, message)
    }

    /// 504: the upstream did not answer in time.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(504, Reason::UpstreamTimeout, message)
    }

    /// Wraps the reply in a Pingora error, so hooks can return it with `?`.
    pub fn into_error(self) -> Box<Error> {
        let context = format!("{} {}", self.status, self.reason);
        Error::because(ErrorType::HTTPStatus(self.status), context, self)
    }

    /// The reply a Pingora error should produce: the `ErrorReply` it carries, or one mapped
    /// from its type (connect failures are 502, timeouts 504, a client gone is 499).
    pub fn from_error(e: &Error) -> Self {
        let (innermost, reply) = dig(e);
        reply.cloned().unwrap_or_else(|| Self::mapped(innermost))
    }

    /// The `ErrorReply` a Pingora error carries, if Sluice made it (rather than a socket or
    /// an upstream): a refusal of Sluice's own, which says nothing about the upstream.
    pub fn carried_by(e: &Error) -> Option<Self> {
        dig(e).1.cloned()
    }

    /// The reply for an error that carries none, from its type.
    fn mapped(e: &Error) -> Self {
        use ErrorType::*;
        match &e.etype {
            ConnectTimedout | ConnectRefused | ConnectNoRoute | ConnectError
            | ConnectProxyFailure | TLSHandshakeFailure | TLSHandshakeTimedout | InvalidCert
            | HandshakeError => Self::bad_gateway(format!(
                "The upstream could not be reached: {}.",
                e.etype.as_str()
            )),
            ReadTimedout if e.esource == pingora_error::ErrorSource::Downstream => Self::new(
                408,
                Reason::BodyTimeout,
                "The client sent no body data in time.",
            ),
            // A client that stopped reading: nobody is left to answer.
            WriteTimedout if e.esource == pingora_error::ErrorSource::Downstream => Self::new(
                499,
                Reason::ClientClosed,
                "The client stopped reading the answer.",
            ),
            ReadTimedout | WriteTimedout => {
                Self::gateway_timeout("The upstream did not answer in time.")
            }
            HTTPStatus(code) if (400..600).contains(code) => {
                Self::new(*code, Reason::HttpStatus, e.to_string())
            }
            InvalidHTTPHeader | H1Error | H2Error
                if e.esource == pingora_error::ErrorSource::Downstream =>
            {
                Self::new(400, Reason::BadRequest, "The request is not valid HTTP.")
            }
            ConnectionClosed | ReadError | WriteError
                if e.esource == pingora_error::ErrorSource::Downstream =>
            {
                // Nobody is left to read this; 499 is what nginx logs for it.
                Self::new(
                    499,
                    Reason::ClientClosed,
                    "The client closed the connection.",
                )
            }
            _ if e.esource == pingora_error::ErrorSource::Upstream => {
                Self::bad_gateway(format!("The upstream failed: {}.", e.etype.as_str()))
            }
            _ => Self::internal("Internal error in the proxy."),
        }
    }

    /// What the error says, for a family to shape.
    fn wire(&self) -> WireError<'_> {
        WireError {
            status: self.status,
            message: &self.message,
            param: self.param.as_deref(),
            reason: self.reason.as_str(),
        }
    }

    /// The body in OpenAI's shape (`{"error": {"message", "type", "param", "code",
    /// "reason"}}`): Sluice's own API's, for every route that is not an API family's.
    pub fn body(&self) -> Bytes {
        Bytes::from(sluice_llm::family::openai::error_body(&self.wire()))
    }

    /// The body in the shape of `endpoint`'s family, or OpenAI's when none.
    pub fn body_for(&self, endpoint: Option<Endpoint>) -> Bytes {
        match endpoint {
            Some(endpoint) => Bytes::from(endpoint.family().error_body(&self.wire())),
            None => self.body(),
        }
    }

    /// The same error as the last event of a stream that has already started, in OpenAI's
    /// shape (`data: {...}`, `data: [DONE]`).
    #[cfg(test)]
    pub fn sse_event(&self) -> Bytes {
        self.sse_event_for(Endpoint::ChatCompletions)
    }

    /// The same error as the last event of `endpoint`'s stream, as its family ends one.
    pub fn sse_event_for(&self, endpoint: Endpoint) -> Bytes {
        Bytes::from(endpoint.family().error_event(&self.wire()))
    }
}

impl fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.reason, self.message)
    }
}

impl std::error::Error for ErrorReply {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_survives_the_trip_through_a_pingora_error() {
        let reply = ErrorReply::unavailable(Reason::KvPressure, "shed", 3);
        let e = reply.clone().into_error();
        assert_eq!(ErrorReply::from_error(&e), reply);
        // Wrapped once more by Pingora's `more_context`, it is still found.
        let e = e.more_context("while filtering");
        assert_eq!(ErrorReply::from_error(&e).retry_after, Some(3));
    }

    #[test]
    fn plain_errors_map_to_statuses() {
        let refused = Error::new_up(ErrorType::ConnectRefused);
        assert_eq!(ErrorReply::from_error(&refused).status, 502);
        let timeout = Error::new_up(ErrorType::ReadTimedout);
        assert_eq!(ErrorReply::from_error(&timeout).status, 504);
    }

    #[test]
    fn body_is_the_openai_shape() {
        let r = ErrorReply::bad_request(InvalidRequest {
            message: "bad".into(),
            param: Some("stream".into()),
        });
        let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error":{"message":"bad","type":"BadRequestError","param":"stream","code":400,"reason":"bad-request"}})
        );
        assert_eq!(
            ErrorReply::new(503, Reason::KvPressure, "y").retry_after,
            Some(1)
        );
        assert!(r.sse_event().ends_with(b"data: [DONE]\n\n"));
    }
}
