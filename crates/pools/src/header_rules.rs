//! Header rules, nginx's `proxy_set_header`, `add_header` and `proxy_hide_header`: what a pool
//! or a route changes in the requests it sends upstream and in the answers it sends back.
//! The core applies them in one place per direction, after its own header hygiene and before
//! the plugins' hooks.

use http::{HeaderName, HeaderValue};
use pingora_error::Result;
use pingora_http::{RequestHeader, ResponseHeader};

/// One pool's or one route's rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderRules {
    /// Set on requests sent upstream, replacing the client's (nginx `proxy_set_header`).
    pub request_set: Vec<(HeaderName, HeaderValue)>,
    /// Removed from requests sent upstream (nginx `proxy_set_header X ""`).
    pub request_remove: Vec<HeaderName>,
    /// Set on answers sent back, replacing the upstream's (nginx `add_header`, which only
    /// adds).
    pub response_set: Vec<(HeaderName, HeaderValue)>,
    /// Removed from answers sent back (nginx `proxy_hide_header`).
    pub response_hide: Vec<HeaderName>,
}

impl HeaderRules {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.request_set.is_empty()
            && self.request_remove.is_empty()
            && self.response_set.is_empty()
            && self.response_hide.is_empty()
    }

    /// Applies the request rules to a request on its way upstream.
    pub fn apply_to_request(&self, header: &mut RequestHeader) -> Result<()> {
        for name in &self.request_remove {
            header.remove_header(name);
        }
        for (name, value) in &self.request_set {
            header.insert_header(name.clone(), value.clone())?;
        }
        Ok(())
    }

    /// Applies the response rules to an answer on its way to the client.
    pub fn apply_to_response(&self, header: &mut ResponseHeader) -> Result<()> {
        for name in &self.response_hide {
            header.remove_header(name);
        }
        for (name, value) in &self.response_set {
            header.insert_header(name.clone(), value.clone())?;
        }
        Ok(())
    }
}

/// The credential a pool's backends demand (vLLM's `--api-key`): a header and its value, read
/// from the environment or a file when the config is loaded. The value is marked sensitive, so
/// debug output shows no secret.
#[derive(Clone, PartialEq, Eq)]
pub struct UpstreamAuth {
    /// `authorization` unless configured otherwise.
    pub header: HeaderName,
    /// `Bearer <secret>` for `authorization`, else the secret as it is.
    pub value: HeaderValue,
}

impl std::fmt::Debug for UpstreamAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamAuth")
            .field("header", &self.header)
            .field("value", &"<secret>")
            .finish()
    }
}

/// The headers a client may present its own API key in: never sent upstream unless a pool
/// says so (`forward_client_key`), so a tenant's key does not reach a backend.
pub const CLIENT_KEY_HEADERS: [&str; 3] = ["authorization", "x-api-key", "api-key"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_set_remove_and_hide_both_ways() {
        let rules = HeaderRules {
            request_set: vec![(
                HeaderName::from_static("x-team"),
                HeaderValue::from_static("llm"),
            )],
            request_remove: vec![HeaderName::from_static("x-debug")],
            response_set: vec![(
                HeaderName::from_static("strict-transport-security"),
                HeaderValue::from_static("max-age=31536000"),
            )],
            response_hide: vec![HeaderName::from_static("server")],
        };
        let mut request = RequestHeader::build("POST", b"/v1/chat/completions", None).unwrap();
        request.insert_header("x-team", "spoofed").unwrap();
        request.insert_header("x-debug", "1").unwrap();
        rules.apply_to_request(&mut request).unwrap();
        assert_eq!(request.headers["x-team"], "llm");
        assert!(request.headers.get("x-debug").is_none());

        let mut response = ResponseHeader::build(200, None).unwrap();
        response.insert_header("server", "uvicorn").unwrap();
        rules.apply_to_response(&mut response).unwrap();
        assert!(response.headers.get("server").is_none());
        assert_eq!(
            response.headers["strict-transport-security"],
            "max-age=31536000"
        );
        assert!(!rules.is_empty() && HeaderRules::default().is_empty());
    }

    #[test]
    fn an_upstream_credential_never_shows_in_debug_output() {
        let mut value = HeaderValue::from_static("Bearer s3cret");
        value.set_sensitive(true);
        let auth = UpstreamAuth {
            header: HeaderName::from_static("authorization"),
            value,
        };
        assert!(!format!("{auth:?}").contains("s3cret"));
    }
}
