//! What an engine says when a request outgrew its model's context, read from its answer.
//!
//! vLLM 0.32 refuses a prompt longer than the context with a 400 whose `param` is
//! `input_tokens` (or `input_text`, when it refused on the characters before tokenizing);
//! older versions said "maximum context length" in the message alone. A prompt that fits but
//! leaves less room than `max_tokens` is no longer refused: the answer stops at the context's
//! end with `finish_reason: "length"` and fewer tokens than asked. Either way another pool,
//! with a longer context, could have answered in full, and nothing has reached the client yet
//! when the core reads these (the answer is held).

use crate::request::LlmCall;
use memchr::memmem;
use serde::Deserialize;
use std::sync::LazyLock;

/// The tokens a request allows for all its choices: `max_tokens` (or
/// `max_completion_tokens`) for each of `n`; without one, a chat answer may run to the
/// context's end (`u64::MAX`), and a text completion stops at vLLM's default of 16.
pub fn output_budget(call: &LlmCall) -> u64 {
    let choices = u64::from(call.request.n.unwrap_or(1).max(1));
    let each = match call
        .request
        .max_output_tokens()
        .or_else(|| call.endpoint.family().default_max_tokens())
    {
        Some(max) => u64::from(max),
        None => return u64::MAX,
    };
    each.saturating_mul(choices)
}

/// The `param` values of vLLM's context-length refusals.
const CONTEXT_PARAMS: [&str; 2] = ["input_tokens", "input_text"];
/// The words every vLLM version's context-length refusal carries.
const CONTEXT_MESSAGE: &str = "maximum context length";

#[derive(Deserialize)]
struct ErrorBody<'a> {
    #[serde(borrow)]
    error: Option<ErrorFields<'a>>,
}

#[derive(Deserialize)]
struct ErrorFields<'a> {
    #[serde(borrow, default)]
    message: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    param: Option<std::borrow::Cow<'a, str>>,
}

/// Whether an error answer's body (a 400) refuses the request for the model's context
/// length: by its `param`, or by its message.
pub fn is_context_length_error(body: &[u8]) -> bool {
    let Ok(ErrorBody { error: Some(error) }) = serde_json::from_slice::<ErrorBody>(body) else {
        return false;
    };
    error
        .param
        .as_deref()
        .is_some_and(|p| CONTEXT_PARAMS.contains(&p))
        || error
            .message
            .as_deref()
            .is_some_and(|m| m.contains(CONTEXT_MESSAGE))
}

#[derive(Deserialize)]
struct AnswerShape {
    #[serde(default)]
    choices: Vec<ChoiceShape>,
    usage: Option<UsageShape>,
}

#[derive(Deserialize)]
struct ChoiceShape {
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct UsageShape {
    #[serde(default)]
    completion_tokens: u64,
}

/// Whether a whole JSON answer (chat or text completion) was cut by the model's context: a
/// choice stopped for `length` while the answer's tokens fall short of `budget`, the tokens
/// the client allowed for all its choices (`u64::MAX` when it set no limit: then any
/// `length` is the context's end).
pub fn cut_by_context(body: &[u8], budget: u64) -> bool {
    // Most answers stop for another reason: no parse for them. The finder is built once.
    static LENGTH: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(b"\"length\""));
    if LENGTH.find(body).is_none() {
        return false;
    }
    let Ok(answer) = serde_json::from_slice::<AnswerShape>(body) else {
        return false;
    };
    let stopped_for_length = answer
        .choices
        .iter()
        .any(|c| c.finish_reason.as_deref() == Some("length"));
    let generated = answer.usage.map_or(0, |u| u.completion_tokens);
    stopped_for_length && generated < budget
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_length_refusals_are_known_by_param_or_message() {
        let new = br#"{"error":{"message":"This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=2049)","type":"BadRequestError","param":"input_tokens","code":400}}"#;
        let chars = br#"{"error":{"message":"too many characters","type":"BadRequestError","param":"input_text","code":400}}"#;
        let old = br#"{"object":"error","message":"This model's maximum context length is 2048 tokens. However, you requested 2100 tokens.","type":"BadRequestError","param":null,"code":400}"#;
        let old_nested = br#"{"error":{"message":"This model's maximum context length is 2048 tokens. However, you requested 2100 tokens.","type":"BadRequestError","param":null,"code":400}}"#;
        let other = br#"{"error":{"message":"max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)","type":"BadRequestError","param":"max_tokens","code":400}}"#;
        assert!(is_context_length_error(new));
        assert!(is_context_length_error(chars));
        assert!(is_context_length_error(old_nested));
        assert!(!is_context_length_error(old), "not in the error object");
        assert!(!is_context_length_error(other));
        assert!(!is_context_length_error(b"not json"));
    }

    #[test]
    fn an_answer_stopped_short_of_its_budget_for_length_was_cut() {
        let cut = br#"{"object":"chat.completion","choices":[{"index":0,"message":{"content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":1207,"total_tokens":2048,"completion_tokens":841}}"#;
        assert!(cut_by_context(cut, 2000));
        assert!(
            cut_by_context(cut, u64::MAX),
            "no budget: the context's end"
        );
        assert!(!cut_by_context(cut, 841), "the client's own budget");
        let stopped = br#"{"choices":[{"finish_reason":"stop"}],"usage":{"completion_tokens":15}}"#;
        assert!(!cut_by_context(stopped, 2000));
        let text_about_length = br#"{"choices":[{"message":{"content":"\"length\""},"finish_reason":"stop"}],"usage":{"completion_tokens":3}}"#;
        assert!(!cut_by_context(text_about_length, 2000));
    }
}
