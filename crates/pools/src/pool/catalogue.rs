//! What a pool serves: its model names (as configured, or learned from its backends'
//! `/v1/models` with `models: auto`), the LoRA adapters its backends list, and the name its
//! engines get for a request.

use super::Pool;
use sluice_llm::model_name::ServedModel;
use std::sync::Arc;

impl Pool {
    /// Whether the pool serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.load().iter().any(|m| m == model)
    }

    /// The model names the pool serves now.
    pub fn models(&self) -> Arc<Vec<String>> {
        self.models.load_full()
    }

    /// Whether the pool takes requests for any model (it names none, and learns none).
    pub fn is_catch_all(&self) -> bool {
        !self.settings.auto_models && self.models.load().is_empty()
    }

    /// For a pool that learns its models: sets them to what its ready backends list now
    /// (their union, sorted). A backend not yet asked adds nothing; a pool none of whose
    /// backends has answered keeps what it had. Returns the names when they changed.
    pub fn learn_models(&self) -> Option<Arc<Vec<String>>> {
        if !self.settings.auto_models {
            return None;
        }
        let members = self.members();
        let mut names: Vec<String> = Vec::new();
        let mut asked = false;
        for listed in members
            .iter()
            .filter(|m| m.is_ready())
            .filter_map(|m| m.live.served_models())
        {
            asked = true;
            names.extend(listed.iter().cloned());
        }
        names.sort();
        names.dedup();
        if !asked || **self.models.load() == names {
            return None;
        }
        let names = Arc::new(names);
        self.models.store(Arc::clone(&names));
        Some(names)
    }

    /// The name the pool's engines get for a request for `requested` (`served_model`): none
    /// when it names one of the backends' LoRA adapters, which the engine serves under the
    /// adapter's own name.
    pub fn served_model_for(&self, requested: Option<&str>) -> Option<&ServedModel> {
        self.settings
            .served_model
            .as_ref()
            .filter(|_| self.adapter(requested).is_none())
    }

    /// `model` when it names a LoRA adapter one of the pool's backends lists (their
    /// `/v1/models`: see [`Pool::learn_adapters`]). One load on the request path.
    pub fn adapter<'m>(&self, model: Option<&'m str>) -> Option<&'m str> {
        let model = model?;
        self.adapters
            .load()
            .iter()
            .any(|a| a == model)
            .then_some(model)
    }

    /// Sets the adapters the pool knows to those its backends list now (their union); the
    /// health service calls it when a backend's list is read, and as backends come and go.
    pub fn learn_adapters(&self) {
        let members = self.members();
        let mut names: Vec<String> = Vec::new();
        for listed in members.iter().filter_map(|m| m.live.adapters()) {
            names.extend(listed.iter().cloned());
        }
        names.sort();
        names.dedup();
        if **self.adapters.load() != names {
            self.adapters.store(Arc::new(names));
        }
    }
}
