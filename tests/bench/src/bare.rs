//! `pingora (bare)`: the smallest Pingora reverse proxy there is, one `upstream_peer` and
//! nothing else, run by this binary as `sluice-bench bare-pingora`. It is the floor of any
//! proxy built on Pingora here: what Sluice adds is measured against it, and what Pingora
//! itself costs next to nginx shows in its own row.

use anyhow::Result;
use async_trait::async_trait;
use pingora_core::listeners::{L4BufferSettings, ListenerConfig};
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_proxy::{ProxyHttp, Session};
use std::net::SocketAddr;
use std::path::Path;

struct Bare {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora_error::Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }
}

/// Pingora's own knobs (its `ServerConf`), for scenario 21; the default is the `pingora
/// (bare)` contender: Sluice's thread count, Pingora's defaults otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Knobs {
    pub threads: usize,
    pub work_stealing: bool,
    pub listener_tasks_per_fd: usize,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            threads: 2,
            work_stealing: true,
            listener_tasks_per_fd: 1,
        }
    }
}

/// Runs the bare proxy on `listen` in front of `upstream` until the process is stopped; its
/// pid file and upgrade socket are `dir/name.*`. Must not run inside a tokio runtime: Pingora
/// starts its own.
pub fn run(
    listen: SocketAddr,
    upstream: SocketAddr,
    dir: &Path,
    name: &str,
    knobs: Knobs,
) -> Result<()> {
    let conf = ServerConf {
        threads: knobs.threads,
        work_stealing: knobs.work_stealing,
        listener_tasks_per_fd: knobs.listener_tasks_per_fd,
        pid_file: dir.join(format!("{name}.pid")).display().to_string(),
        upgrade_sock: dir.join(format!("{name}.sock")).display().to_string(),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();
    let mut proxy = pingora_proxy::http_proxy_service(&server.configuration, Bare { upstream });
    // The listener as Sluice's plain ones: without the 64 KiB L4 read buffer, so that what
    // the two hold per connection compares like with like.
    proxy.add_listener(
        ListenerConfig::tcp(listen.to_string()).l4_buffer(L4BufferSettings::default().read(0)),
    );
    server.add_service(proxy);
    println!("bare pingora listening on {listen}");
    server.run_forever()
}
