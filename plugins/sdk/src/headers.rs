//! The header names Sluice reads and writes, in one place for the core and the plugins.
//! Defaults for configurable names are here too; the plugin's config may choose another.

use http::HeaderName;
use pingora_http::ResponseHeader;

/// [`POOL`]'s name as a static string: Pingora's `insert_header` takes it without copying
/// it per request (a `HeaderName` is copied into its case map each time).
pub const POOL_STR: &str = "x-sluice-pool";
/// The pool that produced an answer.
pub const POOL: HeaderName = HeaderName::from_static(POOL_STR);
/// Why a request went to its escalation target.
pub const ESCALATED: HeaderName = HeaderName::from_static("x-sluice-escalated");
/// [`CACHE`]'s name as a static string, for `insert_header` (as [`POOL_STR`]).
pub const CACHE_STR: &str = "x-cache";
/// The cache's part in an answer: `HIT`, `MISS` or `BYPASS`.
pub const CACHE: HeaderName = HeaderName::from_static(CACHE_STR);
/// Why Sluice answered with an error of its own (the error body's reason, as a header).
pub const REJECTED: HeaderName = HeaderName::from_static("x-sluice-rejected");
/// The default header a client names its priority class with.
pub const PRIORITY: HeaderName = HeaderName::from_static("x-sluice-priority");
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
