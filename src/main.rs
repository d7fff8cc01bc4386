//! The `sluice` command: Pingora's standard options (`-c`, `-t`, `-u`, `-d`), and `demo`.

use clap::{Parser, Subcommand};
use pingora_core::server::configuration::Opt;
use sluice::config::Config;
use sluice_sdk::calls::PoolCalls;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "An edge proxy for LLM traffic, on Pingora"
)]
struct Cli {
    #[command(flatten)]
    options: Options,
    #[command(subcommand)]
    command: Option<Command>,
}

/// Pingora's standard options, described as Sluice uses them (Pingora's own help describes
/// its library).
#[derive(clap::Args)]
struct Options {
    /// Take the listening sockets over from a running Sluice (a zero-downtime upgrade): wait
    /// on `pingora.upgrade_sock` until the old process is sent SIGQUIT, then serve.
    #[arg(short, long)]
    upgrade: bool,
    /// Run in the background as a daemon (needs `pingora.error_log`; writes
    /// `pingora.pid_file`).
    #[arg(short, long)]
    daemon: bool,
    /// Check the config file and exit: 0 when it would start, else what is wrong, as
    /// `nginx -t` does.
    #[arg(short, long)]
    test: bool,
    /// The config file [default: conf/sluice.yaml].
    #[arg(short, long, value_name = "FILE")]
    conf: Option<String>,
    /// Accepted and ignored, as Pingora does (some test runners pass it).
    #[arg(long, hide = true)]
    nocapture: bool,
}

impl Options {
    /// As Pingora takes them.
    fn into_pingora(self) -> Opt {
        Opt {
            upgrade: self.upgrade,
            daemon: self.daemon,
            nocapture: self.nocapture,
            test: self.test,
            conf: self.conf,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Print an API key's digest, as `plugins.tenants` stores keys: `sha256:<hex>`. Reads the
    /// key from standard input (one line), so it stays out of the shell's history.
    HashKey,
    /// Run the proxy and simulated vLLM pools (draft and target) in one process.
    #[cfg(feature = "demo")]
    Demo(sluice::demo::DemoArgs),
}

/// jemalloc (as Pingora runs at Cloudflare) instead of glibc's malloc, whose arenas cost
/// throughput (16% of the proxy's samples in malloc/free) and keep freed memory resident.
/// Measured against mimalloc with 1,000 open streams (tests/bench, scenario 4): peak RSS 111
/// against 185 MB with plugins off, 179 against 253 MB with every plugin on, for about 5% more
/// CPU per request. `.cargo/config.toml` builds it with a background thread that returns
/// freed pages to the system after a second, so RSS falls back after a burst (override at run
/// time with `_RJEM_MALLOC_CONF`).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The command line, its options as Pingora takes them.
struct CliParsed {
    opt: Opt,
    command: Option<Command>,
}

/// Where the config is looked for when `-c` is not given.
const DEFAULT_CONFIG: &str = "conf/sluice.yaml";

fn main() -> ExitCode {
    let parsed = Cli::parse();
    let cli = CliParsed {
        opt: parsed.options.into_pingora(),
        command: parsed.command,
    };
    if let Some(Command::HashKey) = cli.command {
        return hash_key();
    }
    #[cfg(feature = "demo")]
    if let Some(Command::Demo(args)) = cli.command {
        return match sluice::demo::run(cli.opt, args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice demo: {e}");
                ExitCode::FAILURE
            }
        };
    }

    let path = PathBuf::from(
        cli.opt
            .conf
            .clone()
            .unwrap_or_else(|| DEFAULT_CONFIG.into()),
    );
    let calls: Arc<dyn PoolCalls> = Arc::new(sluice::proxy::CoreCalls);
    let config = match Config::load(&path, &calls) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sluice: invalid config: {e}");
            return ExitCode::FAILURE;
        }
    };
    if cli.opt.daemon && config.server.error_log.is_none() {
        eprintln!(
            "sluice: invalid config: {}: pingora.error_log: -d makes a daemon, which has no terminal: set error_log to a file",
            path.display()
        );
        return ExitCode::FAILURE;
    }
    if cli.opt.test {
        println!("sluice: the configuration file {} is valid", path.display());
        return ExitCode::SUCCESS;
    }
    sluice::logging::init(&config.log, config.telemetry.as_ref());
    let mut opt = cli.opt;
    // Pingora would read `-c` as its own YAML; Sluice has already turned it into ServerConf.
    opt.conf = None;
    match sluice::server::build(config, opt) {
        Ok(server) => server.run_forever(),
        Err(e) => {
            eprintln!("sluice: cannot start: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice hash-key`: the digest of the key on standard input.
fn hash_key() -> ExitCode {
    let mut line = String::new();
    match std::io::stdin().read_line(&mut line) {
        Ok(_) => {}
        Err(e) => {
            eprintln!("sluice hash-key: cannot read the key: {e}");
            return ExitCode::FAILURE;
        }
    }
    let key = line.trim();
    if key.is_empty() {
        eprintln!("sluice hash-key: give the key on standard input, e.g. `echo -n \"$KEY\" | sluice hash-key`");
        return ExitCode::FAILURE;
    }
    println!(
        "{}",
        sluice_plugin_tenants::config::written_digest(key.as_bytes())
    );
    ExitCode::SUCCESS
}
