//! vLLM's error messages for the failures the simulator reproduces.

use crate::config::ErrorShape;
use crate::openai::ApiError;

pub const ENGINE_DEAD: &str =
    "EngineCore encountered an issue. See stack trace (above) for the root cause.";

/// The error a fault switch injects, with the reason phrase uvicorn would use.
pub fn injected(status: u16) -> ApiError {
    let message = match status {
        429 => "Too Many Requests",
        503 => "Service Unavailable",
        500 => "Internal Server Error",
        _ => "Injected error",
    };
    ApiError::new(status, message)
}

/// PyTorch's CUDA OOM message, sized from the blocks asked for and the blocks free.
pub fn out_of_memory(need_blocks: u64, free_blocks: u64, block_size: u32) -> ApiError {
    // Rough bytes per block of a Llama-70B-like model (16 tokens * 320 KiB), for the message.
    let gib = |blocks: u64| blocks as f64 * f64::from(block_size) * 327_680.0 / (1u64 << 30) as f64;
    ApiError::new(
        500,
        format!(
            "CUDA out of memory. Tried to allocate {:.2} GiB. GPU 0 has a total capacity of 79.15 GiB of which {:.2} GiB is free. Of the allocated memory 76.02 GiB is allocated by PyTorch, and 1.13 GiB is reserved by PyTorch but unallocated.",
            gib(need_blocks),
            gib(free_blocks)
        ),
    )
}

/// vLLM 0.32 refuses, before tokenizing it, a prompt of more characters than this many per
/// token of the context.
pub const CHARS_PER_TOKEN_BOUND: u64 = 17;

/// vLLM 0.32's 400 for a prompt of more than [`CHARS_PER_TOKEN_BOUND`] characters per token
/// of the context.
pub fn prompt_too_many_chars(max_model_len: u32, chars: usize) -> ApiError {
    let bound = u64::from(max_model_len) * CHARS_PER_TOKEN_BOUND;
    ApiError::bad_request(format!(
        "This model's maximum context length is {max_model_len} tokens. However, your prompt contains {chars} characters (more than {bound} characters, which is the upper bound for {max_model_len} input tokens). Please reduce the length of the input prompt. (parameter=input_text, value={chars})"
    ))
    .with_param("input_text")
}

/// vLLM 0.32's 400 for a `max_tokens` larger than the whole context.
pub fn max_tokens_over_context(max_tokens: u32, max_model_len: u32) -> ApiError {
    ApiError::bad_request(format!(
        "max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})"
    ))
    .with_param("max_tokens")
}

/// The 404 for a model the instance does not serve; vLLM 0.32 lists the names it does.
pub fn unknown_model(shape: ErrorShape, model: &str, served: &[String]) -> ApiError {
    if shape != ErrorShape::V0_32 {
        return ApiError::new(404, format!("The model `{model}` does not exist."));
    }
    ApiError::new(
        404,
        format!(
            "The model `{model}` does not exist. Valid aliases: {}.",
            served.join(", ")
        ),
    )
    .with_param("model")
}

/// The 400 for a request over `max_model_len`, worded as the configured vLLM generation
/// words it (vLLM ≥ 0.10.1 for `New`, older for `Old`).
pub fn context_length(
    shape: ErrorShape,
    max_model_len: u32,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
) -> ApiError {
    if shape == ErrorShape::V0_32 {
        // vLLM stops counting one token past the context.
        let at_least = max_model_len.saturating_add(1);
        return ApiError::bad_request(format!(
            "This model's maximum context length is {max_model_len} tokens. However, your prompt contains at least {at_least} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={at_least})"
        ))
        .with_param("input_tokens");
    }
    let message = match (shape, max_tokens) {
        (ErrorShape::V0_32 | ErrorShape::New, Some(max_tokens)) if prompt_tokens < max_model_len => format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context length is {max_model_len} tokens and your request has {prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})."
        ),
        (ErrorShape::V0_32 | ErrorShape::New, _) => format!(
            "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt_tokens} input tokens. Please reduce the length of the input messages."
        ),
        (ErrorShape::Old, Some(max_tokens)) => format!(
            "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
            u64::from(prompt_tokens) + u64::from(max_tokens)
        ),
        (ErrorShape::Old, None) => format!(
            "This model's maximum context length is {max_model_len} tokens. However, you requested {prompt_tokens} tokens in the messages, Please reduce the length of the messages."
        ),
    };
    ApiError::bad_request(message)
}
