//! Server assembly: config → Pingora server with the proxy and admin services.

use crate::admin::Admin;
use crate::caps::Caps;
use crate::config::{Config, Listener};
use crate::discovery::DiscoveryService;
use crate::edge::{ConnectionLimits, Guarded};
use crate::health::HealthService;
use crate::proxy::Lasting;
use crate::proxy::{Proxy, Sluice};
use crate::reload::{Frozen, Reload};
use arc_swap::ArcSwap;
use pingora_core::apps::HttpServerOptions;
use pingora_core::connectors::http::v1 as http1;
use pingora_core::connectors::ConnectorOptions;
use pingora_core::listeners::tls::TlsSettings;
use pingora_core::listeners::{L4BufferSettings, ListenerConfig};
use pingora_core::protocols::http::v2::server::{default_h2_options, H2Options};
use pingora_core::server::configuration::Opt;
use pingora_core::server::Server;
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;
use pingora_proxy::HttpProxy;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Builds the Pingora server for `config`. Start-up errors (a plugin that refuses its config,
/// a TLS key that does not load) come back as text for the command line.
pub fn build(mut config: Config, opt: Opt) -> Result<Server, String> {
    crate::run_dir::make_private(&config.server.pid_file, "pingora.pid_file")?;
    crate::run_dir::make_private(&config.server.upgrade_sock, "pingora.upgrade_sock")?;
    let upgrade_note = crate::reload::upgrade_note(&config.server.upgrade_sock);
    if opt.upgrade {
        crate::reload::leave_upgrade_note(&upgrade_note, &config.source)?;
    }
    let frozen = Frozen::of(&config);
    let mut server = Server::new_with_opt_and_conf(opt, std::mem::take(&mut config.server));
    server.bootstrap();
    let upstream = ConnectorOptions::from_server_conf(&server.configuration);
    let grace = Duration::from_secs(server.configuration.grace_period_seconds.unwrap_or(0));
    let (grace_over, streams_end) = tokio::sync::watch::channel(false);
    let lasting = lasting(&config, streams_end, &upstream);
    let probes = Arc::clone(&lasting.probes);
    crate::proxy::pool_calls::use_connector(Arc::clone(&probes));
    // What the services keep of the config: the first generation takes the rest.
    let connection_limits = config.limits.connections.clone();
    let h2_streams = config.limits.h2_max_concurrent_streams;
    let admin_address = config.admin;
    let admin_hosts = config.admin_hosts.clone();
    let listeners = config.listeners.clone();
    let source = config.source.clone();
    let discovery = Arc::new(std::mem::take(&mut config.discovery));
    let sluice = Sluice::new(config, &lasting);
    let pools = Arc::clone(&sluice.pools);
    let current = Arc::new(ArcSwap::from_pointee(sluice));
    let (pools_now, pools_changes) = tokio::sync::watch::channel(pools);
    let (discovery_now, discovery_changes) = tokio::sync::watch::channel(discovery);
    let drain = crate::drain::watch(
        &server,
        lasting.requests.clone(),
        Arc::clone(&current),
        grace,
        grace_over,
    );
    let mut proxy = proxy_service(&server, &current, &listeners, connection_limits, h2_streams);
    add_listeners(&mut proxy, &listeners)?;
    server.add_service(proxy);
    server.add_service(background_service("drain watcher", drain));
    server.add_service(background_service(
        "health checks",
        HealthService::new(pools_changes.clone(), Arc::clone(&probes)),
    ));
    server.add_service(background_service(
        "pool keeper",
        crate::keeper::KeeperService::new(pools_changes),
    ));
    server.add_service(background_service(
        "discovery",
        DiscoveryService::new(discovery_changes),
    ));
    let phases = std::sync::Mutex::new(Some(server.watch_execution_phase()));
    server.add_service(background_service(
        "config reload",
        Reload {
            phases,
            source,
            upgrade_note,
            current: Arc::clone(&current),
            lasting,
            frozen,
            pools_now,
            discovery_now,
        },
    ));
    if let Some(address) = admin_address {
        server.add_service(admin_service(address, current, admin_hosts));
        tracing::info!("admin listening on {address}");
    }
    Ok(server)
}

/// What every generation of the config shares: the in-flight caps, the upstream
/// connections, the end of the grace period.
fn lasting(
    config: &Config,
    streams_end: tokio::sync::watch::Receiver<bool>,
    upstream: &ConnectorOptions,
) -> Lasting {
    Lasting {
        requests: Caps::new(
            config.limits.max_requests_in_flight,
            config.limits.max_requests_in_flight_per_client,
        ),
        streams_end,
        connector: Arc::new(http1::Connector::new(Some(upstream.clone()))),
        probes: Arc::new(http1::Connector::new(Some(upstream.clone()))),
        upstream_pool: crate::proxy::upstream_pool::UpstreamPool::new(upstream.keepalive_pool_size),
        response_homes: Arc::new(crate::proxy::stored_responses::ResponseHomes::new(
            &config.responses,
            Some(crate::proxy::stored_responses::handoff_file(
                &config.server.upgrade_sock,
            )),
        )),
    }
}

/// The proxy service, without its listeners: HTTP/1.1 and HTTP/2 to the current
/// generation, and below HTTP, on every connection, the connection caps and the header
/// deadline.
fn proxy_service(
    server: &Server,
    current: &Arc<ArcSwap<Sluice>>,
    listeners: &[Listener],
    connection_limits: ConnectionLimits,
    h2_streams: u32,
) -> Service<Guarded<HttpProxy<Proxy>>> {
    let client_header_timeout = connection_limits.header_timeout;
    let proxy_service = Proxy {
        current: Arc::clone(current),
    };
    let mut proxy = pingora_proxy::http_proxy(&server.configuration, proxy_service);
    proxy.h2_options = Some(h2_options(h2_streams));
    // Pingora's h2c switch is per service: on here, and `Guarded` keeps it to the listeners
    // that ask for it (elsewhere the preface is not looked for, and h1 is served).
    let h2c: Vec<_> = listeners
        .iter()
        .filter(|l| l.h2c)
        .map(|l| l.address)
        .collect();
    let mut options = HttpServerOptions::default();
    options.h2c = !h2c.is_empty();
    // An HTTP/2 connection with no stream open is closed after the time a request's head may
    // take, as an idle HTTP/1.1 one is: connections that sent only the preface held
    // `max_connections` for ever.
    options.h2_idle_timeout = Some(client_header_timeout);
    proxy.server_options = Some(options);
    Service::new(
        "sluice proxy".to_string(),
        Guarded::new(proxy, connection_limits).with_h2c(h2c),
    )
}

/// Binds the proxy to its listeners; a TLS listener whose files do not load is an error.
///
/// Plain listeners read straight into Pingora's header and body buffers, without its
/// 64 KiB L4 read buffer per connection: an open stream would hold it (zeroed, so
/// resident) for its whole life, and a request head fits the header buffer anyway; large
/// bodies are read into the 64 KiB body buffer, past the L4 buffer, either way. Measured
/// with 1,000 open streams: 209 -> 144 KB per stream. TLS listeners keep it: rustls reads
/// record by record, and the buffer saves those syscalls.
fn add_listeners<A>(proxy: &mut Service<A>, listeners: &[Listener]) -> Result<(), String> {
    for listener in listeners {
        let address = listener.address.to_string();
        match &listener.tls {
            None => proxy.add_listener(
                ListenerConfig::tcp(&address).l4_buffer(L4BufferSettings::default().read(0)),
            ),
            Some(tls) => {
                let mut settings = TlsSettings::intermediate(
                    &tls.cert.to_string_lossy(),
                    &tls.key.to_string_lossy(),
                )
                .map_err(|e| format!("listener {address}: cannot load TLS files: {e}"))?;
                if listener.http2 {
                    settings.enable_h2();
                }
                proxy.add_tls_with_settings(&address, None, settings);
            }
        }
        tracing::info!(
            "proxy listening on {address}{}",
            match (&listener.tls, listener.http2, listener.h2c) {
                (Some(_), true, _) => " (TLS, h2 and http/1.1)",
                (Some(_), false, _) => " (TLS, http/1.1)",
                (None, _, true) => " (http/1.1 and h2c)",
                (None, _, false) => "",
            }
        );
    }
    Ok(())
}

/// The admin service on `address`, reading the current generation.
/// The admin listener's connection caps and header deadline (see [`admin_service`]).
const ADMIN_MAX_CONNECTIONS: usize = 64;
const ADMIN_MAX_CONNECTIONS_PER_CLIENT: usize = 16;
const ADMIN_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

fn admin_service(
    address: SocketAddr,
    current: Arc<ArcSwap<Sluice>>,
    hosts: Vec<String>,
) -> Service<Guarded<Admin>> {
    let admin = Admin {
        current,
        started: Instant::now(),
        hosts,
    };
    // The admin answers operators and Prometheus: a few connections, short headers. Bounded
    // as the proxy's are, so that a client that reaches it cannot hold it (slowloris, a
    // flood of idle connections) and blind the monitoring.
    let limits = ConnectionLimits {
        max_connections: ADMIN_MAX_CONNECTIONS,
        max_connections_per_client: ADMIN_MAX_CONNECTIONS_PER_CLIENT,
        header_timeout: ADMIN_HEADER_TIMEOUT,
    };
    let admin = Guarded::new(admin, limits).uncounted();
    let mut service = Service::new("sluice admin".to_string(), admin);
    service.add_tcp(&address.to_string());
    service
}

/// HTTP/2 settings for client connections: Pingora's bounded defaults (64 KiB of decoded
/// headers), `streams` streams at once, and windows that bound what one connection can
/// make Sluice hold. A client uploading sends at most 256 KiB per stream and 1 MiB per
/// connection before Sluice reads it; an answer waits in at most 64 KiB per stream for a
/// client that does not open its window (h2's default is 400 KiB), after which the stream's
/// writes block and `limits.send_timeout` ends that stream alone.
fn h2_options(streams: u32) -> H2Options {
    let mut options = default_h2_options();
    options
        .max_concurrent_streams(streams)
        .initial_window_size(256 * 1024)
        .initial_connection_window_size(1024 * 1024)
        .max_send_buffer_size(64 * 1024);
    options
}
