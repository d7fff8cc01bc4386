//! `sluice demo`: the proxy with the shipped config, and simulated vLLM pools in the same
//! process, so a new user can try everything with nothing else installed.
//!
//! The config is `-c FILE` if given, else `conf/sluice.yaml` from the working directory, else
//! the copy built into the binary. Its `draft` and `target` pools are pointed at simulators on
//! free local ports; the proxy and admin keep their configured addresses unless those are taken.

use crate::config::Config;
use pingora_core::server::configuration::Opt;
use serde_yaml_ng::Value;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use vllm_sim::{Profile, Sim, SimConfig};

/// The shipped config, for a binary run away from the source tree.
const SHIPPED_CONFIG: &str = include_str!("../conf/sluice.yaml");

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Port of the proxy (default: the config's, or a free one if it is taken).
    #[arg(long)]
    pub port: Option<u16>,
    /// Port of the admin listener (default: the config's, or a free one if it is taken).
    #[arg(long)]
    pub admin_port: Option<u16>,
}

pub fn run(opt: Opt, args: DemoArgs) -> Result<(), String> {
    let (path, text) = config_text(opt.conf.as_deref())?;

    // The simulators run on a runtime of their own: Pingora builds its own per service.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime for the simulators: {e}"))?;
    let mut yaml: Value =
        serde_yaml_ng::from_str(&text).map_err(|e| format!("{}: not YAML: {e}", path.display()))?;
    // Each simulator serves the names its pool lists, as vLLM's --served-model-name would:
    // the speculative selector needs both pools to serve the shared model name.
    let start = |profile, pool: &str| {
        let mut config = SimConfig::profile(profile);
        let names = pool_models(&yaml, pool);
        if !names.is_empty() {
            config = config.with_served_model_names(names);
        }
        runtime.block_on(vllm_sim::start(config))
    };
    let draft = start(Profile::Draft, "draft").map_err(|e| format!("draft simulator: {e}"))?;
    let target = start(Profile::Target, "target").map_err(|e| format!("target simulator: {e}"))?;

    let proxy = point_at_simulators(&mut yaml, &draft, &target, &args)?;
    let text = serde_yaml_ng::to_string(&yaml).map_err(|e| e.to_string())?;
    let calls: std::sync::Arc<dyn sluice_sdk::calls::PoolCalls> =
        std::sync::Arc::new(crate::proxy::CoreCalls);
    let config = Config::parse(&text, &path, &calls).map_err(|e| e.to_string())?;
    crate::logging::init(&config.log, config.telemetry.as_ref());

    let server_opt = Opt {
        daemon: false,
        upgrade: false,
        conf: None,
        ..opt
    };
    let server = crate::server::build(config, server_opt)?;
    print_welcome(&proxy, &draft, &target);
    // Never returns; the simulators' runtime lives as long as the process.
    let _keep = runtime;
    server.run_forever()
}

struct Addresses {
    proxy: SocketAddr,
    admin: SocketAddr,
}

fn config_text(flag: Option<&str>) -> Result<(PathBuf, String), String> {
    if let Some(p) = flag {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"))?;
        return Ok((PathBuf::from(p), text));
    }
    let local = PathBuf::from("conf/sluice.yaml");
    match std::fs::read_to_string(&local) {
        Ok(text) => Ok((local, text)),
        Err(_) => Ok((
            PathBuf::from("conf/sluice.yaml (built in)"),
            SHIPPED_CONFIG.to_string(),
        )),
    }
}

/// Rewrites the config for the demo: pools → simulators, free ports, private pid/socket files.
/// The `models` of the pool named `name` in the config.
fn pool_models(yaml: &Value, name: &str) -> Vec<String> {
    yaml.get("pools")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .filter(|p| p.get("name").and_then(Value::as_str) == Some(name))
        .filter_map(|p| p.get("models").and_then(Value::as_sequence))
        .flatten()
        .filter_map(|m| m.as_str().map(str::to_string))
        .collect()
}

fn point_at_simulators(
    yaml: &mut Value,
    draft: &Sim,
    target: &Sim,
    args: &DemoArgs,
) -> Result<Addresses, String> {
    let pools = yaml
        .get_mut("pools")
        .and_then(Value::as_sequence_mut)
        .ok_or("the config has no pools")?;
    let mut pointed = 0;
    for pool in pools.iter_mut() {
        let sim = match pool.get("name").and_then(Value::as_str) {
            Some("draft") => draft,
            Some("target") => target,
            _ => continue,
        };
        pool["backends"] = serde_yaml_ng::from_str(&format!("[{{address: \"{}\"}}]", sim.addr()))
            .map_err(|e| e.to_string())?;
        pointed += 1;
    }
    if pointed == 0 {
        return Err("the config has no pool named `draft` or `target` to simulate".into());
    }

    let proxy = choose_address(
        configured(yaml, &["listeners", "0", "address"]),
        args.port,
        8080,
    )?;
    let admin = choose_address(
        configured(yaml, &["admin", "address"]),
        args.admin_port,
        9090,
    )?;
    set(yaml, "listeners", &format!("[{{address: \"{proxy}\"}}]"))?;
    set(yaml, "admin", &format!("{{address: \"{admin}\"}}"))?;
    if let Some(plugins) = yaml.get_mut("plugins").and_then(Value::as_mapping_mut) {
        plugins.insert(
            Value::from("tenants"),
            serde_yaml_ng::from_str(DEMO_TENANTS).map_err(|e| e.to_string())?,
        );
        // The README's first requests carry no API key: in the demo, they share the cache.
        if let Some(cache) = plugins.get_mut("cache").and_then(Value::as_mapping_mut) {
            cache.insert(
                Value::from("tenant"),
                serde_yaml_ng::from_str("{anonymous: share}").map_err(|e| e.to_string())?,
            );
        }
    }
    // A directory of the demo's own (see `run_dir`): created private, refused if another
    // user made it first.
    let run = std::env::temp_dir().join(format!("sluice-demo-{}", std::process::id()));
    set_str(yaml, "pid_file", run.join("sluice.pid"));
    set_str(yaml, "upgrade_sock", run.join("upgrade.sock"));
    Ok(Addresses { proxy, admin })
}

fn configured(yaml: &Value, keys: &[&str]) -> Option<SocketAddr> {
    let mut v = yaml;
    for k in keys {
        v = match k.parse::<usize>() {
            Ok(i) => v.get(i)?,
            Err(_) => v.get(*k)?,
        };
    }
    v.as_str()?.parse().ok()
}

/// Replaces the top-level `key` with `value_yaml`.
fn set(yaml: &mut Value, key: &str, value_yaml: &str) -> Result<(), String> {
    let value: Value = serde_yaml_ng::from_str(value_yaml).map_err(|e| e.to_string())?;
    if let Some(map) = yaml.as_mapping_mut() {
        map.insert(Value::from(key), value);
    }
    Ok(())
}

fn set_str(yaml: &mut Value, key: &str, path: PathBuf) {
    if let Some(pingora) = yaml.get_mut("pingora").and_then(Value::as_mapping_mut) {
        pingora.insert(
            Value::from(key),
            Value::from(path.to_string_lossy().into_owned()),
        );
    }
}

/// The asked-for port, else the configured address if free, else a free port on loopback.
fn choose_address(
    configured: Option<SocketAddr>,
    port: Option<u16>,
    fallback_port: u16,
) -> Result<SocketAddr, String> {
    let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
    if let Some(port) = port {
        return Ok(loopback(port));
    }
    let wanted = configured.unwrap_or_else(|| loopback(fallback_port));
    if TcpListener::bind(wanted).is_ok() {
        return Ok(wanted);
    }
    let free = TcpListener::bind(loopback(0))
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?;
    println!("note: {wanted} is taken; using {free} instead");
    Ok(free)
}

/// The demo's tenants, as `conf/examples/tenants.yaml` has them (keys `sk-alpha-demo` and
/// `sk-beta-demo`), and, so that the README's first commands work without a key, requests
/// without one as the tenant `anonymous`: an operator's choice, off unless configured.
const DEMO_TENANTS: &str = r#"
enabled: true
defaults: {may_force_target: true}
tenants:
  alpha:
    keys: ["sha256:684455aba2f4e49856693f862d62ed1756ea87a33e1d4340560fe704c7eee471"]
    limits: {requests_per_minute: 5}
    may_force_target: false
  beta:
    keys: ["sha256:d18241e127ee84c855b692c684e0d23b5fb0f73870dab1381061a3ba65866277"]
    limits: {output_tokens_per_minute: 10000}
anonymous:
  limits: {requests_per_minute: 600}
unknown_key_message: >-
  Incorrect API key provided. This is the Sluice demo: it accepts the keys sk-alpha-demo and
  sk-beta-demo, and requests without a key (as the tenant `anonymous`).
"#;

fn print_welcome(addresses: &Addresses, draft: &Sim, target: &Sim) {
    let proxy = format!("http://{}", addresses.proxy);
    let admin = format!("http://{}", addresses.admin);
    let (d, t) = (draft.model(), target.model());
    println!(
        r#"
Sluice demo: the proxy and two simulated vLLM pools, in this process.

  proxy: {proxy}
  admin: {admin}   (/ /status /metrics /healthz /readyz)
  draft pool  (simulated vLLM, {d}): {draft_url}
  target pool (simulated vLLM, {t}): {target_url}

Try:
  curl -s {proxy}/v1/chat/completions -H 'content-type: application/json' \
    -d '{{"model": "{d}", "messages": [{{"role": "user", "content": "Hello!"}}], "temperature": 0}}'
  (run it twice: the second answer comes from the cache, with x-cache: HIT; add -i to see)

  curl -sN {proxy}/v1/chat/completions -H 'content-type: application/json' \
    -d '{{"model": "{t}", "stream": true, "messages": [{{"role": "user", "content": "Tell me a story"}}]}}'

  Speculative-first: `llama` goes to the draft pool first, to the target when needed
  (x-sluice-pool and x-sluice-escalated say which and why; -i to see):
  curl -si {proxy}/v1/chat/completions -H 'content-type: application/json' \
    -d '{{"model": "llama", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  curl -si {proxy}/v1/chat/completions -H 'content-type: application/json' -H 'x-sluice-tier: target' \
    -d '{{"model": "llama", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  Tenants: alpha (API key sk-alpha-demo: 5 requests a minute, may not force the target) and
  beta (sk-beta-demo: 10,000 output tokens a minute); no key is the tenant `anonymous`. The
  sixth request of a minute gets 429 with retry-after and x-ratelimit-* (-i to see):
  curl -si {proxy}/v1/chat/completions -H 'content-type: application/json' \
    -H 'authorization: Bearer sk-alpha-demo' \
    -d '{{"model": "llama", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  curl -s {proxy}/v1/models
  curl -s {admin}/status

Stop with Ctrl-C.
"#,
        draft_url = draft.url(),
        target_url = target.url(),
    );
}
