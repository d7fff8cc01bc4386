//! The `request_id` plugin: every request gets an id that follows it upstream, back to the
//! client and into the access log.
//!
//! The id is the client's own `x-request-id` when it sends a sane one (visible ASCII, at
//! most 128 bytes), otherwise a fresh one: 32 hex digits, unique per process and start.
//!
//! ```yaml
//! plugins:
//!   request_id:
//!     enabled: true
//!     header: x-request-id   # the header to read, send upstream and return
//! ```

use http::{HeaderName, HeaderValue};
use serde::Deserialize;
use sluice_sdk::config::header_name;
use sluice_sdk::error::internal;
use sluice_sdk::{
    async_trait, headers, AttemptStart, Bytes, Client, ConfigError, Host, Plugin, PluginBuilder,
    RequestCtx, RequestHeader, ResponseHeader, Result,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// The plugin's config section.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RequestIdConfig {
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    #[serde(default = "default_header")]
    pub header: String,
}

fn default_enabled() -> bool {
    true
}

fn default_header() -> String {
    headers::REQUEST_ID.as_str().into()
}

impl Default for RequestIdConfig {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            header: default_header(),
        }
    }
}

/// Longest client-supplied id kept as is; longer ones are replaced.
const MAX_CLIENT_ID_LEN: usize = 128;

/// The section, checked: the header to use.
pub struct RequestIdBuilder {
    header: HeaderName,
}

impl PluginBuilder for RequestIdBuilder {
    const NAME: &'static str = "request_id";
    type Config = RequestIdConfig;

    fn resolve(
        config: RequestIdConfig,
        _host: &Host,
    ) -> std::result::Result<Option<Self>, ConfigError> {
        let header = header_name("header", &config.header)?;
        Ok(config.enabled.then_some(Self { header }))
    }

    fn start(self) -> Arc<dyn Plugin> {
        Arc::new(RequestId::new(self.header))
    }
}

pub struct RequestId {
    header: HeaderName,
    /// The header's name as Pingora's case map keeps it, made once: inserting a `HeaderName`
    /// copies its bytes into a new buffer on every request. The same (lowercase) bytes.
    case_name: Bytes,
    /// Ids are `<start time><counter>`: unique without a random source or a lock.
    prefix: u64,
    counter: AtomicU64,
}

impl RequestId {
    pub fn new(header: HeaderName) -> Self {
        let prefix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 48);
        Self {
            case_name: Bytes::copy_from_slice(header.as_str().as_bytes()),
            header,
            prefix,
            counter: AtomicU64::new(0),
        }
    }

    fn next_id(&self) -> HeaderValue {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let mut id = [0u8; 32];
        let (prefix, count) = id.split_at_mut(16);
        // Both halves are exactly 16 hex digits long: neither can fail.
        let _ = hex::encode_to_slice(self.prefix.to_be_bytes(), prefix);
        let _ = hex::encode_to_slice(n.to_be_bytes(), count);
        HeaderValue::from_bytes(&id).unwrap_or(HeaderValue::from_static("0"))
    }
}

fn is_acceptable(id: &[u8]) -> bool {
    !id.is_empty() && id.len() <= MAX_CLIENT_ID_LEN && id.iter().all(|b| b.is_ascii_graphic())
}

#[async_trait]
impl Plugin for RequestId {
    fn name(&self) -> &'static str {
        "request_id"
    }

    async fn early_request(&self, client: &mut dyn Client, ctx: &mut RequestCtx) -> Result<()> {
        let from_client = client
            .request_header()
            .headers
            .get(&self.header)
            .filter(|v| is_acceptable(v.as_bytes()))
            .cloned();
        ctx.set_request_id(from_client.unwrap_or_else(|| self.next_id()));
        Ok(())
    }

    fn upstream_request(
        &self,
        request: &mut RequestHeader,
        _attempt: &AttemptStart<'_>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let Some(value) = ctx.request_id_value() {
            request
                .insert_header(self.case_name.clone(), value.clone())
                .map_err(internal)?;
        }
        Ok(())
    }

    fn response_header(&self, response: &mut ResponseHeader, ctx: &mut RequestCtx) -> Result<()> {
        if let Some(value) = ctx.request_id_value() {
            let value = value.clone();
            sluice_sdk::headers::edit(response, |map| map.insert(self.header.clone(), value));
        }
        Ok(())
    }

    fn response_headers_added(&self) -> usize {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_testkit::FakeClient;

    #[test]
    fn generated_ids_are_unique_hex() {
        let p = RequestId::new(headers::REQUEST_ID);
        let a = p.next_id();
        let b = p.next_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(a.as_bytes().iter().all(|c| c.is_ascii_hexdigit()));
        // The counter is the second half: the first two ids differ only there.
        assert_eq!(a.as_bytes()[..16], b.as_bytes()[..16]);
        assert_eq!(&a.as_bytes()[16..], b"0000000000000000");
        assert_eq!(&b.as_bytes()[16..], b"0000000000000001");
    }

    #[tokio::test]
    async fn the_clients_sane_id_is_kept_and_any_other_replaced_by_a_fresh_one() {
        let p = RequestId::new(headers::REQUEST_ID);
        let id_of = |client: FakeClient| {
            let p = &p;
            async move {
                let mut client = client;
                let mut ctx = RequestCtx::new();
                p.early_request(&mut client, &mut ctx).await.unwrap();
                ctx.request_id().unwrap().to_owned()
            }
        };
        let asked = || FakeClient::post("/v1/chat/completions");
        assert_eq!(
            id_of(asked().with_header("x-request-id", "abc-123")).await,
            "abc-123"
        );
        for made in [
            id_of(asked()).await,
            id_of(asked().with_header("x-request-id", "has space")).await,
        ] {
            assert_eq!(made.len(), 32, "{made}");
            assert!(made.bytes().all(|c| c.is_ascii_hexdigit()), "{made}");
        }
    }

    #[test]
    fn client_ids_are_kept_only_when_sane() {
        assert!(is_acceptable(b"abc-123"));
        assert!(!is_acceptable(b""));
        assert!(!is_acceptable(b"has space"));
        assert!(!is_acceptable(&[b'a'; MAX_CLIENT_ID_LEN + 1]));
    }

    #[test]
    fn sets_the_header_on_the_upstream_request_and_the_response() {
        let p = RequestId::new(headers::REQUEST_ID);
        let mut ctx = RequestCtx::new();
        ctx.set_request_id(HeaderValue::from_static("rid-1"));
        let mut req = RequestHeader::build("POST", b"/v1/completions", None).unwrap();
        let span = tracing::Span::none();
        let attempt = AttemptStart {
            number: 1,
            pool: "main",
            backend: ([127, 0, 0, 1], 8000).into(),
            span: &span,
            prefill_leg: false,
        };
        p.upstream_request(&mut req, &attempt, &mut ctx).unwrap();
        assert_eq!(req.headers.get("x-request-id").unwrap(), "rid-1");
        let mut resp = ResponseHeader::build(200, None).unwrap();
        p.response_header(&mut resp, &mut ctx).unwrap();
        assert_eq!(resp.headers.get("x-request-id").unwrap(), "rid-1");
    }

    #[test]
    fn rejects_an_invalid_header_name() {
        let bad = RequestIdConfig {
            header: "bad header".into(),
            ..RequestIdConfig::default()
        };
        let host = Host {
            pools: Arc::new(sluice_sdk::Pools::new(Vec::new())),
            memory: sluice_sdk::MemoryBudget::new(1 << 20),
            calls: Arc::new(sluice_sdk::calls::NoPools),
        };
        let e = RequestIdBuilder::resolve(bad, &host).err().unwrap();
        assert_eq!(e.key, "header");
        assert!(e
            .message
            .contains("`bad header` is not a valid header name"));
    }
}
