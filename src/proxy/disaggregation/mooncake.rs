//! vLLM's `MooncakeConnector`, the router's part: a `transfer_id` minted for both legs, and
//! the prefill engine named to the decode leg by its bootstrap server's address and its
//! engine id. The engine ids come from that server's `GET /query` (`{"<dp_rank>":
//! {"engine_id": ..., "worker_addr": ...}}`), as vLLM's own proxy reads them: one per
//! data-parallel rank, the ranks taken in turn, the leg pinned to its rank with
//! `X-data-parallel-rank` so that the blocks are where the decode leg looks. What the server
//! said is kept a minute (see `sluice_sdk::Prefillers`) and forgotten when a transfer from
//! that backend did nothing.
//!
//! The legs go one after the other, as NIXL's do, not at once as vLLM's example proxy sends
//! them: a prefill leg that fails then leaves the decode backend doing the whole request,
//! rather than a decode engine waiting for blocks that never come.

use crate::health::probe;
use bytes::Bytes;
use pingora_core::upstreams::peer::HttpPeer;
use serde_json::{json, Value};
use sluice_sdk::{Pool, TransferCheck};
use std::net::SocketAddr;
use std::time::Duration;

/// The longest a bootstrap server's `/query` is waited for.
const QUERY_WITHIN: Duration = Duration::from_secs(2);
/// The largest `/query` answer read, and the most ranks and the longest engine id kept of
/// it: the answer is a peer's.
const MAX_QUERY: usize = 64 * 1024;
const MAX_RANKS: usize = 1024;
const MAX_ENGINE_ID: usize = 256;

/// A Mooncake prefill leg's parameters, and the decode leg's.
pub struct Legs {
    /// The prefill leg's `kv_transfer_params`.
    pub ask: Bytes,
    /// The decode leg's.
    pub decode: Bytes,
    /// The data-parallel rank the prefill leg goes to.
    pub rank: u32,
}

/// The legs of a request whose prefill goes to `backend` of `pool`, whose bootstrap server
/// listens on `port` of the same host; `None` (logged) when that server cannot say which
/// engine it is.
pub async fn legs(
    probes: &pingora_core::connectors::http::v1::Connector,
    check: &TransferCheck,
    pool: &Pool,
    backend: SocketAddr,
    port: u16,
    request_id: &str,
) -> Option<Legs> {
    let prefillers = check.prefillers();
    let (rank, engine_id) = match prefillers.next(backend) {
        Some(known) => known,
        None => {
            let bootstrap = SocketAddr::new(backend.ip(), port);
            match query(probes, bootstrap).await {
                Ok(ranks) => prefillers.learn(backend, ranks),
                Err(why) => {
                    tracing::warn!(pool = &*pool.name, %backend, %bootstrap, "the Mooncake bootstrap server did not say which engine this is ({why}): the decode backend serves the request whole");
                    return None;
                }
            }
            prefillers.next(backend)?
        }
    };
    let transfer_id = format!("xfer-{request_id}");
    let bootstrap = format!("http://{}", SocketAddr::new(backend.ip(), port));
    let ask = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "transfer_id": transfer_id,
    });
    let decode = json!({
        "do_remote_decode": false,
        "do_remote_prefill": true,
        "remote_bootstrap_addr": bootstrap,
        "remote_engine_id": engine_id,
        "transfer_id": transfer_id,
    });
    Some(Legs {
        ask: Bytes::from(serde_json::to_vec(&ask).ok()?),
        decode: Bytes::from(serde_json::to_vec(&decode).ok()?),
        rank,
    })
}

/// `GET /query` of the bootstrap server at `bootstrap`: its engine ids by rank.
async fn query(
    probes: &pingora_core::connectors::http::v1::Connector,
    bootstrap: SocketAddr,
) -> Result<Vec<(u32, String)>, String> {
    // The bootstrap server speaks plain HTTP, whatever the engine's API does.
    let peer = probe::with_timeout(HttpPeer::new(bootstrap, false, String::new()), QUERY_WITHIN);
    let answer = probe::get(
        probes,
        &peer,
        &bootstrap.to_string(),
        "/query",
        QUERY_WITHIN,
    )
    .await
    .map_err(|failure| match failure {
        probe::Failure::Timeout => "no answer in time".to_string(),
        probe::Failure::Error(e) => e.to_string(),
    })?;
    if answer.status != 200 {
        return Err(format!("status {}", answer.status));
    }
    parse_query(&answer.body)
}

/// A `/query` answer's engine ids by rank.
fn parse_query(body: &[u8]) -> Result<Vec<(u32, String)>, String> {
    if body.len() > MAX_QUERY {
        return Err(format!("an answer of {} bytes", body.len()));
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let ranks = value.as_object().ok_or("not a JSON object")?;
    if ranks.len() > MAX_RANKS {
        return Err(format!("{} ranks", ranks.len()));
    }
    let mut found = Vec::with_capacity(ranks.len());
    for (rank, entry) in ranks {
        let rank: u32 = rank.parse().map_err(|_| format!("rank {rank:?}"))?;
        let engine_id = entry
            .get("engine_id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty() && id.len() <= MAX_ENGINE_ID)
            .ok_or_else(|| format!("rank {rank} has no engine id"))?;
        found.push((rank, engine_id.to_string()));
    }
    if found.is_empty() {
        return Err("no engine registered yet".into());
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bootstrap_answer_gives_each_rank_s_engine_id() {
        // As vLLM 0.32's bootstrap server answers, with two data-parallel ranks.
        let body = br#"{"0":{"engine_id":"e-0","worker_addr":{"0":{"0":"10.0.0.1:7000"}}},"1":{"engine_id":"e-1","worker_addr":{"0":{"0":"10.0.0.1:7001"}}}}"#;
        let mut ranks = parse_query(body).unwrap();
        ranks.sort();
        assert_eq!(ranks, vec![(0, "e-0".into()), (1, "e-1".into())]);
        assert!(parse_query(b"{}").is_err(), "no engine yet");
        assert!(parse_query(b"[1]").is_err());
        assert!(parse_query(br#"{"x":{"engine_id":"e"}}"#).is_err());
        assert!(parse_query(br#"{"0":{"engine_id":""}}"#).is_err());
        let long = format!(r#"{{"0":{{"engine_id":"{}"}}}}"#, "e".repeat(300));
        assert!(parse_query(long.as_bytes()).is_err());
    }
}
