//! What the cache may do with a request, and for how long an answer is kept.

use crate::config::{CacheConfig, Cacheable};
use http::HeaderMap;
use sluice_sdk::family::CacheUse;
use sluice_sdk::{Endpoint, LlmCall, LlmRequest};
use std::time::Duration;

/// The cache's part in one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Neither looked up nor stored (`x-cache: BYPASS`): `no-store`, or a sampled request
    /// under `cacheable: deterministic`.
    Bypass,
    /// `cache-control: no-cache`: go upstream, but the answer may be stored.
    StoreOnly,
    /// Look up, and store on a miss.
    LookupAndStore,
}

pub fn decide(config: &CacheConfig, call: &LlmCall, headers: &HeaderMap) -> Use {
    let request = &call.request;
    // The family says whether its answers may be kept at all (a stored response may not).
    let family_use = call.endpoint.family().cache_use(request);
    let (mut no_cache, mut no_store) = (false, false);
    for value in headers.get_all(http::header::CACHE_CONTROL) {
        for directive in value.to_str().unwrap_or("").split(',') {
            let d = directive.trim();
            no_store |= d.eq_ignore_ascii_case("no-store");
            no_cache |= d.eq_ignore_ascii_case("no-cache");
        }
    }
    if no_store || family_use == CacheUse::Never {
        return Use::Bypass;
    }
    if family_use == CacheUse::IfDeterministic
        && config.cacheable == Cacheable::Deterministic
        && !is_deterministic(request)
    {
        return Use::Bypass;
    }
    if no_cache {
        Use::StoreOnly
    } else {
        Use::LookupAndStore
    }
}

/// Greedy decoding or a fixed seed: the same request gives the same answer.
fn is_deterministic(request: &LlmRequest) -> bool {
    request.temperature == Some(0.0) || request.seed.is_some()
}

/// The entry's lifetime: by model, else by endpoint, else the default.
pub fn ttl(config: &CacheConfig, model: Option<&str>, endpoint: Endpoint) -> Duration {
    let by_model = model.and_then(|m| config.ttl_by_model.get(m));
    by_model
        .or_else(|| config.ttl_by_endpoint.get(endpoint.label()))
        .map_or(config.ttl, |d| d.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HumanDuration;

    fn request(json: &str) -> LlmCall {
        at(Endpoint::ChatCompletions, json)
    }

    fn at(endpoint: Endpoint, json: &str) -> LlmCall {
        LlmCall::parse(endpoint, bytes::Bytes::from(json.to_owned())).unwrap()
    }

    fn headers(cache_control: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = cache_control {
            h.insert("cache-control", v.parse().unwrap());
        }
        h
    }

    const GREEDY: &str = r#"{"messages":[{"role":"user","content":"x"}],"temperature":0}"#;
    const SEEDED: &str =
        r#"{"messages":[{"role":"user","content":"x"}],"temperature":0.8,"seed":3}"#;
    const SAMPLED: &str = r#"{"messages":[{"role":"user","content":"x"}]}"#;

    #[test]
    fn only_deterministic_requests_by_default() {
        let c = CacheConfig::default();
        assert_eq!(
            decide(&c, &request(GREEDY), &headers(None)),
            Use::LookupAndStore
        );
        assert_eq!(
            decide(&c, &request(SEEDED), &headers(None)),
            Use::LookupAndStore
        );
        assert_eq!(decide(&c, &request(SAMPLED), &headers(None)), Use::Bypass);
        let all = CacheConfig {
            cacheable: Cacheable::All,
            ..CacheConfig::default()
        };
        assert_eq!(
            decide(&all, &request(SAMPLED), &headers(None)),
            Use::LookupAndStore
        );
    }

    #[test]
    fn each_family_says_what_may_be_kept() {
        let c = CacheConfig::default();
        let none = headers(None);
        // Embeddings do not sample: kept without a seed.
        let embed = at(Endpoint::Embeddings, r#"{"model":"e","input":"x"}"#);
        assert_eq!(decide(&c, &embed, &none), Use::LookupAndStore);
        // A stored response is for follow-ups: never kept; one not stored is, when greedy.
        let stored = at(Endpoint::Responses, r#"{"input":"x","temperature":0}"#);
        assert_eq!(decide(&c, &stored, &none), Use::Bypass);
        let unstored = at(
            Endpoint::Responses,
            r#"{"input":"x","temperature":0,"store":false}"#,
        );
        assert_eq!(decide(&c, &unstored, &none), Use::LookupAndStore);
        let tokenize = at(Endpoint::Tokenize, r#"{"prompt":"x"}"#);
        assert_eq!(decide(&c, &tokenize, &none), Use::Bypass);
        let messages = at(
            Endpoint::Messages,
            r#"{"max_tokens":3,"messages":[{"role":"user","content":"x"}],"temperature":0}"#,
        );
        assert_eq!(decide(&c, &messages, &none), Use::LookupAndStore);
    }

    #[test]
    fn cache_control_in_http_terms() {
        let c = CacheConfig::default();
        assert_eq!(
            decide(&c, &request(GREEDY), &headers(Some("no-cache"))),
            Use::StoreOnly
        );
        assert_eq!(
            decide(&c, &request(GREEDY), &headers(Some("max-age=0, No-Store"))),
            Use::Bypass
        );
    }

    #[test]
    fn ttl_by_model_then_endpoint_then_default() {
        let mut c = CacheConfig::default();
        c.ttl_by_model
            .insert("big".into(), HumanDuration(Duration::from_secs(5)));
        c.ttl_by_endpoint
            .insert("completions".into(), HumanDuration(Duration::from_secs(7)));
        assert_eq!(
            ttl(&c, Some("big"), Endpoint::Completions),
            Duration::from_secs(5)
        );
        assert_eq!(
            ttl(&c, Some("small"), Endpoint::Completions),
            Duration::from_secs(7)
        );
        assert_eq!(ttl(&c, Some("small"), Endpoint::ChatCompletions), c.ttl);
    }
}
