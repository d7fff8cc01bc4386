//! The `sluice` command: Pingora's standard options (`-c`, `-t`, `-u`, `-d`), and `demo`.

use clap::{Parser, Subcommand};
use pingora_core::server::configuration::Opt;
use sluice::config::Config;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "An edge proxy for LLM traffic, on Pingora"
)]
struct Cli {
    #[command(flatten)]
    opt: Opt,
    #[command(subcommand)]
    command: Option<Command>,
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

/// Where the config is looked for when `-c` is not given.
const DEFAULT_CONFIG: &str = "conf/sluice.yaml";

fn main() -> ExitCode {
    let cli = Cli::parse();
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
    let config = match Config::load(&path) {
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
