//! Peak memory of the core's parse of an 8 MiB request body, per byte of body:
//! `cargo run --release -p sluice-sdk --example body_memory`.

#[path = "support/peak.rs"]
mod peak;

use peak::Case;
use sluice_sdk::{Bytes, Endpoint, LlmCall};

fn parse(endpoint: Endpoint, body: &Bytes) -> Box<dyn std::any::Any> {
    // A reference count, as the core hands the body it read to the parse.
    Box::new(LlmCall::parse(endpoint, Bytes::clone(body)))
}

fn main() {
    peak::main(&[
        Case {
            name: "parse prompt:[1,1,...]",
            body: || peak::token_prompt(false),
            run: |b| parse(Endpoint::Completions, b),
        },
        Case {
            name: "parse chat message",
            body: || peak::chat(false, false),
            run: |b| parse(Endpoint::ChatCompletions, b),
        },
        Case {
            name: "parse chat message, \\n",
            body: || peak::chat(false, true),
            run: |b| parse(Endpoint::ChatCompletions, b),
        },
        Case {
            name: "parse many messages",
            body: || {
                peak::body_with(
                    r#"{"model":"m","messages":[{"role":"user","content":"hi"}"#,
                    br#",{"role":"user","content":"hi"}"#,
                    "]}",
                )
            },
            run: |b| parse(Endpoint::ChatCompletions, b),
        },
    ]);
}
