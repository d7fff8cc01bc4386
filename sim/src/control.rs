//! The simulator's own control endpoints under `/sim/`: faults, phantom KV pressure and stats.
//! They are not counted in the stats and also answer on the admin port.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::Method;
use serde::{Deserialize, Serialize};

use crate::faults::Faults;
use crate::openai::{self, ApiError};
use crate::server::{self, HttpResponse};
use crate::stats::StatsJson;
use crate::Shared;

/// `path` is what follows `/sim/`.
pub async fn serve(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    body: Incoming,
) -> HttpResponse {
    match (method, path) {
        (&Method::GET, "faults") => to_json(&*shared.faults()),
        (&Method::POST | &Method::PUT, "faults") => match read_json::<Faults>(shared, body).await {
            Ok(faults) => {
                tracing::info!(?faults, "faults set");
                shared.set_faults(faults);
                to_json(&*shared.faults())
            }
            Err(error) => bad_request(shared, &format!("invalid faults: {error}")),
        },
        (&Method::DELETE, "faults") => {
            shared.set_faults(Faults::default());
            to_json(&Faults::default())
        }
        (&Method::GET, "kv") => to_json(&KvJson::of(shared)),
        (&Method::POST | &Method::PUT, "kv") => match read_json::<PhantomKv>(shared, body).await {
            Ok(PhantomKv { phantom_usage }) if (0.0..=1.0).contains(&phantom_usage) => {
                shared.engine.set_phantom_usage(phantom_usage);
                tracing::info!(phantom_usage, "phantom KV usage set");
                to_json(&KvJson::of(shared))
            }
            Ok(PhantomKv { phantom_usage }) => bad_request(
                shared,
                &format!("invalid kv: phantom_usage must be between 0 and 1, got {phantom_usage}"),
            ),
            Err(error) => bad_request(shared, &format!("invalid kv: {error}")),
        },
        (&Method::DELETE, "kv") => {
            shared.engine.set_phantom_usage(0.0);
            to_json(&KvJson::of(shared))
        }
        (&Method::GET, "stats") => to_json(&StatsJson::new(&shared.stats())),
        (&Method::GET, "kv_transfer") => match &shared.kv_transfer {
            Some(transfer) => to_json(&transfer.json()),
            None => server::not_found(),
        },
        _ => server::not_found(),
    }
}

/// `POST /sim/kv`: missing fields take their defaults, so `{}` (or an empty body) clears.
/// Out-of-range values are refused rather than clamped: 90 for 90 % is a mistake to report.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct PhantomKv {
    phantom_usage: f64,
}

/// The answer of every `/sim/kv` call: the phantom pressure and the usage it makes.
#[derive(Serialize)]
struct KvJson {
    phantom_usage: f64,
    phantom_blocks: u64,
    used_blocks: u64,
    total_blocks: u64,
    /// What /metrics reports.
    kv_usage: f64,
}

impl KvJson {
    fn of(shared: &Shared) -> Self {
        let engine = shared.engine.snapshot();
        KvJson {
            phantom_usage: shared.engine.phantom_usage(),
            phantom_blocks: engine.phantom_blocks,
            used_blocks: engine.used_blocks,
            total_blocks: engine.total_blocks,
            kv_usage: engine.kv_usage(),
        }
    }
}

fn to_json<T: Serialize>(value: &T) -> HttpResponse {
    // Our own plain structs always serialize; an empty body is only a fallback.
    server::json(200, serde_json::to_vec(value).unwrap_or_default())
}

/// Control errors are not counted as errors in the stats, unlike API errors.
fn bad_request(shared: &Shared, message: &str) -> HttpResponse {
    let error = ApiError::bad_request(message);
    server::json(400, openai::error_body(shared.config.error_shape, &error))
}

/// A control body: an empty body means "all defaults", like `{}`.
async fn read_json<T>(shared: &Shared, body: Incoming) -> Result<T, String>
where
    T: serde::de::DeserializeOwned + Default,
{
    let bytes: Bytes = server::read_body(shared, body)
        .await
        .map_err(|error| error.message)?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&bytes).map_err(|error| error.to_string())
}
