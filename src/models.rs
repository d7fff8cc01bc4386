//! `GET /v1/models`: the union of the models the pools serve, in OpenAI's list shape as vLLM
//! answers it. Built once per generation of the config, or on each request when a pool
//! learns its models from its backends (`models: auto`).

use bytes::Bytes;
use serde_json::json;
use sluice_sdk::Pools;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn list(pools: &Pools) -> Bytes {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut seen = std::collections::HashSet::new();
    let data: Vec<_> = pools
        .iter()
        .flat_map(|pool| {
            let models = pool.models();
            (0..models.len()).filter_map(move |i| Some((pool, models.get(i)?.clone())))
        })
        .filter(|(_, model)| seen.insert(model.clone()))
        .map(|(pool, model)| {
            json!({
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "sluice",
                "root": model,
                "parent": null,
                "max_model_len": pool.settings.max_model_len,
                "sluice_pool": &*pool.name,
            })
        })
        .collect();
    let body = json!({ "object": "list", "data": data });
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}
