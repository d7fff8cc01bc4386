//! LoRA adapters, as vLLM serves them with `--enable-lora`: the adapters it knows (loaded at
//! start with `--lora-modules`, or at run time with `POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, which vLLM offers with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; the
//! simulator always does), each with the id the engine schedules it by; `/v1/models` lists
//! them with their base model as `parent`; a request names one as its `model`.
//!
//! The engine (`engine.rs`) keeps at most `--max-loras` adapters in one batch; the prefix
//! cache keys an adapter's blocks with its name and path, so they are never another's; and
//! `vllm:lora_requests_info` reports, as vLLM 0.32 does, the adapters with requests in the
//! engine (the same names under `running_lora_adapters` and `waiting_lora_adapters`: vLLM
//! lists every adapter with a request in either), its value the time it was last set, each
//! combination of labels kept once seen.

use std::sync::{Mutex, RwLock};

use crate::config::LoraConfig;
use crate::openai::ApiError;

/// One adapter the instance serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adapter {
    /// vLLM's `lora_int_id`: counted from 1 as the adapters are loaded.
    pub id: u32,
    pub name: String,
    pub path: String,
}

#[derive(Debug)]
pub struct Adapters {
    pub max_loras: u32,
    pub load_time: std::time::Duration,
    known: RwLock<Vec<Adapter>>,
    next_id: Mutex<u32>,
    /// `vllm:lora_requests_info`'s label sets seen, with the time each was last set.
    reported: Mutex<Vec<(String, f64)>>,
}

impl Adapters {
    pub fn new(config: &LoraConfig) -> Self {
        let known = config
            .modules
            .iter()
            .zip(1..)
            .map(|(module, id)| Adapter {
                id,
                name: module.name.clone(),
                path: module.path.clone(),
            })
            .collect::<Vec<_>>();
        Adapters {
            max_loras: config.max_loras,
            load_time: config.load_time,
            next_id: Mutex::new(u32::try_from(known.len()).unwrap_or(u32::MAX) + 1),
            known: RwLock::new(known),
            reported: Mutex::new(Vec::new()),
        }
    }

    /// The adapter called `name`, if loaded.
    pub fn find(&self, name: &str) -> Option<Adapter> {
        self.read().iter().find(|a| a.name == name).cloned()
    }

    /// The adapter with the engine's id `id`.
    pub fn name_of(&self, id: u32) -> Option<String> {
        self.read()
            .iter()
            .find(|a| a.id == id)
            .map(|a| a.name.clone())
    }

    /// Every loaded adapter, in the order they were loaded.
    pub fn all(&self) -> Vec<Adapter> {
        self.read().clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Adapter>> {
        self.known.read().unwrap_or_else(|p| p.into_inner())
    }

    /// `POST /v1/load_lora_adapter`: `{"lora_name", "lora_path"}`; answers vLLM's text or
    /// its error. `base_names`: the served base models, which an adapter may not shadow.
    pub fn load(&self, body: &[u8], base_names: &[String]) -> Result<String, ApiError> {
        #[derive(serde::Deserialize)]
        struct Load {
            #[serde(default)]
            lora_name: String,
            #[serde(default)]
            lora_path: String,
            #[serde(default)]
            load_inplace: bool,
        }
        let load: Load = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))?;
        let invalid = |message: String| {
            let mut error = ApiError::bad_request(message);
            error.err_type = "InvalidUserInput";
            error
        };
        if load.lora_name.is_empty() || load.lora_path.is_empty() {
            return Err(invalid(
                "Both 'lora_name' and 'lora_path' must be provided.".into(),
            ));
        }
        if base_names.contains(&load.lora_name) {
            return Err(invalid(format!(
                "The lora adapter '{}' conflicts with a served base model.",
                load.lora_name
            )));
        }
        let mut known = self.known.write().unwrap_or_else(|p| p.into_inner());
        match known.iter_mut().find(|a| a.name == load.lora_name) {
            Some(_) if !load.load_inplace => {
                return Err(invalid(format!(
                    "The lora adapter '{}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
                    load.lora_name
                )));
            }
            Some(adapter) => adapter.path = load.lora_path,
            None => {
                let mut next = self.next_id.lock().unwrap_or_else(|p| p.into_inner());
                known.push(Adapter {
                    id: *next,
                    name: load.lora_name.clone(),
                    path: load.lora_path,
                });
                *next += 1;
            }
        }
        Ok(format!(
            "Success: LoRA adapter '{}' added successfully.",
            load.lora_name
        ))
    }

    /// `POST /v1/unload_lora_adapter`: `{"lora_name"}`.
    pub fn unload(&self, body: &[u8]) -> Result<String, ApiError> {
        #[derive(serde::Deserialize)]
        struct Unload {
            #[serde(default)]
            lora_name: String,
        }
        let unload: Unload = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))?;
        if unload.lora_name.is_empty() {
            let mut error =
                ApiError::bad_request("'lora_name' needs to be provided to unload a LoRA adapter.");
            error.err_type = "InvalidUserInput";
            return Err(error);
        }
        let mut known = self.known.write().unwrap_or_else(|p| p.into_inner());
        let Some(at) = known.iter().position(|a| a.name == unload.lora_name) else {
            let mut error = ApiError::new(
                404,
                format!("The lora adapter '{}' cannot be found.", unload.lora_name),
            );
            error.err_type = "NotFoundError";
            return Err(error);
        };
        known.remove(at);
        Ok(format!(
            "Success: LoRA adapter '{}' removed successfully.",
            unload.lora_name
        ))
    }

    /// `vllm:lora_requests_info`'s samples. vLLM sets the gauge at each engine step: while
    /// the engine is `busy`, `names` (the adapters with requests now) is set to `now`
    /// (seconds since the epoch); once idle, the empty set was its last step's (if it `ran`
    /// at all). The label sets seen before keep their times; an engine that never ran reports
    /// none.
    pub fn report(&self, names: &str, now: f64, busy: bool, ran: bool) -> Vec<(String, f64)> {
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        let latest = reported
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(names, _)| names.clone());
        let set = if busy {
            Some(names)
        } else {
            (ran && latest.as_deref() != Some("")).then_some("")
        };
        if let Some(names) = set {
            match reported.iter_mut().find(|(seen, _)| seen == names) {
                Some(entry) => entry.1 = now,
                None => reported.push((names.to_string(), now)),
            }
        }
        reported.clone()
    }
}
