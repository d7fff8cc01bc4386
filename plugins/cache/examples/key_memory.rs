//! Peak memory of the cache key of an 8 MiB request body, per byte of body:
//! `cargo run --release -p sluice-plugin-cache --example key_memory`.

#[path = "../../../crates/sdk/examples/support/peak.rs"]
mod peak;

use bytes::Bytes;
use peak::Case;
use sluice_plugin_cache::key;
use sluice_sdk::Endpoint;

fn digest(endpoint: Endpoint, body: &Bytes) -> Box<dyn std::any::Any> {
    Box::new(key::digest("tenant", endpoint, &[], body))
}

/// An 8 MiB `tools` list of small objects: many object members to sort.
fn wide_tools() -> Vec<u8> {
    peak::body_with(
        r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}],"tools":[{}"#,
        br#",{"type":"function","function":{"name":"f","parameters":{}}}"#,
        "]}",
    )
}

fn main() {
    peak::main(&[
        Case {
            name: "key prompt:[1,1,...]",
            body: || peak::token_prompt(false),
            run: |b| digest(Endpoint::Completions, b),
        },
        Case {
            name: "key chat message",
            body: || peak::chat(false, false),
            run: |b| digest(Endpoint::ChatCompletions, b),
        },
        Case {
            name: "key chat message, \\n",
            body: || peak::chat(false, true),
            run: |b| digest(Endpoint::ChatCompletions, b),
        },
        Case {
            name: "key tools:[{..},{..},...]",
            body: wide_tools,
            run: |b| digest(Endpoint::ChatCompletions, b),
        },
    ]);
}
