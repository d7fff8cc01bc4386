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
//! Prompts can be megabytes, so the body is hashed as it is parsed, without a tree: scalars
//! and array items go to the hasher in body order as they are read (strings borrowed from
//! the body; numbers as numbers), and only objects wait, since their members must be sorted.
//! An object keeps one small record per member: its key (borrowed) and its value's encoding,
//! or a digest of it when the value is long (an array, an object, a long string). Sorted and
//! deduplicated at the object's end, the records go to the hasher the object itself belongs
//! to (a Merkle form). What objects hold at once is bounded by a budget proportional to the
//! body; a body beyond it (hundreds of thousands of members open at once, which no request
//! needs) gets no key and is not cached.
//!
//! The encoding, prefix-free (every value starts with its own tag):
//! - `n`, `t`, `f`; `#` and an `i128` for an integral number; `.` and the `f64`'s bits else;
//! - `"`, a `u64` length and the UTF-8 bytes for a string;
//! - `[`, the items, `]` for an array;
//! - `{`, a `u64` count, then per member in key order the key (as a string) and the value:
//!   its encoding when the value is a scalar or a string of at most [`INLINE_STRING`] bytes,
//!   else `H` and the SHA-256 of its encoding.

use crate::config::Anonymous;
use http::HeaderMap;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use sluice_sdk::{api_key, Endpoint, Tenant};
use std::borrow::Cow;
use std::fmt;

/// SHA-256 as `ring` computes it (BoringSSL's assembly): on a CPU without the SHA extensions
/// 1.6x the speed of `sha2`, whose portable code runs there, and hashing is most of a long
/// body's key; with them both use them. The digests are the same, so the key's version is
/// unchanged.
struct Sha256(ring::digest::Context);

impl Sha256 {
    fn new() -> Sha256 {
        Sha256(ring::digest::Context::new(&ring::digest::SHA256))
    }

    fn update(&mut self, bytes: impl AsRef<[u8]>) {
        self.0.update(bytes.as_ref());
    }

    fn finalize(self) -> [u8; 32] {
        let mut out = [0; 32];
        out.copy_from_slice(self.0.finish().as_ref());
        out
    }

    fn digest(bytes: &[u8]) -> [u8; 32] {
        let mut hasher = Sha256::new();
        hasher.update(bytes);
        hasher.finalize()
    }
}

/// Bumped whenever the canonical form changes, so old entries are never misread.
const KEY_VERSION: &[u8] = b"sluice-cache-v5";

/// Body fields that choose the answer's form, not its content.
const FORM_ONLY_FIELDS: &[&str] = &["stream", "stream_options"];

/// The longest string a member's value holds inline; a longer one is digested.
const INLINE_STRING: usize = 23;

/// The smallest budget for the members held at once, in bytes: 32768 members, plenty for
/// any real request (a member costs [`MEMBER_COST`]). A larger body may hold as many bytes
/// of members as it has itself.
const MIN_BUDGET: usize = 4 << 20;

/// What one held member is charged: its record, twice, for the slack of a growing vector.
const MEMBER_COST: usize = 2 * std::mem::size_of::<Member<'static>>();

/// The digest of a request. `None` when the body is not a JSON object (never the case for a
/// request that passed the core's parsing), or when its objects are too wide to key within
/// the budget.
pub fn digest(
    tenant: &str,
    endpoint: Endpoint,
    extra: &[(&str, &[u8])],
    body: &[u8],
) -> Option<[u8; 32]> {
    let mut hasher = Sha256::new();
    for part in [KEY_VERSION, tenant.as_bytes(), endpoint.path().as_bytes()] {
        framed(&mut hasher, part);
    }
    framed(&mut hasher, &(extra.len() as u64).to_be_bytes());
    for (name, value) in extra {
        framed(&mut hasher, name.as_bytes());
        framed(&mut hasher, value);
    }
    let mut budget = Budget {
        left: MIN_BUDGET.max(body.len()),
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let members = de
        .deserialize_map(ObjectVisitor {
            budget: &mut budget,
            skip: FORM_ONLY_FIELDS,
        })
        .ok()?;
    de.end().ok()?;
    write_object(members, &mut hasher);
    Some(hasher.finalize())
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

/// An object's member, waiting for the object's end: its key and its value's encoding.
struct Member<'de> {
    key: Cow<'de, str>,
    value: Encoded,
}

/// A member value's encoding when short (a scalar, a short string), else `H` and the
/// digest of its encoding.
struct Encoded {
    len: u8,
    bytes: [u8; 33],
}

impl Encoded {
    fn new(parts: &[&[u8]]) -> Encoded {
        let mut encoded = Encoded {
            len: 0,
            bytes: [0; 33],
        };
        for part in parts {
            let at = usize::from(encoded.len);
            if let Some(slot) = encoded.bytes.get_mut(at..at + part.len()) {
                slot.copy_from_slice(part);
                encoded.len += part.len() as u8;
            }
        }
        encoded
    }

    fn digest(hasher: Sha256) -> Encoded {
        Encoded::new(&[b"H", &hasher.finalize()])
    }

    fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..usize::from(self.len)).unwrap_or_default()
    }
}

/// The bytes the members of open objects may still take.
struct Budget {
    left: usize,
}

impl Budget {
    fn take<E: de::Error>(&mut self, bytes: usize) -> Result<(), E> {
        self.left = self
            .left
            .checked_sub(bytes)
            .ok_or_else(|| E::custom("too many object members to key"))?;
        Ok(())
    }

    fn give_back(&mut self, bytes: usize) {
        self.left = self.left.saturating_add(bytes);
    }
}

/// Keys sorted here, whatever order the body has them in; of a repeated key, the last.
fn write_object(mut members: Vec<Member<'_>>, hasher: &mut Sha256) {
    // Stable, so repeated keys stay in body order and the last of each run is the one kept.
    members.sort_by(|a, b| a.key.cmp(&b.key));
    members.dedup_by(|later, kept| {
        let repeated = later.key == kept.key;
        if repeated {
            // The later value takes the kept slot; the earlier one is dropped.
            std::mem::swap(later, kept);
        }
        repeated
    });
    hasher.update(b"{");
    hasher.update((members.len() as u64).to_be_bytes());
    for member in members {
        tagged(hasher, b'"', member.key.as_bytes());
        hasher.update(member.value.as_bytes());
    }
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

    fn encoded(&self) -> Encoded {
        match self {
            Number::Integer(i) => Encoded::new(&[b"#", &i.to_be_bytes()]),
            Number::Fraction(f) => Encoded::new(&[b".", &f.to_bits().to_be_bytes()]),
        }
    }
}

/// A string's encoding, into `hasher`.
fn write_string(hasher: &mut Sha256, s: &str) {
    tagged(hasher, b'"', s.as_bytes());
}

/// A value streamed into the hasher of what holds it (the body's order kept), except that
/// an object's members wait for its end.
struct ValueSeed<'a> {
    out: &'a mut Sha256,
    budget: &'a mut Budget,
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.out.update(b"n");
        Ok(())
    }

    fn visit_bool<E>(self, b: bool) -> Result<(), E> {
        self.out.update(if b { b"t" } else { b"f" });
        Ok(())
    }

    fn visit_i64<E>(self, i: i64) -> Result<(), E> {
        self.out
            .update(Number::Integer(i128::from(i)).encoded().as_bytes());
        Ok(())
    }

    fn visit_u64<E>(self, u: u64) -> Result<(), E> {
        self.out
            .update(Number::Integer(i128::from(u)).encoded().as_bytes());
        Ok(())
    }

    fn visit_f64<E>(self, f: f64) -> Result<(), E> {
        self.out.update(Number::from_f64(f).encoded().as_bytes());
        Ok(())
    }

    fn visit_str<E>(self, s: &str) -> Result<(), E> {
        write_string(self.out, s);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.out.update(b"[");
        while seq
            .next_element_seed(ValueSeed {
                out: &mut *self.out,
                budget: &mut *self.budget,
            })?
            .is_some()
        {}
        self.out.update(b"]");
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let (members, charged) = collect(map, self.budget, &[])?;
        write_object(members, self.out);
        self.budget.give_back(charged);
        Ok(())
    }
}

/// An object's members, each with its value's encoding or digest, and what they were
/// charged; members named in `skip` are left out.
fn collect<'de, A: MapAccess<'de>>(
    mut map: A,
    budget: &mut Budget,
    skip: &[&str],
) -> Result<(Vec<Member<'de>>, usize), A::Error> {
    let mut members = Vec::new();
    let mut charged = 0usize;
    while let Some(key) = map.next_key_seed(KeySeed)? {
        if skip.contains(&key.as_ref()) {
            map.next_value::<IgnoredAny>()?;
            continue;
        }
        let cost = MEMBER_COST
            + match &key {
                Cow::Owned(k) => k.len(),
                Cow::Borrowed(_) => 0,
            };
        if let Err(e) = budget.take(cost) {
            budget.give_back(charged);
            return Err(e);
        }
        charged += cost;
        let value = map.next_value_seed(MemberSeed {
            budget: &mut *budget,
        });
        match value {
            Ok(value) => members.push(Member { key, value }),
            Err(e) => {
                budget.give_back(charged);
                return Err(e);
            }
        }
    }
    Ok((members, charged))
}

/// A key, borrowed from the body when it has no escapes (serde's own `Cow` never borrows).
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }

    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s.to_owned()))
    }
}

/// A member's value: its encoding when short, else the digest of its encoding.
struct MemberSeed<'a> {
    budget: &'a mut Budget,
}

impl<'de> DeserializeSeed<'de> for MemberSeed<'_> {
    type Value = Encoded;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Encoded, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MemberSeed<'_> {
    type Value = Encoded;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Encoded, E> {
        Ok(Encoded::new(&[b"n"]))
    }

    fn visit_bool<E>(self, b: bool) -> Result<Encoded, E> {
        Ok(Encoded::new(&[if b { b"t" } else { b"f" }]))
    }

    fn visit_i64<E>(self, i: i64) -> Result<Encoded, E> {
        Ok(Number::Integer(i128::from(i)).encoded())
    }

    fn visit_u64<E>(self, u: u64) -> Result<Encoded, E> {
        Ok(Number::Integer(i128::from(u)).encoded())
    }

    fn visit_f64<E>(self, f: f64) -> Result<Encoded, E> {
        Ok(Number::from_f64(f).encoded())
    }

    fn visit_str<E>(self, s: &str) -> Result<Encoded, E> {
        let len = (s.len() as u64).to_be_bytes();
        if s.len() <= INLINE_STRING {
            return Ok(Encoded::new(&[b"\"", &len, s.as_bytes()]));
        }
        let mut hasher = Sha256::new();
        write_string(&mut hasher, s);
        Ok(Encoded::digest(hasher))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Encoded, A::Error> {
        let mut hasher = Sha256::new();
        ValueSeed {
            out: &mut hasher,
            budget: self.budget,
        }
        .visit_seq(seq)?;
        Ok(Encoded::digest(hasher))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Encoded, A::Error> {
        let mut hasher = Sha256::new();
        ValueSeed {
            out: &mut hasher,
            budget: self.budget,
        }
        .visit_map(map)?;
        Ok(Encoded::digest(hasher))
    }
}

/// The body's top level: an object, whose members are kept for the key's own hasher.
struct ObjectVisitor<'a> {
    budget: &'a mut Budget,
    skip: &'a [&'a str],
}

impl<'de> Visitor<'de> for ObjectVisitor<'_> {
    type Value = Vec<Member<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        collect(map, self.budget, self.skip).map(|(members, _)| members)
    }
}

/// The partition of the cache a request reads and fills: its identified tenant's, else (no
/// tenants plugin) one per API key, by a digest of the key's raw bytes; requests without
/// identity share the `anonymous` one only when the operator chose so, else `None`: bypass.
/// `*` when tenants share the cache.
pub fn partition(
    headers: &HeaderMap,
    tenant: Option<&Tenant>,
    anonymous: Anonymous,
    shared: bool,
) -> Option<String> {
    if shared {
        return Some("*".into());
    }
    let identity = match tenant {
        Some(t) if t.identified => Some(format!("t:{}", t.name)),
        Some(_) => None,
        // The key itself never reaches the store: only a digest of it.
        None => {
            api_key(headers).map(|key| format!("k:{}", hex::encode(&Sha256::digest(key)[..16])))
        }
    };
    identity.or_else(|| (anonymous == Anonymous::Share).then(|| Tenant::ANONYMOUS.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(body: &str) -> [u8; 32] {
        digest("t", Endpoint::ChatCompletions, &[], body.as_bytes()).unwrap()
    }

    #[test]
    fn the_hasher_is_sha256_so_stored_keys_stay_valid() {
        // FIPS 180-2's test vector: entries stored under the same version by any build
        // (Redis outlives the proxy) must be found again.
        assert_eq!(
            hex::encode(Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let mut split = Sha256::new();
        split.update(b"a");
        split.update([b'b']);
        split.update(b"c");
        assert_eq!(split.finalize(), Sha256::digest(b"abc"));
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
    fn partitions_come_from_the_tenant_then_the_api_key() {
        let mut h = HeaderMap::new();
        let part = |h: &HeaderMap, t: Option<&Tenant>, a| partition(h, t, a, false);
        assert_eq!(
            part(&h, None, Anonymous::Bypass),
            None,
            "no identity: bypass"
        );
        assert_eq!(
            part(&h, None, Anonymous::Share).as_deref(),
            Some("anonymous")
        );
        h.insert("authorization", "Bearer sk-123".parse().unwrap());
        let by_key = part(&h, None, Anonymous::Bypass).unwrap();
        assert!(by_key.starts_with("k:") && !by_key.contains("sk-123"));
        // Raw bytes are hashed: two keys differing only in a non-UTF-8 byte do not collide.
        let mut other = HeaderMap::new();
        other.insert(
            "x-api-key",
            http::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        );
        let mut another = HeaderMap::new();
        another.insert(
            "x-api-key",
            http::HeaderValue::from_bytes(b"caf\xe8").unwrap(),
        );
        assert_ne!(
            part(&other, None, Anonymous::Bypass),
            part(&another, None, Anonymous::Bypass)
        );

        let tenant = |name: &str, identified| Tenant {
            name: name.into(),
            identified,
            default_priority: None,
            max_priority: None,
            may_force_target: false,
            ttft_slo: None,
        };
        // An identified tenant's partition, whatever key or header the request carries.
        h.insert("x-tenant", "beta".parse().unwrap());
        let alpha = tenant("alpha", true);
        assert_eq!(
            part(&h, Some(&alpha), Anonymous::Bypass).as_deref(),
            Some("t:alpha")
        );
        // The tenants plugin's anonymous tenant has no identity, even with a key.
        let anonymous = tenant(Tenant::ANONYMOUS, false);
        assert_eq!(part(&h, Some(&anonymous), Anonymous::Bypass), None);
        assert_eq!(
            part(&h, Some(&anonymous), Anonymous::Share).as_deref(),
            Some("anonymous")
        );
        assert_eq!(
            partition(&h, Some(&alpha), Anonymous::Bypass, true).as_deref(),
            Some("*")
        );
    }

    #[test]
    fn long_strings_keys_and_nested_objects_follow_the_same_rules() {
        // Long strings are digested as members: escapes still do not matter.
        let long = "a/é".repeat(20);
        let escaped = r"\u0061\/\u00e9".repeat(20);
        assert_eq!(
            key(&format!(r#"{{"prompt":"{long}"}}"#)),
            key(&format!(r#"{{"prompt":"{escaped}"}}"#))
        );
        assert_eq!(
            key(&format!(r#"{{"prompt":["{long}"]}}"#)),
            key(&format!(r#"{{"prompt":["{escaped}"]}}"#))
        );
        assert_eq!(
            key(r#"{"pr\u006fmpt":"x","m":{"\u0062":1,"a":2}}"#),
            key(r#"{"m":{"a":2,"b":1},"prompt":"x"}"#)
        );
        // The last of a repeated key wins at every depth, objects as values included.
        assert_eq!(
            key(r#"{"prompt":"x","t":{"a":{"x":1},"b":0,"a":{"y":[2]}}}"#),
            key(r#"{"prompt":"x","t":{"b":0,"a":{"y":[2]}}}"#)
        );
        assert_ne!(
            key(r#"{"prompt":"x","t":{"a":{"x":1},"a":{"y":[2]}}}"#),
            key(r#"{"prompt":"x","t":{"a":{"y":[2]},"a":{"x":1}}}"#)
        );
        // Whitespace anywhere.
        assert_eq!(
            key("{\n\t\"prompt\" :\r\n [ 1 , 2 ] ,\"t\" : { \"a\" : null } }\n"),
            key(r#"{"prompt":[1,2],"t":{"a":null}}"#)
        );
        // Only the top-level stream fields are left out.
        assert_ne!(
            key(r#"{"prompt":"x","t":{"stream":true}}"#),
            key(r#"{"prompt":"x","t":{}}"#)
        );
        assert_eq!(
            key(r#"{"prompt":"x","stream":false,"stream":true,"stream_options":null}"#),
            key(r#"{"prompt":"x"}"#)
        );
    }

    #[test]
    fn inline_and_digested_values_never_collide() {
        // Strings around the inline limit, as members and as items, next to look-alikes.
        let at = "s".repeat(INLINE_STRING);
        let over = "s".repeat(INLINE_STRING + 1);
        let trees = [
            format!(r#"{{"p":"{at}"}}"#),
            format!(r#"{{"p":"{over}"}}"#),
            format!(r#"{{"p":["{at}"]}}"#),
            format!(r#"{{"p":["{over}"]}}"#),
            format!(r#"{{"p":[["{over}"]]}}"#),
            format!(r#"{{"p":{{"{over}":"{over}"}}}}"#),
            format!(r#"{{"p":{{"{over}":["{over}"]}}}}"#),
            format!(r#"{{"p":[{{"{over}":"{over}"}}]}}"#),
            r#"{"p":[1,2]}"#.to_string(),
            r#"{"p":[[1],2]}"#.to_string(),
            r#"{"p":[1,[2]]}"#.to_string(),
            r#"{"p":[{},[]]}"#.to_string(),
            r#"{"p":[[],{}]}"#.to_string(),
            r#"{"p":{"a":[]}}"#.to_string(),
            r#"{"p":{"a":{}}}"#.to_string(),
            r#"{"p":{"a":""}}"#.to_string(),
            r#"{"p":{"a":0.5}}"#.to_string(),
        ];
        let mut seen = std::collections::HashSet::new();
        for t in &trees {
            assert!(seen.insert(key(t)), "collision: {t}");
        }
    }

    #[test]
    fn bodies_that_are_not_one_object_have_no_key() {
        for body in [
            "",
            "[1]",
            "\"x\"",
            "null",
            "{",
            r#"{"a":1} x"#,
            r#"{"a":1}{}"#,
            "{\"a\":\"\u{1}\"}",
        ] {
            assert_eq!(
                digest("t", Endpoint::Completions, &[], body.as_bytes()),
                None,
                "{body:?}"
            );
        }
        assert_eq!(
            digest("t", Endpoint::Completions, &[], b"{\"a\":\"\xff\"}"),
            None
        );
    }

    #[test]
    fn objects_too_wide_to_hold_get_no_key() {
        let object = |members: usize| {
            let mut body = String::from(r#"{"prompt":"x","logit_bias":{"#);
            for i in 0..members {
                if i > 0 {
                    body.push(',');
                }
                body.push_str(&format!(r#""{i}":-100"#));
            }
            body.push_str("}}");
            body
        };
        assert!(digest("t", Endpoint::Completions, &[], object(20_000).as_bytes()).is_some());
        assert!(digest("t", Endpoint::Completions, &[], object(40_000).as_bytes()).is_none());
        // The same members one after another in small objects are fine: a closed object
        // gives its budget back.
        let mut many = String::from(r#"{"prompt":"x","tools":["#);
        for i in 0..40_000 {
            if i > 0 {
                many.push(',');
            }
            many.push_str(r#"{"a":1,"b":2}"#);
        }
        many.push_str("]}");
        assert!(digest("t", Endpoint::Completions, &[], many.as_bytes()).is_some());
    }
}
