//! The cache key: SHA-256 over everything that shapes an answer.
//!
//! Parts, each length-prefixed so no two sequences of parts can run together: a version tag,
//! the tenant, the endpoint, the configured extra headers, and the request body in a canonical
//! form. Canonical means: object keys sorted at every depth (the last of a repeated key wins,
//! as in vLLM's JSON parser), numbers written one way (`0` and `0.0` are the same number),
//! strings unescaped, and no whitespace at all: each value is hashed as a tag and a length
//! before its bytes. So key order, spacing and escape spelling never change the key, and any
//! change of meaning does: every message (system prompt, RAG context, tool calls, names),
//! tools, response format and every sampling parameter is in it. Only `stream` and
//! `stream_options` are left out: they choose the form of the answer, and a hit is served in
//! whichever form the client asks for.
//!
//! Prompts can be megabytes, so the body is read into a tree that borrows its strings from
//! the body (a copy only for a string with escapes; numbers are held as numbers), and string
//! bytes go to the hasher as they are: SHA-256 is the only full pass after parsing.

use http::{HeaderMap, HeaderName};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};
use sluice_sdk::Endpoint;
use std::borrow::Cow;
use std::fmt;

/// Bumped whenever the canonical form changes, so old entries are never misread.
const KEY_VERSION: &[u8] = b"sluice-cache-v4";

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
    let Json::Object(fields) = serde_json::from_slice::<Json<'_>>(body).ok()? else {
        return None;
    };
    let mut hasher = Sha256::new();
    for part in [KEY_VERSION, tenant.as_bytes(), endpoint.path().as_bytes()] {
        framed(&mut hasher, part);
    }
    framed(&mut hasher, &(extra.len() as u64).to_be_bytes());
    for (name, value) in extra {
        framed(&mut hasher, name.as_bytes());
        framed(&mut hasher, value);
    }
    write_object(fields, FORM_ONLY_FIELDS, &mut hasher);
    Some(hasher.finalize().into())
}

fn framed(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

/// A tag byte, then the part's length, then its bytes: a prefix-free encoding, so two
/// different trees never hash the same bytes.
fn tagged(hasher: &mut Sha256, tag: u8, part: &[u8]) {
    hasher.update([tag]);
    framed(hasher, part);
}

fn write_value(value: Json<'_>, hasher: &mut Sha256) {
    match value {
        Json::Null => hasher.update(b"n"),
        Json::Bool(true) => hasher.update(b"t"),
        Json::Bool(false) => hasher.update(b"f"),
        Json::Number(Number::Integer(i)) => {
            hasher.update(b"#");
            hasher.update(i.to_be_bytes());
        }
        Json::Number(Number::Fraction(f)) => {
            hasher.update(b".");
            hasher.update(f.to_bits().to_be_bytes());
        }
        Json::String(s) => tagged(hasher, b'"', s.as_bytes()),
        Json::Array(items) => {
            hasher.update(b"[");
            hasher.update((items.len() as u64).to_be_bytes());
            for item in items {
                write_value(item, hasher);
            }
        }
        Json::Object(fields) => write_object(fields, &[], hasher),
    }
}

/// Keys sorted here, whatever order the body has them in; of a repeated key, the last.
fn write_object(mut fields: Vec<(Cow<'_, str>, Json<'_>)>, skip: &[&str], hasher: &mut Sha256) {
    fields.retain(|(k, _)| !skip.contains(&k.as_ref()));
    // Stable, so repeated keys stay in body order and the last of each run is the one kept.
    fields.sort_by(|(a, _), (b, _)| a.cmp(b));
    fields.dedup_by(|later, kept| {
        let repeated = later.0 == kept.0;
        if repeated {
            // The later value takes the kept slot; the earlier one is dropped.
            std::mem::swap(later, kept);
        }
        repeated
    });
    hasher.update(b"{");
    hasher.update((fields.len() as u64).to_be_bytes());
    for (k, v) in fields {
        tagged(hasher, b'"', k.as_bytes());
        write_value(v, hasher);
    }
}

/// A JSON value whose strings borrow from the body when they hold no escapes.
enum Json<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

/// A number in one form per value, hashed as fixed-size bytes (no text, no allocation): a
/// float with an integral value (`1.0`, `1e2`) is that integer, so the same number written
/// two ways gives one key.
enum Number {
    Integer(i128),
    /// Not integral (or beyond `i128`), never NaN or infinite (JSON has neither): its bits
    /// are its one form.
    Fraction(f64),
}

impl Number {
    fn from_f64(f: f64) -> Number {
        // Every integral f64 below 2^127 is exactly an i128.
        if f.fract() == 0.0 && f.abs() < 1.7e38 {
            Number::Integer(f as i128)
        } else {
            Number::Fraction(f)
        }
    }
}

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

/// A string that borrows from the body when it can (serde's own `Cow` never does).
struct Text<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match deserializer.deserialize_str(JsonVisitor)? {
            Json::String(s) => Ok(Text(s)),
            _ => Err(de::Error::custom("expected a string")),
        }
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(b))
    }

    fn visit_i64<E>(self, i: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(Number::Integer(i128::from(i))))
    }

    fn visit_u64<E>(self, u: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(Number::Integer(i128::from(u))))
    }

    fn visit_f64<E>(self, f: f64) -> Result<Json<'de>, E> {
        Ok(Json::Number(Number::from_f64(f)))
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(s)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s.to_owned())))
    }

    fn visit_string<E>(self, s: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some((Text(k), v)) = map.next_entry()? {
            fields.push((k, v));
        }
        Ok(Json::Object(fields))
    }
}

/// The tenant of a request: the trusted header's value when configured and present, else a
/// digest of the bearer token, else `anonymous`. `*` when tenants share the cache.
pub fn tenant(headers: &HeaderMap, trusted_header: Option<&HeaderName>, shared: bool) -> String {
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
    fn escape_spelling_does_not_matter_but_repeated_keys_keep_the_last() {
        let plain = key(r#"{"model":"m","prompt":"A/é"}"#);
        assert_eq!(plain, key(r#"{"model":"m","prompt":"\u0041\/\u00e9"}"#));
        assert_eq!(plain, key(r#"{"model":"m","prompt":"x","prompt":"A/é"}"#));
        assert_ne!(plain, key(r#"{"model":"m","prompt":"A/é","prompt":"x"}"#));
    }

    #[test]
    fn large_numbers_keep_their_value() {
        // 2^60 as a float, and the integer its shortest decimal spelling reads as.
        let float = key(r#"{"prompt":"x","seed":1152921504606846976.0}"#);
        assert_eq!(float, key(r#"{"prompt":"x","seed":1152921504606846976}"#));
        assert_ne!(float, key(r#"{"prompt":"x","seed":1152921504606847000}"#));
        assert_ne!(
            key(r#"{"prompt":"x","t":0.5}"#),
            key(r#"{"prompt":"x","t":0.25}"#)
        );
        assert_eq!(
            key(r#"{"prompt":"x","t":-0.0}"#),
            key(r#"{"prompt":"x","t":0}"#)
        );
    }

    #[test]
    fn string_contents_never_pass_for_structure() {
        let trees = [
            r#"{"prompt":["a","b"]}"#,
            r#"{"prompt":["a\",\"b"]}"#,
            r#"{"prompt":["ab"]}"#,
            r#"{"prompt":"ab"}"#,
            r#"{"prompt":["a",["b"]]}"#,
            r#"{"prompt":[["a"],"b"]}"#,
            r#"{"prompt":{"a":"b"}}"#,
            r#"{"prompt":{"a\":\"b":""}}"#,
            r#"{"prompt":{"a":"b","c":null}}"#,
            r#"{"prompt":{"a":"b","c":"null"}}"#,
            r#"{"prompt":{"a":"b","c":1}}"#,
            r#"{"prompt":{"a":"b","c":"1"}}"#,
            r#"{"prompt":{"a":"b","c":true}}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":[[]]}"#,
            r#"{"prompt":{}}"#,
            r#"{"prompt":""}"#,
        ];
        let mut seen = std::collections::HashSet::new();
        for t in trees {
            assert!(seen.insert(key(t)), "collision: {t}");
        }
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
        assert_eq!(
            tenant(&h, Some(&HeaderName::from_static("x-tenant")), false),
            "anonymous"
        );
        h.insert("authorization", "Bearer sk-123".parse().unwrap());
        let by_key = tenant(&h, Some(&HeaderName::from_static("x-tenant")), false);
        assert!(by_key.starts_with("k:") && !by_key.contains("sk-123"));
        h.insert("x-tenant", "acme".parse().unwrap());
        assert_eq!(
            tenant(&h, Some(&HeaderName::from_static("x-tenant")), false),
            "h:acme"
        );
        assert_eq!(
            tenant(&h, Some(&HeaderName::from_static("x-tenant")), true),
            "*"
        );
        // Without a configured trusted header, a client-sent one means nothing.
        assert_eq!(tenant(&h, None, false), by_key);
    }
}
