//! Disaggregated prefill, simulated on vLLM's `NixlConnector` wire (`--kv-transfer-config`).
//!
//! A router sends the prefill leg with `kv_transfer_params: {"do_remote_decode": true}` and
//! one output token; the engine prefills, keeps the prompt's blocks under a lease, and its
//! answer carries the `kv_transfer_params` a decode engine needs to read them
//! (`do_remote_prefill`, `remote_engine_id`, `remote_request_id`, `remote_block_ids`,
//! `remote_host`, `remote_port`, `tp_size`). The router copies them into the decode leg; the
//! decode engine reads the blocks from the prefill engine's side channel, which takes time
//! in proportion to their size, and counts what it read as cached (its usage says so: the
//! prompt less one token, as vLLM's scheduler recomputes the last). The lease ends when the
//! blocks are read or when it expires (`kv_lease_duration`, 30 s as in vLLM).
//!
//! What breaks is what breaks in vLLM: parameters without the keys a read needs are ignored
//! and the prompt is prefilled locally; a read that fails (the lease expired, the blocks are
//! gone, the engine is another) fails the request (`kv_load_failure_policy: fail`, vLLM's
//! default: a 500, or an error event in a stream) or is recomputed locally, silently but for
//! the usage (`recompute`). The `kv_transfer_lost` fault makes a prefill engine answer
//! parameters for blocks it did not keep: P/D that does nothing.
//!
//! `MooncakeConnector` is simulated too (see [`mooncake`]): there the router mints a
//! `transfer_id` for both legs, the prefill answer carries no parameters, and the decode
//! engine finds the prefill engine through its bootstrap server (`remote_bootstrap_addr`,
//! `GET /query`), whose engine id per data-parallel rank the router reads as well.
//!
//! The side channel stands in for NIXL's and Mooncake's transfer engines (a metadata
//! handshake, then RDMA reads): one TCP connection per read, a JSON line each way. Written
//! here: nothing to borrow for a wire that only this simulator speaks.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

pub mod mooncake;
pub use mooncake::MooncakePull;

/// How long a read may take before the decode engine gives up on it.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request line the side channel reads.
const MAX_LINE: usize = 64 * 1024;

/// What a decode engine does when the blocks cannot be read (vLLM's
/// `kv_load_failure_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LoadFailurePolicy {
    /// The request fails (vLLM's default).
    #[default]
    Fail,
    /// The prompt is prefilled locally.
    Recompute,
}

/// The connector an engine speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Connector {
    /// vLLM's `NixlConnector`: the prefill answer says where its blocks are.
    #[default]
    Nixl,
    /// vLLM's `MooncakeConnector`: a router-minted `transfer_id`, and a bootstrap server.
    Mooncake,
}

/// `--kv-transfer-config`, as far as the simulator reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct KvTransferConfig {
    pub connector: Connector,
    /// Mooncake's bootstrap server port (`VLLM_MOONCAKE_BOOTSTRAP_PORT`, 8998 in vLLM); 0
    /// for a free one.
    pub bootstrap_port: u16,
    /// The engine id its answers name (`remote_engine_id`); random when unset.
    pub engine_id: Option<String>,
    /// How long blocks a decode has not read are kept (`kv_lease_duration`).
    pub lease: Duration,
    /// The time a read takes per token read.
    pub transfer_per_token: Duration,
    pub load_failure_policy: LoadFailurePolicy,
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        KvTransferConfig {
            connector: Connector::Nixl,
            bootstrap_port: 0,
            engine_id: None,
            lease: Duration::from_secs(30),
            transfer_per_token: Duration::from_micros(1),
            load_failure_policy: LoadFailurePolicy::Fail,
        }
    }
}

impl KvTransferConfig {
    /// Reads vLLM's `--kv-transfer-config` JSON: `kv_connector` must be `NixlConnector` or
    /// `MooncakeConnector` (whose bootstrap port is left at 0: vLLM takes it from the
    /// environment, and so does the simulator's command line);
    /// `engine_id`, `kv_load_failure_policy` and `kv_connector_extra_config.kv_lease_duration`
    /// (seconds) are read, and the simulator's own
    /// `kv_connector_extra_config.transfer_us_per_token`.
    pub fn from_vllm_json(text: &str) -> Result<Self, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let connector = value.get("kv_connector").and_then(Value::as_str);
        let connector = match connector {
            Some("NixlConnector") => Connector::Nixl,
            Some("MooncakeConnector") => Connector::Mooncake,
            other => {
                return Err(format!(
                    "kv_connector {other:?} is not simulated (NixlConnector and \
                     MooncakeConnector are)"
                ))
            }
        };
        let mut config = KvTransferConfig {
            connector,
            engine_id: value
                .get("engine_id")
                .and_then(Value::as_str)
                .map(str::to_string),
            ..KvTransferConfig::default()
        };
        if let Some(policy) = value.get("kv_load_failure_policy") {
            config.load_failure_policy =
                serde_json::from_value(policy.clone()).map_err(|e| e.to_string())?;
        }
        let extra = value.get("kv_connector_extra_config");
        if let Some(seconds) = extra
            .and_then(|e| e.get("kv_lease_duration"))
            .and_then(Value::as_f64)
        {
            config.lease = Duration::try_from_secs_f64(seconds).map_err(|e| e.to_string())?;
        }
        if let Some(us) = extra
            .and_then(|e| e.get("transfer_us_per_token"))
            .and_then(Value::as_f64)
        {
            config.transfer_per_token =
                Duration::try_from_secs_f64(us / 1e6).map_err(|e| e.to_string())?;
        }
        Ok(config)
    }
}

/// What a request's `kv_transfer_params` ask of this engine.
#[derive(Clone, Debug, PartialEq)]
pub enum TransferAsk {
    /// The prefill leg: prefill, keep the blocks, answer where they are (NIXL), or keep them
    /// under the router's `transfer_id` (Mooncake).
    RemoteDecode { transfer_id: Option<String> },
    /// The decode leg: read the blocks from the prefill engine first (NIXL).
    RemotePrefill(RemoteBlocks),
    /// The decode leg: pull the blocks kept under a `transfer_id` (Mooncake).
    Pull(MooncakePull),
    /// `do_remote_prefill` without the keys a read needs: ignored, as vLLM logs and ignores it.
    Invalid,
}

/// Where a decode leg's blocks are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RemoteBlocks {
    pub engine_id: String,
    pub request_id: String,
    pub block_ids: Vec<u64>,
    pub host: String,
    pub port: u16,
    /// What the prefill engine's prefix cache served of the prompt: vLLM 0.32 reports it as
    /// the decode answer's `cached_tokens`.
    pub prefill_cached: Option<u32>,
}

impl TransferAsk {
    /// Reads a request's `kv_transfer_params` (`None` for absent or `null`).
    pub fn parse(params: Option<&Value>) -> Option<TransferAsk> {
        let params = params.filter(|p| !p.is_null())?;
        let flag = |key| params.get(key).and_then(Value::as_bool).unwrap_or(false);
        let text = |key| params.get(key).and_then(Value::as_str).map(str::to_string);
        if flag("do_remote_decode") {
            return Some(TransferAsk::RemoteDecode {
                transfer_id: text("transfer_id"),
            });
        }
        if !flag("do_remote_prefill") {
            return None;
        }
        if let (Some(transfer_id), Some(bootstrap), Some(engine_id)) = (
            text("transfer_id"),
            text("remote_bootstrap_addr"),
            text("remote_engine_id"),
        ) {
            return Some(TransferAsk::Pull(MooncakePull {
                transfer_id,
                bootstrap,
                engine_id,
            }));
        }
        let blocks = (|| {
            Some(RemoteBlocks {
                engine_id: text("remote_engine_id")?,
                request_id: text("remote_request_id")?,
                block_ids: block_ids(params.get("remote_block_ids")?)?,
                host: text("remote_host")?,
                port: u16::try_from(params.get("remote_port")?.as_u64()?).ok()?,
                prefill_cached: params
                    .get("remote_prefill_cached_tokens")
                    .and_then(Value::as_u64)
                    .and_then(|n| u32::try_from(n).ok()),
            })
        })();
        Some(blocks.map_or(TransferAsk::Invalid, TransferAsk::RemotePrefill))
    }
}

/// `remote_block_ids`: one list per KV-cache group (vLLM 0.32: `[[1, 2, 3]]`), or one list.
fn block_ids(value: &Value) -> Option<Vec<u64>> {
    let mut ids = Vec::new();
    for item in value.as_array()? {
        match item {
            Value::Array(group) => {
                for id in group {
                    ids.push(id.as_u64()?);
                }
            }
            id => ids.push(id.as_u64()?),
        }
    }
    Some(ids)
}

/// Why a read failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadFailure {
    /// The side channel could not be reached or did not answer in time.
    Unreachable(String),
    /// The prefill engine has no such lease (expired, read already, never kept) or the
    /// blocks named are not its.
    Refused(String),
}

/// Blocks kept for a decode engine to read.
struct Lease {
    block_ids: Vec<u64>,
    tokens: u32,
    expires: Instant,
}

/// One engine's side of the transfers: the leases it keeps as a prefill engine, its side
/// channel, and the counts `/sim/kv_transfer` reports.
pub struct KvTransfer {
    config: KvTransferConfig,
    engine_id: String,
    side_channel: SocketAddr,
    /// Mooncake's bootstrap server, when the engine speaks it.
    bootstrap: Option<SocketAddr>,
    leases: Mutex<HashMap<String, Lease>>,
    next_block: AtomicU64,
    lent: AtomicU64,
    read: AtomicU64,
    refused: AtomicU64,
    expired: AtomicU64,
}

/// A side-channel request: read these blocks (all that are kept under `request_id` when
/// none are named: Mooncake's pull by `transfer_id`).
#[derive(Serialize, Deserialize)]
struct ReadRequest {
    engine_id: String,
    request_id: String,
    block_ids: Vec<u64>,
}

/// A side-channel answer: the tokens read, or why not.
#[derive(Serialize, Deserialize)]
struct ReadAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// What `/sim/kv_transfer` answers.
#[derive(Clone, Debug, Serialize)]
pub struct KvTransferJson {
    pub engine_id: String,
    pub side_channel: String,
    /// Mooncake's bootstrap server, when the engine speaks it.
    pub bootstrap: Option<String>,
    /// Leases kept now.
    pub leases: usize,
    /// Leases handed out, read, refused a read, and expired unread, since the start.
    pub lent: u64,
    pub read: u64,
    pub refused: u64,
    pub expired: u64,
}

impl KvTransfer {
    /// Opens the side channel on `ip` (a free port) and serves it until the engine is gone.
    pub async fn start(config: KvTransferConfig, ip: IpAddr) -> std::io::Result<Arc<Self>> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let side_channel = listener.local_addr()?;
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| format!("sim-{:016x}", rand::random::<u64>()));
        let bootstrap = match config.connector {
            Connector::Mooncake => Some(
                mooncake::serve_bootstrap(
                    SocketAddr::new(ip, config.bootstrap_port),
                    engine_id.clone(),
                    side_channel,
                )
                .await?,
            ),
            Connector::Nixl => None,
        };
        let transfer = Arc::new(KvTransfer {
            config,
            engine_id,
            side_channel,
            bootstrap,
            leases: Mutex::new(HashMap::new()),
            next_block: AtomicU64::new(1),
            lent: AtomicU64::new(0),
            read: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        });
        tokio::spawn(serve(listener, Arc::downgrade(&transfer)));
        Ok(transfer)
    }

    pub fn config(&self) -> &KvTransferConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Lease>> {
        self.leases
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps the blocks of a prefilled prompt of `tokens` (`cached` of them served by the
    /// prefix cache) for a decode engine, and returns the answer's `kv_transfer_params`, as
    /// vLLM 0.32 writes them. When `lost`, the parameters are answered but the blocks are not
    /// kept.
    pub fn lend(
        &self,
        request_id: &str,
        tokens: u32,
        cached: u32,
        block_size: u32,
        lost: bool,
    ) -> Value {
        let block_ids = self.keep(request_id, tokens, block_size, lost);
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.side_channel.ip().to_string(),
            "remote_port": self.side_channel.port(),
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": null,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached,
        })
    }

    /// Keeps a prefilled prompt's blocks under the router's `transfer_id` (Mooncake: the
    /// answer says nothing of them). When `lost`, they are not kept.
    pub fn keep_for_pull(&self, transfer_id: &str, tokens: u32, block_size: u32, lost: bool) {
        self.keep(transfer_id, tokens, block_size, lost);
    }

    /// Leases a prompt's blocks under `key`, counting it; returns their ids.
    fn keep(&self, key: &str, tokens: u32, block_size: u32, lost: bool) -> Vec<u64> {
        let blocks = u64::from(tokens.div_ceil(block_size.max(1)));
        let first = self.next_block.fetch_add(blocks, Ordering::Relaxed);
        let block_ids: Vec<u64> = (first..first + blocks).collect();
        if !lost {
            let mut leases = self.lock();
            self.expire(&mut leases);
            leases.insert(
                key.to_string(),
                Lease {
                    block_ids: block_ids.clone(),
                    tokens,
                    expires: Instant::now() + self.config.lease,
                },
            );
        }
        self.lent.fetch_add(1, Ordering::Relaxed);
        block_ids
    }

    /// Drops the leases past their expiry, counting them.
    fn expire(&self, leases: &mut HashMap<String, Lease>) {
        let now = Instant::now();
        let before = leases.len();
        leases.retain(|_, lease| lease.expires > now);
        let gone = (before - leases.len()) as u64;
        self.expired.fetch_add(gone, Ordering::Relaxed);
    }

    /// Serves one read: the lease's tokens, which ends it.
    fn take(&self, request: &ReadRequest) -> ReadAnswer {
        let mut leases = self.lock();
        self.expire(&mut leases);
        let refused = |why: &str| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            ReadAnswer {
                tokens: None,
                error: Some(why.to_string()),
            }
        };
        if request.engine_id != self.engine_id {
            return refused("unknown engine id");
        }
        match leases.get(&request.request_id) {
            None => refused("no blocks kept for this request (expired, read or never kept)"),
            Some(lease)
                if !request.block_ids.is_empty() && lease.block_ids != request.block_ids =>
            {
                refused("the blocks named are not this request's")
            }
            Some(_) => {
                let tokens = leases.remove(&request.request_id).map(|lease| lease.tokens);
                self.read.fetch_add(1, Ordering::Relaxed);
                ReadAnswer {
                    tokens,
                    error: None,
                }
            }
        }
    }

    /// Reads `remote`'s blocks from its prefill engine: the tokens read, after the time their
    /// size takes.
    pub async fn read(&self, remote: &RemoteBlocks) -> Result<u32, ReadFailure> {
        let tokens = tokio::time::timeout(READ_TIMEOUT, read_remote(remote))
            .await
            .map_err(|_| ReadFailure::Unreachable("the side channel did not answer".into()))??;
        self.wait_transfer(tokens).await;
        Ok(tokens)
    }

    /// Pulls the blocks a Mooncake prefill engine keeps under `pull.transfer_id`: its side
    /// channel found through its bootstrap server.
    pub async fn pull(&self, pull: &MooncakePull) -> Result<u32, ReadFailure> {
        let tokens = tokio::time::timeout(READ_TIMEOUT, mooncake::pull(pull))
            .await
            .map_err(|_| ReadFailure::Unreachable("the prefill engine did not answer".into()))??;
        self.wait_transfer(tokens).await;
        Ok(tokens)
    }

    /// The time moving `tokens` takes.
    async fn wait_transfer(&self, tokens: u32) {
        let took = self.config.transfer_per_token.saturating_mul(tokens);
        if !took.is_zero() {
            tokio::time::sleep(took).await;
        }
    }

    pub fn json(&self) -> KvTransferJson {
        let leases = {
            let mut leases = self.lock();
            self.expire(&mut leases);
            leases.len()
        };
        KvTransferJson {
            engine_id: self.engine_id.clone(),
            side_channel: self.side_channel.to_string(),
            bootstrap: self.bootstrap.map(|addr| addr.to_string()),
            leases,
            lent: self.lent.load(Ordering::Relaxed),
            read: self.read.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
        }
    }
}

/// One read over a prefill engine's side channel.
pub(crate) async fn read_remote(remote: &RemoteBlocks) -> Result<u32, ReadFailure> {
    let unreachable = |e: std::io::Error| ReadFailure::Unreachable(e.to_string());
    let stream = TcpStream::connect((remote.host.as_str(), remote.port))
        .await
        .map_err(unreachable)?;
    let (reader, mut writer) = stream.into_split();
    let request = ReadRequest {
        engine_id: remote.engine_id.clone(),
        request_id: remote.request_id.clone(),
        block_ids: remote.block_ids.clone(),
    };
    let mut line =
        serde_json::to_vec(&request).map_err(|e| ReadFailure::Unreachable(e.to_string()))?;
    line.push(b'\n');
    writer.write_all(&line).await.map_err(unreachable)?;
    let mut answer = String::new();
    BufReader::new(reader.take(MAX_LINE as u64))
        .read_line(&mut answer)
        .await
        .map_err(unreachable)?;
    let answer: ReadAnswer = serde_json::from_str(&answer)
        .map_err(|e| ReadFailure::Unreachable(format!("unreadable answer: {e}")))?;
    match (answer.tokens, answer.error) {
        (Some(tokens), None) => Ok(tokens),
        (_, Some(error)) => Err(ReadFailure::Refused(error)),
        (None, None) => Err(ReadFailure::Refused("empty answer".into())),
    }
}

/// The side channel's accept loop; it ends when the engine is gone.
async fn serve(listener: TcpListener, transfer: Weak<KvTransfer>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        if transfer.strong_count() == 0 {
            return;
        }
        let transfer = transfer.clone();
        tokio::spawn(async move {
            let (reader, mut writer) = stream.into_split();
            let mut line = String::new();
            let mut reader = BufReader::new(reader.take(MAX_LINE as u64));
            let read = reader.read_line(&mut line);
            if tokio::time::timeout(READ_TIMEOUT, read).await.is_err() {
                return;
            }
            let Some(transfer) = transfer.upgrade() else {
                return;
            };
            let answer = match serde_json::from_str::<ReadRequest>(&line) {
                Ok(request) => transfer.take(&request),
                Err(e) => ReadAnswer {
                    tokens: None,
                    error: Some(format!("unreadable request: {e}")),
                },
            };
            if let Ok(mut bytes) = serde_json::to_vec(&answer) {
                bytes.push(b'\n');
                let _ = writer.write_all(&bytes).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_s_parameters_are_read_as_vllm_reads_them() {
        assert_eq!(TransferAsk::parse(None), None);
        assert_eq!(TransferAsk::parse(Some(&Value::Null)), None);
        let prefill = json!({"do_remote_decode": true, "do_remote_prefill": false,
                             "remote_engine_id": null, "remote_block_ids": null});
        assert_eq!(
            TransferAsk::parse(Some(&prefill)),
            Some(TransferAsk::RemoteDecode { transfer_id: None })
        );
        let decode = json!({"do_remote_prefill": true, "do_remote_decode": false,
                            "remote_block_ids": [[1, 2]], "remote_engine_id": "e",
                            "remote_request_id": "r", "remote_host": "127.0.0.1",
                            "remote_port": 5600, "tp_size": 1});
        assert!(matches!(
            TransferAsk::parse(Some(&decode)),
            Some(TransferAsk::RemotePrefill(RemoteBlocks { port: 5600, .. }))
        ));
        let partial = json!({"do_remote_prefill": true, "remote_engine_id": "e"});
        assert_eq!(
            TransferAsk::parse(Some(&partial)),
            Some(TransferAsk::Invalid)
        );
    }

    #[test]
    fn vllm_s_kv_transfer_config_is_read() {
        let config = KvTransferConfig::from_vllm_json(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"kv_lease_duration":2,"transfer_us_per_token":3}}"#,
        )
        .unwrap();
        assert_eq!(config.lease, Duration::from_secs(2));
        assert_eq!(config.transfer_per_token, Duration::from_micros(3));
        assert_eq!(config.load_failure_policy, LoadFailurePolicy::Recompute);
        assert!(
            KvTransferConfig::from_vllm_json(r#"{"kv_connector":"LMCacheConnectorV1"}"#).is_err()
        );
    }

    #[tokio::test]
    async fn blocks_are_read_once_and_not_after_their_lease() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let prefill = KvTransfer::start(
            KvTransferConfig {
                lease: Duration::from_millis(200),
                transfer_per_token: Duration::ZERO,
                ..KvTransferConfig::default()
            },
            ip,
        )
        .await
        .unwrap();
        let decode = KvTransfer::start(KvTransferConfig::default(), ip)
            .await
            .unwrap();
        let remote = |params: &Value| match TransferAsk::parse(Some(params)) {
            Some(TransferAsk::RemotePrefill(remote)) => remote,
            other => panic!("{other:?}"),
        };
        let first = remote(&prefill.lend("a", 100, 0, 16, false));
        assert_eq!(first.block_ids.len(), 7);
        assert_eq!(decode.read(&first).await, Ok(100));
        assert!(matches!(
            decode.read(&first).await,
            Err(ReadFailure::Refused(_))
        ));
        // Not read within its lease: gone.
        let late = remote(&prefill.lend("b", 32, 0, 16, false));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(matches!(
            decode.read(&late).await,
            Err(ReadFailure::Refused(_))
        ));
        // Answered, never kept.
        let lost = remote(&prefill.lend("c", 32, 0, 16, true));
        assert!(matches!(
            decode.read(&lost).await,
            Err(ReadFailure::Refused(_))
        ));
        let counts = prefill.json();
        assert_eq!((counts.lent, counts.read, counts.expired), (3, 1, 1));
        assert_eq!(counts.leases, 0);
    }

    #[tokio::test]
    async fn a_mooncake_pull_finds_its_engine_through_the_bootstrap_server() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let mooncake = KvTransferConfig {
            connector: Connector::Mooncake,
            transfer_per_token: Duration::ZERO,
            ..KvTransferConfig::default()
        };
        let prefill = KvTransfer::start(mooncake.clone(), ip).await.unwrap();
        let decode = KvTransfer::start(mooncake, ip).await.unwrap();
        let bootstrap = format!("http://{}", prefill.json().bootstrap.unwrap());
        prefill.keep_for_pull("xfer-1", 100, 16, false);
        let params = json!({"do_remote_prefill": true, "do_remote_decode": false,
                            "remote_bootstrap_addr": bootstrap,
                            "remote_engine_id": prefill.json().engine_id,
                            "transfer_id": "xfer-1"});
        let Some(TransferAsk::Pull(pull)) = TransferAsk::parse(Some(&params)) else {
            panic!("{params}");
        };
        assert_eq!(decode.pull(&pull).await, Ok(100));
        assert!(matches!(
            decode.pull(&pull).await,
            Err(ReadFailure::Refused(_))
        ));
        let stranger = MooncakePull {
            engine_id: "another".into(),
            ..pull
        };
        assert!(matches!(
            decode.pull(&stranger).await,
            Err(ReadFailure::Refused(_))
        ));
        assert_eq!(prefill.json().read, 1);
    }
}
