#![warn(missing_docs)]
//! Sluice's LLM wire model: what the requests and answers of the LLM routes (OpenAI's,
//! Anthropic's and vLLM's own) are made of, read without a second parse and without copying
//! the body.
//!
//! - [`request`]: the request parse ([`LlmCall`], [`LlmRequest`]) and its size estimate
//!   ([`Demand`]), for the balancer, the breaker and the selector.
//! - [`family`]: the API families (OpenAI chat, completions and Responses, Anthropic
//!   Messages, the routes that generate nothing), each owning what is particular to its wire
//!   format, behind [`family::ApiFamily`].
//! - [`raw_json`]: the byte-level JSON reading and splicing the parse and the edits share.
//! - [`usage`]: an answer's token usage, found as it streams.
//! - [`sse`]: a stream's chunks split into events.
//! - [`model_name`]: the model name a pool serves, spliced into requests and rewritten back
//!   in answers.
//! - [`context`]: what an engine says when a request outgrew its context.
//!
//! Pure data and bytes: it must not depend on Pingora, on pools or on the plugin contract
//! (`sluice-pools` and `sluice-sdk` depend on it, never the other way).

pub mod context;
pub mod family;
pub mod model_name;
pub mod raw_json;
pub mod request;
pub mod sse;
pub mod usage;

pub use family::{AnswerError, AnswerText, ApiFamily, Logprobs, RouteMatch, WireError};
pub use model_name::{AnswerModel, ModelRewriter, ServedModel, UpstreamEdits};
pub use request::{Demand, Endpoint, InvalidRequest, LlmCall, LlmRequest, Member, Slot};
pub use usage::Usage;
