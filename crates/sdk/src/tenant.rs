//! Who is calling: the tenant the `tenants` plugin identified from the request's API key (or
//! from a trusted proxy's header), and what it may ask for.
//!
//! Every plugin that decides by tenant (the breaker's priority class, the selector's forced
//! tier, the cache's isolation) reads it here, never from a client's own headers: a client
//! can claim any header, not another tenant's key.

use crate::pool::Priority;
use std::sync::Arc;

/// The tenant a request was identified as ([`crate::RequestCtx::tenant`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    /// The tenant's configured name; [`Tenant::ANONYMOUS`] for a request let in without a key.
    pub name: Arc<str>,
    /// Identified by a key or a trusted proxy, rather than let in anonymously.
    pub identified: bool,
    /// The class its requests get when they name none; `None`: the breaker's default.
    pub default_priority: Option<Priority>,
    /// The highest class its requests may claim; `None`: the breaker's `priority.max`.
    pub max_priority: Option<Priority>,
    /// Whether it may force the target tier of a speculative model.
    pub may_force_target: bool,
    /// The time to first token its requests aim at when they name none
    /// (`x-sluice-ttft-slo-ms`): the order among equals in a pool's queue, and a sheddable
    /// request no backend can serve in time is refused at once.
    pub ttft_slo: Option<std::time::Duration>,
}

impl Tenant {
    /// The name of the tenant of requests without identity, when the operator lets them in.
    pub const ANONYMOUS: &'static str = "anonymous";
}

/// The API key a request presents: `Authorization: Bearer <key>` (the scheme in any case, as
/// RFC 9110 has it), else `x-api-key` (Anthropic's and many gateways'), else `api-key` (Azure
/// OpenAI's). Surrounding blanks are not part of it; an empty key is none.
pub fn api_key(headers: &http::HeaderMap) -> Option<&[u8]> {
    // Names made once: a `&str` name is parsed at every lookup.
    static X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");
    static API_KEY: http::HeaderName = http::HeaderName::from_static("api-key");
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes().trim_ascii())
        .and_then(|v| {
            let (scheme, rest) = v.split_at_checked(6)?;
            (scheme.eq_ignore_ascii_case(b"bearer") && rest.first() == Some(&b' ')).then_some(rest)
        });
    bearer
        .or_else(|| headers.get(&X_API_KEY).map(|v| v.as_bytes()))
        .or_else(|| headers.get(&API_KEY).map(|v| v.as_bytes()))
        .map(<[u8]>::trim_ascii)
        .filter(|key| !key.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| (http::HeaderName::from_static(n), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn a_key_is_read_from_each_header_clients_send_it_in() {
        let key = |pairs| api_key(&headers(pairs)).map(|k| k.to_vec());
        assert_eq!(
            key(&[("authorization", "Bearer sk-1")]),
            Some(b"sk-1".to_vec())
        );
        assert_eq!(
            key(&[("authorization", "BEARER  sk-1 ")]),
            Some(b"sk-1".to_vec())
        );
        assert_eq!(key(&[("x-api-key", "sk-2")]), Some(b"sk-2".to_vec()));
        assert_eq!(key(&[("api-key", "sk-3")]), Some(b"sk-3".to_vec()));
        assert_eq!(
            key(&[("authorization", "Bearer sk-1"), ("x-api-key", "sk-2")]),
            Some(b"sk-1".to_vec()),
            "Authorization first"
        );
        assert_eq!(key(&[("authorization", "Basic dXNlcg==")]), None);
        assert_eq!(key(&[("authorization", "Bearer ")]), None);
        assert_eq!(key(&[("authorization", "Bearersk-1")]), None);
        assert_eq!(key(&[]), None);
    }
}
