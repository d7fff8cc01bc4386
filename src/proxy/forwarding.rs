//! What a proxy hop removes and adds, both ways, as RFC 9110 asks of an intermediary:
//!
//! - Hop-by-hop headers describe one connection, never the message: the fixed ones
//!   (`connection`, `keep-alive`, `proxy-connection`, `te`, `trailer`, `upgrade`) and every
//!   header the `Connection` header names are removed from requests sent upstream and from
//!   answers sent back. (Message framing, `transfer-encoding` and `content-length`, is set by
//!   whoever writes the message.)
//! - `X-Forwarded-For` and `Forwarded` tell the upstream who the client is: the peer's
//!   address is appended to what a trusted proxy in front sent, and replaces what anyone else
//!   sent (a client cannot plant an address the upstream would believe).
//! - What the pool and the route say ([`to_pool`], [`from_pool`]), for both paths, here and
//!   nowhere else: the client's own API key headers removed (a backend never sees a tenant's
//!   key, unless the pool forwards them), the pool's credential added, then the pool's header
//!   rules and the route's (nginx's `proxy_set_header`, `add_header`, `proxy_hide_header`).

use ipnet::IpNet;
use pingora_error::Result;
use pingora_http::{RequestHeader, ResponseHeader};
use sluice_sdk::header_rules::CLIENT_KEY_HEADERS;
use sluice_sdk::{HeaderRules, Pool};
use std::net::IpAddr;

use super::client::is_trusted;

use sluice_sdk::headers::HOP_BY_HOP;

/// Headers that are never one connection's, whatever `Connection` says: the message's framing
/// and its target, which this hop sets for the next. Named in `Connection` (a client's
/// `Connection: content-length`), removing them would send an LLM request upstream without
/// its length, so with an empty body, or without its `Host`.
const NEVER_CONNECTION_OPTIONS: [&str; 3] = ["content-length", "transfer-encoding", "host"];

/// The headers the message's `Connection` header names, lower-cased, but for the framing
/// ones ([`NEVER_CONNECTION_OPTIONS`]).
fn connection_named(headers: &http::HeaderMap) -> Vec<String> {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty() && !NEVER_CONNECTION_OPTIONS.contains(&name.as_str()))
        .collect()
}

/// What a request sent to `pool` (by `route`, for a plain route) carries: no client key unless
/// the pool forwards it, the pool's credential, the pool's rules, the route's.
/// A key that identified a tenant (`tenant_key`) never goes upstream, whatever the pool says.
pub fn to_pool(
    header: &mut RequestHeader,
    pool: &Pool,
    route: Option<&HeaderRules>,
    tenant_key: bool,
) -> Result<()> {
    // Removed before the pool's credential is added: the credential may use the same header.
    if !pool.settings.forward_client_key || tenant_key {
        for name in CLIENT_KEY_HEADERS {
            header.remove_header(name);
        }
    }
    if let Some(auth) = &pool.settings.upstream_auth {
        header.insert_header(auth.header.clone(), auth.value.clone())?;
    }
    pool.settings.headers.apply_to_request(header)?;
    if let Some(route) = route {
        route.apply_to_request(header)?;
    }
    Ok(())
}

/// What an answer from `pool` (by `route`) carries back: the pool's rules, then the route's.
pub fn from_pool(
    header: &mut ResponseHeader,
    pool: Option<&Pool>,
    route: Option<&HeaderRules>,
) -> Result<()> {
    if let Some(pool) = pool {
        pool.settings.headers.apply_to_response(header)?;
    }
    if let Some(route) = route {
        route.apply_to_response(header)?;
    }
    Ok(())
}

/// Removes the hop-by-hop headers from an answer on its way to the client.
pub fn strip_response(header: &mut ResponseHeader) {
    for name in connection_named(&header.headers) {
        header.remove_header(&name);
    }
    for name in HOP_BY_HOP {
        header.remove_header(name);
    }
}

/// Removes the hop-by-hop headers from a request on its way upstream, and says who sent it.
pub fn prepare_request(
    header: &mut RequestHeader,
    peer: Option<IpAddr>,
    trusted: &[IpNet],
) -> Result<()> {
    for name in connection_named(&header.headers) {
        header.remove_header(&name);
    }
    for name in HOP_BY_HOP {
        header.remove_header(name);
    }
    let Some(peer) = peer else {
        return Ok(());
    };
    let keep = is_trusted(peer, trusted);
    let joined = |name: &str| -> Option<String> {
        let values: Vec<&str> = header
            .headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        (keep && !values.is_empty()).then(|| values.join(", "))
    };
    let forwarded_for = match joined("x-forwarded-for") {
        Some(earlier) => format!("{earlier}, {peer}"),
        None => peer.to_string(),
    };
    let node = match peer {
        IpAddr::V4(v4) => format!("for={v4}"),
        IpAddr::V6(v6) => format!("for=\"[{v6}]\""),
    };
    let forwarded = match joined("forwarded") {
        Some(earlier) => format!("{earlier}, {node}"),
        None => node,
    };
    header.insert_header("x-forwarded-for", forwarded_for)?;
    header.insert_header("forwarded", forwarded)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> RequestHeader {
        let mut h = RequestHeader::build("POST", b"/v1/completions", None).unwrap();
        for (name, value) in headers {
            h.append_header(name.to_string(), *value).unwrap();
        }
        h
    }

    #[test]
    fn headers_the_connection_header_names_are_removed_both_ways() {
        let mut up = request(&[
            ("connection", "close, X-Secret"),
            ("x-secret", "1"),
            ("te", "trailers"),
            ("authorization", "Bearer k"),
        ]);
        prepare_request(&mut up, None, &[]).unwrap();
        assert!(up.headers.get("x-secret").is_none());
        assert!(up.headers.get("connection").is_none());
        assert!(up.headers.get("te").is_none());
        assert_eq!(up.headers.get("authorization").unwrap(), "Bearer k");

        let mut down = ResponseHeader::build(200, None).unwrap();
        down.append_header("connection", "x-internal").unwrap();
        down.append_header("x-internal", "1").unwrap();
        down.append_header("upgrade", "h2c").unwrap();
        down.append_header("content-type", "application/json")
            .unwrap();
        strip_response(&mut down);
        assert!(down.headers.get("x-internal").is_none());
        assert!(down.headers.get("upgrade").is_none());
        assert!(down.headers.get("content-type").is_some());
    }

    #[test]
    fn the_connection_header_cannot_remove_the_framing_or_the_host() {
        let mut up = request(&[
            (
                "connection",
                "keep-alive, Content-Length, host, transfer-encoding",
            ),
            ("content-length", "12"),
            ("host", "api.example"),
        ]);
        prepare_request(&mut up, None, &[]).unwrap();
        assert_eq!(up.headers.get("content-length").unwrap(), "12");
        assert_eq!(up.headers.get("host").unwrap(), "api.example");
        assert!(up.headers.get("connection").is_none());
    }

    #[test]
    fn forwarded_for_is_appended_for_trusted_proxies_and_replaced_for_anyone_else() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let proxy: IpAddr = "10.1.2.3".parse().unwrap();
        let stranger: IpAddr = "203.0.113.9".parse().unwrap();

        let mut via_proxy = request(&[("x-forwarded-for", "198.51.100.7")]);
        prepare_request(&mut via_proxy, Some(proxy), &trusted).unwrap();
        assert_eq!(
            via_proxy.headers.get("x-forwarded-for").unwrap(),
            "198.51.100.7, 10.1.2.3"
        );
        assert_eq!(via_proxy.headers.get("forwarded").unwrap(), "for=10.1.2.3");

        let mut spoofed = request(&[("x-forwarded-for", "1.2.3.4"), ("forwarded", "for=1.2.3.4")]);
        prepare_request(&mut spoofed, Some(stranger), &trusted).unwrap();
        assert_eq!(
            spoofed.headers.get("x-forwarded-for").unwrap(),
            "203.0.113.9"
        );
        assert_eq!(spoofed.headers.get("forwarded").unwrap(), "for=203.0.113.9");

        let mut v6 = request(&[]);
        prepare_request(&mut v6, Some("::1".parse().unwrap()), &trusted).unwrap();
        assert_eq!(v6.headers.get("forwarded").unwrap(), "for=\"[::1]\"");
    }

    proptest::proptest! {
        /// Whatever a client's `Connection` and `X-Forwarded-For` say, the request goes
        /// upstream framed (its `content-length` and `host` kept), with no hop-by-hop header
        /// and with the peer last in `x-forwarded-for`; no input panics the rules.
        #[test]
        fn any_connection_header_leaves_the_request_framed(
            tokens in proptest::collection::vec(
                "content-length|host|transfer-encoding|keep-alive|x-[a-z]{1,6}|upgrade|te|[ -~]{0,12}",
                0..6,
            ),
            forwarded in "[ -~]{0,40}",
            trusted in proptest::bool::ANY,
        ) {
            let connection = tokens.join(",");
            let mut pairs = vec![
                ("content-length", "12"),
                ("host", "backend"),
                ("x-keep", "1"),
                ("x-forwarded-for", forwarded.as_str()),
            ];
            if http::HeaderValue::from_str(&connection).is_ok() {
                pairs.push(("connection", connection.as_str()));
            }
            pairs.retain(|(_, v)| http::HeaderValue::from_str(v).is_ok());
            let mut h = request(&pairs);
            let peer: IpAddr = "10.1.2.3".parse().unwrap();
            let nets: Vec<IpNet> = if trusted {
                vec!["10.0.0.0/8".parse().unwrap()]
            } else {
                Vec::new()
            };
            prepare_request(&mut h, Some(peer), &nets).unwrap();
            proptest::prop_assert_eq!(h.headers.get("content-length").map(|v| v.as_bytes()), Some(&b"12"[..]));
            proptest::prop_assert_eq!(h.headers.get("host").map(|v| v.as_bytes()), Some(&b"backend"[..]));
            for name in sluice_sdk::headers::HOP_BY_HOP {
                proptest::prop_assert!(h.headers.get(name).is_none(), "{} kept", name);
            }
            let xff = h.headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()).unwrap_or_default();
            proptest::prop_assert!(xff.ends_with("10.1.2.3"), "{}", xff);
        }
    }
}
