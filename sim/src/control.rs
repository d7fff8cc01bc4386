//! The simulator's own control endpoints under `/sim/`: faults and stats. They are not counted
//! in the stats and also answer on the admin port.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::Method;
use serde::Serialize;

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
        (&Method::GET, "stats") => to_json(&StatsJson::new(&shared.stats())),
        _ => server::not_found(),
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
