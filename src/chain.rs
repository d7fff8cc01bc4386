//! The plugin chain: built once from config in a fixed order, then driven hook by hook.
//!
//! The order is part of the product (documented in `conf/README.md`): plugins that identify a
//! request come first, then those that may answer it without an upstream, then those that
//! choose where it goes. A disabled plugin is not in the chain and costs nothing.
//!
//! 1. `request_id`: every answer, errors included, carries the id.
//! 2. `cache`: a hit is answered before any upstream is touched.
//! 3. `speculative`: sends the request to a draft pool first, with the target pool as its
//!    escalation, or straight to the target.
//! 4. `kv_breaker`: admits the request to its pool, sends it to another pool serving its
//!    model, or sheds it with 503 before the pool's KV cache runs out.
//!
//! Response hooks run in the reverse order, as Envoy runs its encoder filters: the plugin
//! nearest the upstream sees its answer first, so the cache stores the answer exactly as the
//! client gets it, after the selector removed what it had asked for on the client's behalf.

use crate::config::file::PluginsFile;
use bytes::Bytes;
use pingora_error::{Error, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use sluice_sdk::{ErrorReply, Flow, LocalResponse, Plugin, Pools, RequestCtx};
use std::sync::Arc;

pub struct Chain {
    plugins: Vec<Arc<dyn Plugin>>,
}

impl Chain {
    /// Builds the enabled plugins, in chain order. The config was validated at load, so an
    /// error here names the plugin and what its constructor refused.
    pub fn build(config: &PluginsFile, pools: &Arc<Pools>) -> Result<Self, String> {
        let mut plugins: Vec<Arc<dyn Plugin>> = Vec::new();
        if config.request_id.enabled {
            let p = sluice_plugin_request_id::RequestId::new(&config.request_id)
                .map_err(|e| format!("plugins.request_id: {e}"))?;
            plugins.push(Arc::new(p));
        }
        if config.cache.enabled {
            let p = sluice_plugin_cache::Cache::new(config.cache.clone())?;
            plugins.push(Arc::new(p));
        }
        if config.speculative.enabled {
            let p = sluice_plugin_speculative::Speculative::new(config.speculative.clone(), pools)?;
            plugins.push(Arc::new(p));
        }
        if config.kv_breaker.enabled {
            let p = sluice_plugin_kv_breaker::KvBreaker::new(
                config.kv_breaker.clone(),
                Arc::clone(pools),
            )?;
            plugins.push(Arc::new(p));
        }
        Ok(Self { plugins })
    }

    /// A chain with the given plugins, for tests.
    pub fn from_plugins(plugins: Vec<Arc<dyn Plugin>>) -> Self {
        Self { plugins }
    }

    /// The plugin names in chain order.
    pub fn names(&self) -> Vec<&'static str> {
        self.plugins.iter().map(|p| p.name()).collect()
    }

    pub async fn early_request(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<()> {
        for p in &self.plugins {
            p.early_request(session, ctx).await?;
        }
        Ok(())
    }

    /// Runs `request` hooks until one answers or fails. `Some` is the answer to send.
    pub async fn request(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Box<LocalResponse>>> {
        for p in &self.plugins {
            if let Flow::Respond(response) = p.request(session, ctx).await? {
                return Ok(Some(response));
            }
        }
        Ok(None)
    }

    pub fn upstream_select(&self, ctx: &mut RequestCtx) -> Result<()> {
        self.plugins.iter().try_for_each(|p| p.upstream_select(ctx))
    }

    pub fn upstream_request(
        &self,
        request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.plugins
            .iter()
            .try_for_each(|p| p.upstream_request(request, ctx))
    }

    pub fn response_header(
        &self,
        response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.plugins
            .iter()
            .rev()
            .try_for_each(|p| p.response_header(response, ctx))
    }

    pub fn response_body(
        &self,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.plugins
            .iter()
            .rev()
            .try_for_each(|p| p.response_body(body, end_of_stream, ctx))
    }

    pub fn error(&self, reply: &ErrorReply, ctx: &mut RequestCtx) {
        self.plugins.iter().for_each(|p| p.error(reply, ctx));
    }

    pub fn logging(&self, error: Option<&Error>, ctx: &mut RequestCtx) {
        self.plugins.iter().for_each(|p| p.logging(error, ctx));
    }
}
