//! `sluice demo` (being written).
use pingora_core::server::configuration::Opt;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {}

pub fn run(_opt: Opt, _args: DemoArgs) -> Result<(), String> {
    Err("not built yet".into())
}
