//! Which pipeline a request takes.
//!
//! The LLM endpoints are built in: each API family's path (`POST /v1/chat/completions`,
//! `/v1/completions`, `/v1/responses`, `/v1/messages`, `/tokenize`, `/v1/embeddings`, ...)
//! goes through the LLM pipeline, `GET /v1/models` is answered by Sluice, and a stored
//! response's `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` go to the backend
//! that made it. Any other request is
//! matched against the configured routes as nginx matches `location` prefixes: a route with a
//! `host` beats one without, then the longest `path_prefix` wins. No match: 404.
//!
//! Paths are matched as the engine will read them (uvicorn decodes escapes, `%2F` included),
//! and vLLM's own endpoints that generate or administer without Sluice's accounting
//! ([`ENGINE_ONLY`]) are refused on every route: a catch-all route would otherwise carry
//! `/v1/chat/completions/batch` past every token limit, budget and breaker.

use crate::config::RouteRule;
use pingora_http::RequestHeader;
use sluice_sdk::{Endpoint, Route, RouteMatch};

pub struct Router {
    /// Sorted so that the first match is the best: host-specific first, then longest prefix.
    rules: Vec<RouteRule>,
}

/// The decision, with the rule for plain routes.
pub enum Decision<'a> {
    Llm(Endpoint, RouteMatch),
    Models,
    /// `GET /v1/responses/{id}` or `POST /v1/responses/{id}/cancel`: the id.
    StoredResponse(String),
    Plain(&'a RouteRule),
    NotFound,
    /// One of vLLM's own endpoints ([`ENGINE_ONLY`]): 404 on every route.
    EngineOnly,
    /// A known path with the wrong method: 405.
    MethodNotAllowed(&'static str),
}

impl Decision<'_> {
    pub fn route(&self) -> Route {
        match self {
            Decision::Llm(e, _) => Route::Llm(*e),
            Decision::Models => Route::Models,
            Decision::StoredResponse(_) => Route::StoredResponse,
            Decision::Plain(rule) => Route::Plain(rule.name.clone()),
            Decision::NotFound | Decision::EngineOnly | Decision::MethodNotAllowed(_) => {
                Route::NotFound
            }
        }
    }
}

/// vLLM 0.32's endpoints that generate or change the engine but that Sluice does not build
/// in (`tests/fixtures/vllm-0.32/openapi-paths.txt`, and the development endpoints vLLM
/// serves with `VLLM_SERVER_DEV_MODE=1`): a plain route never carries them.
pub const ENGINE_ONLY: &[&str] = &[
    "/v1/chat/completions/batch",
    "/invocations",
    "/generative_scoring",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/sleep",
    "/wake_up",
    "/collective_rpc",
    "/start_profile",
    "/stop_profile",
    "/update_weights",
];

impl Router {
    pub fn new(mut rules: Vec<RouteRule>) -> Self {
        rules.sort_by(|a, b| {
            b.host
                .is_some()
                .cmp(&a.host.is_some())
                .then(b.path_prefix.len().cmp(&a.path_prefix.len()))
        });
        Self { rules }
    }

    pub fn route(&self, req: &RequestHeader) -> Decision<'_> {
        // The built-in endpoints are matched as the upstream will read the path: vLLM's
        // server decodes it, so `/v1/chat/%63ompletions` through a catch-all route reached
        // its chat endpoint unmetered.
        let normalized = unreserved_decoded(req.uri.path());
        let path = normalized.as_ref();
        if let Some((endpoint, found)) = Endpoint::route(path) {
            return if req.method == http::Method::POST {
                Decision::Llm(endpoint, found)
            } else {
                Decision::MethodNotAllowed("POST")
            };
        }
        if let Some(rest) = path.strip_prefix("/v1/responses/") {
            let (id, method, name) = match rest.strip_suffix("/cancel") {
                Some(id) => (id, http::Method::POST, "POST"),
                None => (rest, http::Method::GET, "GET"),
            };
            if !id.is_empty() && !id.contains('/') {
                return if req.method == method {
                    Decision::StoredResponse(id.to_owned())
                } else {
                    Decision::MethodNotAllowed(name)
                };
            }
        }
        if ENGINE_ONLY
            .iter()
            .any(|p| path.trim_end_matches('/').eq_ignore_ascii_case(p))
        {
            return Decision::EngineOnly;
        }
        if path == "/v1/models" {
            return if req.method == http::Method::GET {
                Decision::Models
            } else {
                Decision::MethodNotAllowed("GET")
            };
        }
        let host = request_host(req);
        self.rules
            .iter()
            .find(|r| {
                path.starts_with(&r.path_prefix)
                    && r.host
                        .as_deref()
                        .is_none_or(|h| host.is_some_and(|host| h.eq_ignore_ascii_case(host)))
            })
            .map_or(Decision::NotFound, Decision::Plain)
    }
}

/// `path` with its percent-encoded unreserved characters (letters, digits, `-._~`) decoded,
/// as RFC 3986 (6.2.2.2) holds them equivalent, and `%2F` too, which the engine's server
/// (uvicorn) decodes into a `/` before it routes; every other escape is kept. Borrowed when
/// there is none.
pub fn unreserved_decoded(path: &str) -> std::borrow::Cow<'_, str> {
    if !path.contains('%') {
        return std::borrow::Cow::Borrowed(path);
    }
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = (bytes[i] == b'%')
            .then(|| path.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok())
            .filter(|b| b.is_ascii_alphanumeric() || b"-._~/".contains(b));
        match decoded {
            Some(b) => {
                out.push(char::from(b));
                i += 3;
            }
            None => {
                // Copy up to the next `%` (char boundaries: `%` is ASCII).
                let next = path[i + 1..].find('%').map_or(bytes.len(), |at| i + 1 + at);
                out.push_str(&path[i..next]);
                i = next;
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The request's host without port: from the URI (HTTP/2, absolute form) or `Host`.
fn request_host(req: &RequestHeader) -> Option<&str> {
    let raw = req
        .uri
        .host()
        .or_else(|| req.headers.get(http::header::HOST)?.to_str().ok())?;
    Some(strip_port(raw))
}

/// `example.com:8080` → `example.com`; `[::1]:8080` → `[::1]`.
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_inclusive(']').next().unwrap_or(host);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_sdk::{BackendSpec, Pool, PoolSettings};
    use std::sync::Arc;

    #[test]
    fn escaped_unreserved_characters_are_the_built_in_endpoints_all_the_same() {
        let router = Router::new(vec![rule("all", "/", None)]);
        for path in [
            "/v1/chat/%63ompletions",
            "/v1/chat/%63%6F%6d%70letions",
            "/v1/%63hat/completions",
        ] {
            let req = RequestHeader::build("POST", path.as_bytes(), None).unwrap();
            assert!(
                matches!(
                    router.route(&req),
                    Decision::Llm(Endpoint::ChatCompletions, _)
                ),
                "{path}"
            );
        }
        // `%2F` is a `/` to the engine; other escapes stay.
        assert_eq!(unreserved_decoded("/v1%2Fchat/%zz/é%"), "/v1/chat/%zz/é%");
        let req = RequestHeader::build("POST", b"/v1/chat%2Fcompletions", None).unwrap();
        assert!(matches!(
            router.route(&req),
            Decision::Llm(Endpoint::ChatCompletions, _)
        ));
        for path in [
            "/v1/chat/completions/batch",
            "/v1/chat%2Fcompletions%2Fbatch",
            "/invocations",
            "/scale_elastic_ep/",
            "/%73leep",
        ] {
            let req = RequestHeader::build("POST", path.as_bytes(), None).unwrap();
            assert!(matches!(router.route(&req), Decision::EngineOnly), "{path}");
        }
        assert_eq!(unreserved_decoded("/a%7Eb%2d"), "/a~b-");
    }

    fn rule(name: &str, prefix: &str, host: Option<&str>) -> RouteRule {
        let resolved = ([127, 0, 0, 1], 1).into();
        let pool = Arc::new(Pool::new(PoolSettings::new(
            name,
            vec![],
            vec![BackendSpec {
                address: "127.0.0.1:1".into(),
                resolved,
                weight: 1,
            }],
        )));
        RouteRule {
            name: Arc::from(name),
            path_prefix: prefix.into(),
            host: host.map(str::to_string),
            pool,
            headers: Arc::default(),
        }
    }

    fn req(method: &str, path: &str, host: Option<&str>) -> RequestHeader {
        let mut r = RequestHeader::build(method, path.as_bytes(), None).unwrap();
        if let Some(h) = host {
            r.insert_header("host", h).unwrap();
        }
        r
    }

    fn name(d: Decision<'_>) -> String {
        match d {
            Decision::Llm(e, _) => format!("llm:{}", e.label()),
            Decision::Models => "models".into(),
            Decision::StoredResponse(id) => format!("stored:{id}"),
            Decision::Plain(r) => r.name.to_string(),
            Decision::NotFound => "404".into(),
            Decision::EngineOnly => "engine-only".into(),
            Decision::MethodNotAllowed(m) => format!("405:{m}"),
        }
    }

    #[test]
    fn builtin_endpoints_and_methods() {
        let router = Router::new(vec![]);
        assert_eq!(
            name(router.route(&req("POST", "/v1/chat/completions", None))),
            "llm:chat"
        );
        assert_eq!(
            name(router.route(&req("POST", "/v1/completions?x=1", None))),
            "llm:completions"
        );
        assert_eq!(
            name(router.route(&req("GET", "/v1/chat/completions", None))),
            "405:POST"
        );
        assert_eq!(
            name(router.route(&req("GET", "/v1/models", None))),
            "models"
        );
        assert_eq!(name(router.route(&req("GET", "/other", None))), "404");
        for (method, path, want) in [
            ("POST", "/v1/messages", "llm:messages"),
            ("POST", "/v1/messages/count_tokens", "llm:count_tokens"),
            ("POST", "/v1/responses", "llm:responses"),
            ("POST", "/tokenize", "llm:tokenize"),
            ("POST", "/v1/embeddings", "llm:embeddings"),
            ("GET", "/v1/responses/resp_1", "stored:resp_1"),
            ("POST", "/v1/responses/resp_1/cancel", "stored:resp_1"),
            ("DELETE", "/v1/responses/resp_1", "405:GET"),
            ("GET", "/v1/responses/resp_1/cancel", "405:POST"),
            // Matched as vLLM reads them: decoded.
            ("GET", "/v1/respon%73es/resp_%31", "stored:resp_1"),
            ("POST", "/v1/responses/resp_1/cance%6c", "stored:resp_1"),
        ] {
            assert_eq!(
                name(router.route(&req(method, path, None))),
                want,
                "{method} {path}"
            );
        }
    }

    #[test]
    fn host_routes_win_then_the_longest_prefix() {
        let router = Router::new(vec![
            rule("short", "/", None),
            rule("long", "/api/v2", None),
            rule("hosted", "/api", Some("api.example.com")),
        ]);
        assert_eq!(name(router.route(&req("GET", "/api/v2/x", None))), "long");
        assert_eq!(
            name(router.route(&req("GET", "/api/v2/x", Some("API.example.com:8080")))),
            "hosted"
        );
        assert_eq!(
            name(router.route(&req("GET", "/elsewhere", Some("api.example.com")))),
            "short"
        );
    }
}
