//! Peak resident memory of one operation on a request body, for the memory examples of the
//! SDK, the cache and the speculative plugin (each includes this file).
//!
//! Each case runs in a child process of its own, so that no case inherits another's heap.
//! The child builds its body, resets the kernel's peak-RSS mark (`/proc/self/clear_refs`),
//! runs the operation with its result kept alive, and reports the peak (`VmHWM`) and the
//! resident size after (`VmRSS`) above the resident size before, per byte of body.

use bytes::Bytes;
use std::process::Command;

/// One case: a name, the body it works on and the operation.
pub struct Case {
    pub name: &'static str,
    pub body: fn() -> Vec<u8>,
    pub run: fn(&Bytes) -> Box<dyn std::any::Any>,
}

/// The body size of every case: the proxy's default `max_request_body_bytes`.
pub const BODY: usize = 8 << 20;

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// With no arguments: runs every case in a child and prints a table. With `--case NAME`:
/// runs that case here and prints its numbers.
pub fn main(cases: &[Case]) {
    let args: Vec<String> = std::env::args().collect();
    if let (Some(flag), Some(name)) = (args.get(1), args.get(2)) {
        if flag == "--case" {
            if let Some(case) = cases.iter().find(|c| c.name == name) {
                child(case);
            }
            return;
        }
    }
    println!(
        "{:<28} {:>10} {:>14} {:>14} {:>12}",
        "case", "body MiB", "peak/byte", "kept/byte", "peak incl."
    );
    let exe = std::env::current_exe().unwrap_or_default();
    for case in cases {
        let out = Command::new(&exe).args(["--case", case.name]).output();
        match out {
            Ok(out) => print!("{}", String::from_utf8_lossy(&out.stdout)),
            Err(e) => println!("{:<28} failed: {e}", case.name),
        }
    }
    println!("peak/byte: peak RSS above the RSS before the operation (body already built), per body byte");
    println!("kept/byte: RSS still held afterwards with the result alive; peak incl.: peak/byte + 1 (the body)");
}

fn child(case: &Case) {
    let body = Bytes::from((case.body)());
    // Reset the peak mark to the current RSS, so the body's own construction is not counted.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = status_kib("VmRSS:");
    let result = (case.run)(&body);
    let peak = status_kib("VmHWM:");
    let after = status_kib("VmRSS:");
    std::hint::black_box(&result);
    let per = |kib: u64| (kib.saturating_sub(before) * 1024) as f64 / body.len() as f64;
    println!(
        "{:<28} {:>10.2} {:>14.2} {:>14.2} {:>12.2}",
        case.name,
        body.len() as f64 / (1 << 20) as f64,
        per(peak),
        per(after),
        per(peak) + 1.0
    );
    drop(result);
}

/// `{"model":"m","temperature":0,<field>:` + what `fill` writes until the body is [`BODY`]
/// bytes + `}`, in a vector of exactly that capacity.
#[allow(dead_code)]
pub fn body_with(head: &str, fill: &[u8], tail: &str) -> Vec<u8> {
    let mut body = Vec::with_capacity(BODY);
    body.extend_from_slice(head.as_bytes());
    while body.len() + fill.len() + tail.len() <= BODY {
        body.extend_from_slice(fill);
    }
    body.extend_from_slice(tail.as_bytes());
    body
}

/// An 8 MiB `"prompt":[1,1,1,...]` body.
#[allow(dead_code)]
pub fn token_prompt(stream: bool) -> Vec<u8> {
    let head = if stream {
        r#"{"model":"m","temperature":0,"stream":true,"prompt":[1"#
    } else {
        r#"{"model":"m","temperature":0,"prompt":[1"#
    };
    body_with(head, b",1", "]}")
}

/// An 8 MiB chat body: one user message of plain text, or of text with a `\n` escape in
/// every line of 64 characters.
#[allow(dead_code)]
pub fn chat(stream: bool, escaped: bool) -> Vec<u8> {
    let head = if stream {
        r#"{"model":"m","temperature":0,"stream":true,"messages":[{"role":"user","content":""#
    } else {
        r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":""#
    };
    let line: &[u8] = if escaped {
        b"The quick brown fox jumps over the lazy dog, again and again.\\n"
    } else {
        b"The quick brown fox jumps over the lazy dog, again and again.. "
    };
    body_with(head, line, r#""}]}"#)
}
