//! The header names Sluice reads and writes, in one place for the core and the plugins.
//! Defaults for configurable names are here too; the plugin's config may choose another.

use http::{HeaderMap, HeaderName};
use pingora_http::ResponseHeader;

/// The headers that are always one connection's (hop-by-hop), whatever `Connection` says:
/// the proxy removes them before forwarding, and no header rule may set them.
pub const HOP_BY_HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// The pool that produced an answer.
pub const POOL: HeaderName = HeaderName::from_static("x-sluice-pool");
/// Why a request went to its escalation target.
pub const ESCALATED: HeaderName = HeaderName::from_static("x-sluice-escalated");
/// The cache's part in an answer: `HIT`, `MISS` or `BYPASS`.
pub const CACHE: HeaderName = HeaderName::from_static("x-cache");
/// Why Sluice answered with an error of its own (the error body's reason, as a header).
pub const REJECTED: HeaderName = HeaderName::from_static("x-sluice-rejected");
/// The default header a client names its priority class with.
pub const PRIORITY: HeaderName = HeaderName::from_static("x-sluice-priority");
/// The time to first token a request aims at, in milliseconds.
pub const TTFT_SLO_MS: HeaderName = HeaderName::from_static("x-sluice-ttft-slo-ms");
/// The default header a client asks for a pool tier with (`draft`, `target`).
pub const TIER: HeaderName = HeaderName::from_static("x-sluice-tier");
/// The default request-id header.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Whether a response is a Server-Sent Events stream.
pub fn is_event_stream(header: &ResponseHeader) -> bool {
    header
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// Edits a response's headers as the `http::HeaderMap` they are, with names the caller has
/// already made (`HeaderName::from_static`). Pingora's `insert_header` parses and copies a
/// name on every call and keeps a second map of the names' original case: for the headers
/// Sluice adds to every answer that was most of their cost. The header comes back without
/// that second map, so the case the upstream wrote its names in is not kept either: on
/// HTTP/1.1 Pingora then writes a dozen common names title-cased (`Content-Type`, `Date`,
/// `Server`, ...) and every other name lower-case (`etag`, `location`). HTTP/2 sends every
/// name lower-case anyway; names are case-insensitive (RFC 9110), and Envoy lower-cases
/// them all. A reason phrase other than the status's own is kept.
pub fn edit<R>(header: &mut ResponseHeader, edit: impl FnOnce(&mut HeaderMap) -> R) -> R {
    let custom_reason = match header.get_reason_phrase() {
        Some(reason) if Some(reason) != header.status.canonical_reason() => Some(reason.to_owned()),
        _ => None,
    };
    // An empty map and no extensions: allocates nothing.
    let placeholder = ResponseHeader::from(http::Response::new(()).into_parts().0);
    let mut parts: http::response::Parts = std::mem::replace(header, placeholder).into();
    let result = edit(&mut parts.headers);
    *header = ResponseHeader::from(parts);
    if custom_reason.is_some() {
        // Only the status is checked, and it is the one the phrase came with.
        let _ = header.set_reason_phrase(custom_reason.as_deref());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn an_edit_adds_to_what_the_header_had_and_keeps_its_status_and_reason() {
        let mut header = ResponseHeader::build(299, None).unwrap();
        header
            .insert_header("Content-Type", "application/json")
            .unwrap();
        header.append_header("x-upstream", "a").unwrap();
        header.append_header("x-upstream", "b").unwrap();
        header.insert_header("ETag", "\"v1\"").unwrap();
        header.set_reason_phrase(Some("Fine By Me")).unwrap();
        let returned = edit(&mut header, |map| {
            map.insert(POOL, HeaderValue::from_static("draft"));
            map.len()
        });
        assert_eq!(returned, 5);
        assert_eq!(header.status.as_u16(), 299);
        assert_eq!(header.get_reason_phrase(), Some("Fine By Me"));
        assert_eq!(header.headers["content-type"], "application/json");
        let upstream: Vec<_> = header.headers.get_all("x-upstream").iter().collect();
        assert_eq!(upstream, ["a", "b"]);
        assert_eq!(header.headers[POOL], "draft");
        // Pingora's own methods still work on the edited header, and it writes as HTTP/1.1.
        header.insert_header("x-later", "1").unwrap();
        let mut wire = Vec::new();
        header.header_to_h1_wire(&mut wire);
        let wire = String::from_utf8(wire).unwrap();
        for line in [
            "Content-Type: application/json\r\n",
            "x-upstream: a\r\n",
            "x-upstream: b\r\n",
            "x-sluice-pool: draft\r\n",
            "x-later: 1\r\n",
            // The upstream's own case is not kept, beyond Pingora's dozen common names.
            "etag: \"v1\"\r\n",
        ] {
            assert!(wire.contains(line), "{line:?} missing from {wire:?}");
        }
    }

    #[test]
    fn a_canonical_reason_stays_implicit() {
        let mut header = ResponseHeader::build(200, None).unwrap();
        edit(&mut header, |_| ());
        assert_eq!(header.get_reason_phrase(), Some("OK"));
    }
}
