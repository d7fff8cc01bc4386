//! Peak memory of what the speculative plugin does to an 8 MiB request body (asking for
//! usage or logprobs) and to a held 4 MiB answer (judging it), per byte of body:
//! `cargo run --release -p sluice-plugin-speculative --example splice_memory`.

#[path = "../../../crates/sdk/examples/support/peak.rs"]
mod peak;

use peak::Case;
use sluice_plugin_speculative::confidence::{ConfidenceCheck, Measure};
use sluice_sdk::usage;
use sluice_sdk::{AnswerCheck, Bytes, Endpoint, LlmCall};

/// A non-stream chat answer of about 4 MiB (the most the core holds for judging), its
/// choice's logprobs one entry per token.
fn held_answer() -> Vec<u8> {
    let mut body = Vec::with_capacity(peak::BODY / 2);
    body.extend_from_slice(
        br#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"word word"},"logprobs":{"content":[{"token":" word","logprob":-0.1,"bytes":[32,119,111,114,100],"top_logprobs":[]}"#,
    );
    let entry: &[u8] =
        br#",{"token":" word","logprob":-0.1,"bytes":[32,119,111,114,100],"top_logprobs":[]}"#;
    let tail: &[u8] = br#"]},"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#;
    while body.len() + entry.len() + tail.len() <= peak::BODY / 2 {
        body.extend_from_slice(entry);
    }
    body.extend_from_slice(tail);
    body
}

/// `body` asking for log-probabilities, as the selector asks a draft (the family's edit).
fn ask_for_logprobs(endpoint: Endpoint, body: &[u8]) -> Option<Bytes> {
    endpoint.family().logprobs()?.ask(body)
}

/// What the proxy holds for a stream the plugin asks usage of: the parsed call (with the
/// body), the usage body, and with a hold-back window the draft's body with logprobs too.
fn stream_request(body: &Bytes, hold_back: bool) -> Box<dyn std::any::Any> {
    let call = LlmCall::parse(Endpoint::ChatCompletions, Bytes::clone(body));
    let usage = usage::ask_for_usage(body);
    let draft = hold_back
        .then(|| {
            let sent = usage.as_deref().unwrap_or(body);
            ask_for_logprobs(Endpoint::ChatCompletions, sent)
        })
        .flatten();
    Box::new((call, usage, draft))
}

fn main() {
    peak::main(&[
        Case {
            name: "usage prompt:[1,1,...]",
            body: || peak::token_prompt(true),
            run: |b| Box::new(usage::ask_for_usage(b)),
        },
        Case {
            name: "usage chat message",
            body: || peak::chat(true, false),
            run: |b| Box::new(usage::ask_for_usage(b)),
        },
        Case {
            name: "logprobs prompt:[1,1,...]",
            body: || peak::token_prompt(false),
            run: |b| Box::new(ask_for_logprobs(Endpoint::Completions, b)),
        },
        Case {
            name: "logprobs chat message",
            body: || peak::chat(false, false),
            run: |b| Box::new(ask_for_logprobs(Endpoint::ChatCompletions, b)),
        },
        Case {
            name: "parse+usage, \\n chat",
            body: || peak::chat(true, true),
            run: |b| stream_request(b, false),
        },
        Case {
            name: "parse+usage+logprobs",
            body: || peak::chat(true, true),
            run: |b| stream_request(b, true),
        },
        Case {
            name: "judge 4 MiB answer",
            body: held_answer,
            run: |b| {
                let check = ConfidenceCheck {
                    endpoint: Endpoint::ChatCompletions,
                    measure: Measure::Mean,
                    window: 0,
                    min_logprob: -1.0,
                    client_asked: false,
                };
                Box::new(check.judge(b))
            },
        },
    ]);
}
