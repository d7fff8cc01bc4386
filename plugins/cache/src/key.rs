//! The cache key: SHA-256 over everything that shapes an answer.
//!
//! Parts, each length-prefixed so no two sequences of parts can run together: a version tag,
//! the tenant, the endpoint, the configured extra headers, and the request body in a canonical
//! form. Canonical means: object keys sorted at every depth, no insignificant whitespace,
//! numbers written one way (`0` and `0.0` are the same number), strings re-escaped one way.
//! So key order and spacing never change the key, and any change of meaning does: every
//! message (system prompt, RAG context, tool calls, names), tools, response format and every
//! sampling parameter is in it. Only `stream` and `stream_options` are left out: they choose
//! the form of the answer, and a hit is served in whichever form the client asks for.

use http::HeaderMap;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sluice_sdk::Endpoint;

/// Bumped whenever the canonical form changes, so old entries are never misread.
const KEY_VERSION: &[u8] = b"sluice-cache-v2";

/// Body fields that choose the answer's form, not its content.
const FORM_ONLY_FIELDS: &[&str] = &["stream", "stream_options"];

/// The digest of a request. `None` when the body is not a JSON object (never the case for a
/// request that passed the core's parsing).
pub fn digest(
    tenant: &str,
    endpoint: Endpoint,
    extra: &[(&str, &[u8])],
    body: &[u8],
) -> Option<[u8; 32]> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object()?;
    let mut hasher = Sha256::new();
    for part in [KEY_VERSION, tenant.as_bytes(), endpoint.path().as_bytes()] {
        framed(&mut hasher, part);
    }
    framed(&mut hasher, &(extra.len() as u64).to_be_bytes());
    for (name, value) in extra {
        framed(&mut hasher, name.as_bytes());
        framed(&mut hasher, value);
    }
    // The body comes last, so it needs no length frame: it goes straight into the hasher,
    // without a body-sized buffer.
    write_object(object, FORM_ONLY_FIELDS, &mut HashWriter(&mut hasher));
    Some(hasher.finalize().into())
}

fn framed(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

fn write_canonical(value: &Value, out: &mut HashWriter<'_>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => write_object(map, &[], out),
    }
}

/// Keys sorted here, whatever order the map keeps (serde_json may preserve insertion order).
fn write_object(map: &serde_json::Map<String, Value>, skip: &[&str], out: &mut HashWriter<'_>) {
    let mut fields: Vec<(&String, &Value)> = map
        .iter()
        .filter(|(k, _)| !skip.contains(&k.as_str()))
        .collect();
    fields.sort_unstable_by_key(|(k, _)| *k);
    out.push(b'{');
    for (i, (k, v)) in fields.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(k, out);
        out.push(b':');
        write_canonical(v, out);
    }
    out.push(b'}');
}

/// Integers as integers; a float with an integral value (`1.0`) as that integer, so that the
/// same number written two ways gives one key.
fn write_number(n: &serde_json::Number, out: &mut HashWriter<'_>) {
    if let Some(i) = n.as_i64() {
        out.extend_from_slice(i.to_string().as_bytes());
    } else if let Some(u) = n.as_u64() {
        out.extend_from_slice(u.to_string().as_bytes());
    } else if let Some(f) = n.as_f64() {
        if f.fract() == 0.0 && f.abs() < 9.0e15 {
            out.extend_from_slice((f as i64).to_string().as_bytes());
        } else {
            out.extend_from_slice(f.to_string().as_bytes());
        }
    }
}

fn write_string(s: &str, out: &mut HashWriter<'_>) {
    // serde_json escapes one way: the same string, the same bytes. Hashing cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// Canonical bytes go straight into the hasher.
struct HashWriter<'a>(&'a mut Sha256);

impl HashWriter<'_> {
    fn push(&mut self, byte: u8) {
        self.0.update([byte]);
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.update(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The tenant of a request: the trusted header's value when configured and present, else a
/// digest of the bearer token, else `anonymous`. `*` when tenants share the cache.
pub fn tenant(headers: &HeaderMap, trusted_header: Option<&str>, shared: bool) -> String {
    if shared {
        return "*".into();
    }
    if let Some(v) = trusted_header.and_then(|h| headers.get(h)) {
        return format!("h:{}", String::from_utf8_lossy(v.as_bytes()));
    }
    let token = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(|v| {
            v.strip_prefix(b"Bearer ")
                .or_else(|| v.strip_prefix(b"bearer "))
        })
        .map(|t| t.trim_ascii())
        .filter(|t| !t.is_empty());
    match token {
        // The key itself never reaches the store: only a digest of it.
        Some(t) => format!("k:{}", hex::encode(&Sha256::digest(t)[..16])),
        None => "anonymous".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(body: &str) -> [u8; 32] {
        digest("t", Endpoint::ChatCompletions, &[], body.as_bytes()).unwrap()
    }

    #[test]
    fn key_order_whitespace_and_number_spelling_do_not_matter() {
        let a = key(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}"#);
        let b = key(
            r#"{ "temperature" : 0.0, "messages" : [ {"content":"hi", "role":"user"} ], "model":"m" }"#,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn stream_form_does_not_matter() {
        let a = key(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        let b = key(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}"#,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn every_change_of_meaning_changes_the_key() {
        let base = r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0}"#;
        let variants = [
            r#"{"model":"m2","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"be long"},{"role":"user","content":"hi"}],"temperature":0}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi","name":"bob"}],"temperature":0}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0.5}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0,"seed":1}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0,"max_tokens":5}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0,"tools":[{"type":"function","function":{"name":"f"}}]}"#,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"temperature":0,"stop":["\n"]}"#,
        ];
        let base_key = key(base);
        let mut seen = std::collections::HashSet::new();
        for v in variants {
            let k = key(v);
            assert_ne!(k, base_key, "{v}");
            assert!(seen.insert(k), "two variants collide: {v}");
        }
    }

    #[test]
    fn tenant_endpoint_and_extra_parts_separate_keys() {
        let body = br#"{"model":"m","prompt":"x"}"#;
        let k = |t: &str, e, extra: &[(&str, &[u8])]| digest(t, e, extra, body).unwrap();
        let base = k("a", Endpoint::Completions, &[]);
        assert_ne!(base, k("b", Endpoint::Completions, &[]));
        assert_ne!(base, k("a", Endpoint::ChatCompletions, &[]));
        assert_ne!(
            base,
            k("a", Endpoint::Completions, &[("x-rag-version", b"7")])
        );
        // Length framing: moving bytes between parts changes the key.
        assert_ne!(
            k("ab", Endpoint::Completions, &[]),
            k("a", Endpoint::Completions, &[("b", b"")])
        );
    }

    #[test]
    fn tenants_come_from_the_trusted_header_then_the_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(tenant(&h, Some("x-tenant"), false), "anonymous");
        h.insert("authorization", "Bearer sk-123".parse().unwrap());
        let by_key = tenant(&h, Some("x-tenant"), false);
        assert!(by_key.starts_with("k:") && !by_key.contains("sk-123"));
        h.insert("x-tenant", "acme".parse().unwrap());
        assert_eq!(tenant(&h, Some("x-tenant"), false), "h:acme");
        assert_eq!(tenant(&h, Some("x-tenant"), true), "*");
        // Without a configured trusted header, a client-sent one means nothing.
        assert_eq!(tenant(&h, None, false), by_key);
    }
}
