//! Sessions shared by a fleet of proxies (`sessions.store: redis`): a session's backend, as
//! the proxy that bound it last chose it, kept in Redis, so that a turn reaching another
//! replica behind the same load balancer goes to the engine that holds the session's cache.
//!
//! - **The key** is the pool's name and a SHA-256 digest of the tenant and the session's id:
//!   the id itself is never stored, and one tenant's id never names another's session.
//! - **Read** only when this process has no binding for the session (its first turn here):
//!   one `GET`, bounded by `sessions.redis.timeout`; a miss, an error or a slow Redis leaves
//!   the turn to be balanced afresh, as without sharing. What is read is adopted only while
//!   the backend is one of the pool's.
//! - **Written** only when a session is bound anew (its first turn, or a move), by a task of
//!   its own that nobody waits for: `SET` with the pool's `session_idle_ttl`.
//! - The value is `address prompt_tokens`: the backend, and the last turn's prompt (the
//!   estimate the `ttft` strategy credits the backend's cache with).

use crate::metrics;
use sluice_sdk::{Pool, RedisLink, RedisSettings};
use std::net::SocketAddr;
use std::sync::Arc;

/// Where every shared session's key starts.
const REDIS_PREFIX: &str = "sluice:session:";

/// The fleet's shared sessions, in Redis.
#[derive(Debug)]
pub struct SharedSessions {
    redis: Arc<RedisLink>,
}

impl SharedSessions {
    pub fn new(settings: &RedisSettings) -> Self {
        Self {
            redis: Arc::new(RedisLink::new("sessions store", settings)),
        }
    }

    /// The Redis key of session `id` of `tenant` in `pool`.
    pub fn key(pool: &str, tenant: Option<&str>, id: &[u8]) -> String {
        let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
        for part in [pool.as_bytes(), tenant.unwrap_or("").as_bytes(), id] {
            digest.update(&(part.len() as u64).to_be_bytes());
            digest.update(part);
        }
        format!(
            "{REDIS_PREFIX}{pool}:{}",
            hex::encode(digest.finish().as_ref())
        )
    }

    /// Binds session `session` (its local key) in `pool` to the backend Redis names under
    /// `key`, when this process has no binding for it yet.
    pub async fn adopt(&self, pool: &Pool, session: u64, key: &str) {
        if pool.session_binding(session).is_some() {
            return;
        }
        let mut get = redis::cmd("GET");
        get.arg(key);
        let value: Option<String> = match self.redis.query(&get, self.redis.timeout()).await {
            Ok(value) => value,
            Err(e) => {
                metrics::shared_session(&pool.name, "error");
                tracing::debug!("a shared session could not be read from Redis: {e:?}");
                return;
            }
        };
        let adopted = value
            .as_deref()
            .and_then(decode)
            .is_some_and(|(addr, tokens)| pool.adopt_session(session, addr, tokens));
        metrics::shared_session(&pool.name, if adopted { "adopted" } else { "missed" });
    }

    /// Writes that the session under `key` of `pool` is bound to `backend`, its turn's
    /// prompt `prompt_tokens`, by a task of its own.
    pub fn publish(&self, pool: &Pool, key: String, backend: SocketAddr, prompt_tokens: u64) {
        let Some(ttl) = pool.settings.sessions.as_ref().map(|s| s.idle_ttl) else {
            return;
        };
        let redis = Arc::clone(&self.redis);
        let name = Arc::clone(&pool.name);
        let mut set = redis::cmd("SET");
        set.arg(key)
            .arg(format!("{backend} {prompt_tokens}"))
            .arg("EX")
            .arg(ttl.as_secs().max(1));
        tokio::spawn(async move {
            match redis.query::<()>(&set, redis.connect_timeout()).await {
                Ok(()) => metrics::shared_session(&name, "published"),
                Err(e) => {
                    metrics::shared_session(&name, "error");
                    tracing::debug!("a shared session was not written to Redis: {e:?}");
                }
            }
        });
    }
}

/// `address prompt_tokens`.
fn decode(value: &str) -> Option<(SocketAddr, u32)> {
    let (addr, tokens) = value.split_once(' ')?;
    Some((addr.parse().ok()?, tokens.parse().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_digests_scoped_to_the_pool_and_the_tenant() {
        let key = SharedSessions::key("main", Some("alpha"), b"3f1c9e");
        assert!(key.starts_with("sluice:session:main:"));
        assert!(!key.contains("3f1c9e"), "the id is never stored");
        assert_eq!(key, SharedSessions::key("main", Some("alpha"), b"3f1c9e"));
        assert_ne!(key, SharedSessions::key("main", Some("beta"), b"3f1c9e"));
        assert_ne!(key, SharedSessions::key("main", None, b"3f1c9e"));
        assert_ne!(key, SharedSessions::key("other", Some("alpha"), b"3f1c9e"));
        // Framed: moving a byte from the tenant to the id makes another key.
        assert_ne!(
            SharedSessions::key("main", Some("ab"), b"c"),
            SharedSessions::key("main", Some("a"), b"bc")
        );
    }

    #[test]
    fn values_name_a_backend_and_a_prompt() {
        assert_eq!(
            decode("10.0.0.7:8000 1234"),
            Some(("10.0.0.7:8000".parse().unwrap(), 1234))
        );
        assert_eq!(
            decode("[::1]:8000 x"),
            Some(("[::1]:8000".parse().unwrap(), 0))
        );
        assert_eq!(decode("10.0.0.7:8000"), None);
        assert_eq!(decode("a host 1"), None);
    }
}
