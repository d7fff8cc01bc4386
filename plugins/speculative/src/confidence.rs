//! The low-confidence check, the heart of speculative routing: the draft pool answers first,
//! and when its own token log-probabilities say it was guessing, the answer is dropped and the
//! request escalates to the target pool.
//!
//! The draft is asked for log-probabilities even when the client did not ask; the
//! [`ConfidenceCheck`] removes them again before the answer is sent, so the client gets what
//! vLLM would have answered it. Where a family's answers carry them, how they are asked for
//! and taken out is the family's ([`sluice_sdk::family::Logprobs`]): this module only
//! measures.

use sluice_sdk::escalation::reason;
use sluice_sdk::sse::{self, SseEvents};
use sluice_sdk::{AnswerCheck, Bytes, Endpoint, Judgement, StreamCheck, StreamJudge};

/// How an answer's confidence is measured over its first `window` tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Measure {
    /// The mean token log-probability: how sure the draft was overall.
    Mean,
    /// The least likely token: a single wild guess is enough to escalate.
    Min,
}

/// Judges a draft's non-stream answer by its token log-probabilities.
#[derive(Debug, Clone)]
pub struct ConfidenceCheck {
    pub endpoint: Endpoint,
    pub measure: Measure,
    /// Tokens judged, from the start of the answer (0: all).
    pub window: usize,
    /// Escalate when the measure is below this (a log-probability, e.g. -1.0).
    pub min_logprob: f64,
    /// The client asked for logprobs itself: keep them in the answer.
    pub client_asked: bool,
}

impl AnswerCheck for ConfidenceCheck {
    /// Reads only choice 0's token log-probabilities from the answer's bytes (no tree of the
    /// answer), and when keeping it, copies it once with every choice's `logprobs` set to
    /// `null` if the client did not ask for them.
    fn judge(&self, body: &Bytes) -> Judgement {
        // A family without log-probabilities has no check; an answer without readable ones
        // (the draft ignored the request for them, a shape this version does not know, not
        // one JSON object) is no evidence either way: kept rather than escalated, or every
        // such answer would pay for both pools.
        let Some(logprobs) = self.endpoint.family().logprobs() else {
            return Judgement::Keep(None);
        };
        let mut tally = Tally::default();
        logprobs.read(body, 0, &mut tally.until(self.window));
        if let Some(confidence) = tally.measure(self.measure) {
            if confidence < self.min_logprob {
                return Judgement::Escalate(reason::LOW_CONFIDENCE);
            }
        }
        if self.client_asked {
            return Judgement::Keep(None);
        }
        Judgement::Keep(logprobs.strip(body).map(Bytes::from))
    }
}

/// The running count, sum and minimum of the token log-probabilities seen.
#[derive(Debug, Clone, Copy)]
struct Tally {
    count: usize,
    sum: f64,
    min: f64,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
        }
    }
}

impl Tally {
    fn add(&mut self, logprob: f64) {
        self.count += 1;
        self.sum += logprob;
        self.min = self.min.min(logprob);
    }

    /// A feed of log-probabilities into the tally until it holds `window` (0: all).
    fn until(&mut self, window: usize) -> impl FnMut(f64) -> bool + '_ {
        let limit = if window == 0 { usize::MAX } else { window };
        move |logprob| {
            if self.count < limit {
                self.add(logprob);
            }
            self.count < limit
        }
    }

    /// None when no token was seen: no evidence either way.
    fn measure(&self, measure: Measure) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        Some(match measure {
            Measure::Mean => self.sum / self.count as f64,
            Measure::Min => self.min,
        })
    }
}

/// Judges the start of a draft's stream, the hold-back window: the first `window` tokens of
/// choice 0, by the same measure as [`ConfidenceCheck`]. The judged tokens' logprobs stay in
/// the stream; the plugin's stream filter removes them when the client did not ask.
#[derive(Debug, Clone)]
pub struct StreamConfidence {
    pub endpoint: Endpoint,
    pub measure: Measure,
    /// Tokens kept back and judged (> 0).
    pub window: usize,
    pub min_logprob: f64,
}

impl StreamCheck for StreamConfidence {
    fn start(&self) -> Box<dyn StreamJudge> {
        Box::new(StreamConfidenceJudge {
            check: self.clone(),
            events: SseEvents::default(),
            tally: Tally::default(),
        })
    }
}

struct StreamConfidenceJudge {
    check: StreamConfidence,
    events: SseEvents,
    tally: Tally,
}

impl StreamJudge for StreamConfidenceJudge {
    fn feed(&mut self, chunk: &[u8]) -> Option<Judgement> {
        let mut done = false;
        let (endpoint, window) = (self.check.endpoint, self.check.window);
        let tally = &mut self.tally;
        self.events.split(chunk, |event| {
            if done {
                return;
            }
            let Some(data) = sse::data(event) else {
                return;
            };
            if &*data == b"[DONE]" {
                done = true;
                return;
            }
            let Some(logprobs) = endpoint.family().logprobs() else {
                return;
            };
            logprobs.read(&data, 0, &mut tally.until(window));
            done = tally.count >= window;
        });
        done.then(|| self.decide())
    }

    fn decide(&mut self) -> Judgement {
        match self.tally.measure(self.check.measure) {
            Some(confidence) if confidence < self.check.min_logprob => {
                Judgement::Escalate(reason::LOW_CONFIDENCE)
            }
            _ => Judgement::Keep(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const CHAT: &str = include_str!("../../../tests/fixtures/vllm-chat-completion.json");
    const COMPLETION: &str = include_str!("../../../tests/fixtures/vllm-completion.json");

    fn check(endpoint: Endpoint, measure: Measure, window: usize) -> ConfidenceCheck {
        ConfidenceCheck {
            endpoint,
            measure,
            window,
            min_logprob: -1.0,
            client_asked: false,
        }
    }

    /// One chat logprob entry as the simulator renders it (`top_logprobs` per request).
    fn chat_entry(token: &str, logprob: f64, top: usize) -> Value {
        let alternatives: Vec<Value> = (0..top)
            .map(|i| {
                serde_json::json!({"token": token, "logprob": logprob - 1.5 * i as f64,
                    "bytes": token.as_bytes()})
            })
            .collect();
        serde_json::json!({"token": token, "logprob": logprob, "bytes": token.as_bytes(),
            "top_logprobs": alternatives})
    }

    /// The chat fixture with choice 0's logprobs set to these tokens.
    fn chat_answer(logprobs: &[f64], top: usize) -> Value {
        let mut answer: Value = serde_json::from_str(CHAT).unwrap();
        let content: Vec<Value> = logprobs
            .iter()
            .map(|lp| chat_entry(" word", *lp, top))
            .collect();
        answer["choices"][0]["logprobs"] = serde_json::json!({ "content": content });
        answer
    }

    /// The completion fixture with choice 0's logprobs set, in vLLM's parallel arrays.
    fn completion_answer(logprobs: &[Option<f64>]) -> Value {
        let mut answer: Value = serde_json::from_str(COMPLETION).unwrap();
        let n = logprobs.len();
        let top: Vec<Value> = logprobs
            .iter()
            .map(|lp| match lp {
                Some(lp) => serde_json::json!({ " word": lp }),
                None => Value::Null,
            })
            .collect();
        answer["choices"][0]["logprobs"] = serde_json::json!({
            "text_offset": (0..n).map(|i| i * 5).collect::<Vec<_>>(),
            "token_logprobs": logprobs,
            "tokens": vec![" word"; n],
            "top_logprobs": top,
        });
        answer
    }

    fn bytes(answer: &Value) -> Bytes {
        Bytes::from(serde_json::to_vec(answer).unwrap())
    }

    /// The answer a Keep sends: the replacement body, or the original.
    fn kept(judgement: Judgement, original: &Bytes) -> Value {
        match judgement {
            Judgement::Keep(Some(body)) => serde_json::from_slice(&body).unwrap(),
            Judgement::Keep(None) => serde_json::from_slice(original).unwrap(),
            Judgement::Escalate(why) => panic!("escalated: {why}"),
        }
    }

    const CONFIDENT: [f64; 5] = [-0.18, -0.02, -0.1, -0.05, -0.12];
    const UNSURE: [f64; 5] = [-4.4, -2.6, -3.5, -3.0, -4.0];

    #[test]
    fn confident_chat_is_kept_without_the_logprobs_the_client_did_not_ask_for() {
        let body = bytes(&chat_answer(&CONFIDENT, 0));
        let judgement = check(Endpoint::ChatCompletions, Measure::Mean, 0).judge(&body);
        let Judgement::Keep(Some(stripped)) = judgement else {
            panic!("expected a stripped body, got {judgement:?}");
        };
        // Exactly the fixture, which is vLLM's answer without logprobs: same fields, same order.
        assert_eq!(std::str::from_utf8(&stripped).unwrap(), CHAT.trim_end());
    }

    #[test]
    fn confident_completion_is_kept_without_logprobs() {
        let lps: Vec<Option<f64>> = CONFIDENT.iter().copied().map(Some).collect();
        let body = bytes(&completion_answer(&lps));
        let judgement = check(Endpoint::Completions, Measure::Min, 0).judge(&body);
        let Judgement::Keep(Some(stripped)) = judgement else {
            panic!("expected a stripped body, got {judgement:?}");
        };
        assert_eq!(
            std::str::from_utf8(&stripped).unwrap(),
            COMPLETION.trim_end()
        );
    }

    #[test]
    fn unsure_answers_escalate() {
        let chat = bytes(&chat_answer(&UNSURE, 2));
        let lps: Vec<Option<f64>> = UNSURE.iter().copied().map(Some).collect();
        let completion = bytes(&completion_answer(&lps));
        for measure in [Measure::Mean, Measure::Min] {
            for window in [0, 1, 3, 100] {
                let escalate = Judgement::Escalate(reason::LOW_CONFIDENCE);
                let chat_check = check(Endpoint::ChatCompletions, measure, window);
                assert_eq!(chat_check.judge(&chat), escalate, "{measure:?} {window}");
                let completion_check = check(Endpoint::Completions, measure, window);
                assert_eq!(completion_check.judge(&completion), escalate);
            }
        }
    }

    #[test]
    fn client_asked_keeps_the_body_untouched() {
        let body = bytes(&chat_answer(&CONFIDENT, 3));
        let check = ConfidenceCheck {
            client_asked: true,
            ..check(Endpoint::ChatCompletions, Measure::Mean, 0)
        };
        assert_eq!(check.judge(&body), Judgement::Keep(None));
        // Asking does not exempt an unsure answer.
        let unsure = bytes(&chat_answer(&UNSURE, 3));
        assert_eq!(
            check.judge(&unsure),
            Judgement::Escalate(reason::LOW_CONFIDENCE)
        );
    }

    #[test]
    fn mean_and_min_differ_on_one_wild_guess() {
        // Mean -0.6 passes -1.0; the single -3.0 token does not.
        let body = bytes(&chat_answer(
            &[-0.1, -0.1, -3.0, -0.1, -0.1, -0.1, -0.1, -0.1],
            0,
        ));
        let mean = check(Endpoint::ChatCompletions, Measure::Mean, 0);
        assert!(matches!(mean.judge(&body), Judgement::Keep(Some(_))));
        let min = check(Endpoint::ChatCompletions, Measure::Min, 0);
        assert_eq!(
            min.judge(&body),
            Judgement::Escalate(reason::LOW_CONFIDENCE)
        );
    }

    #[test]
    fn window_counts_from_the_start_of_the_answer() {
        // Confident start, unsure tail: a window of 2 sees only the start.
        let body = bytes(&chat_answer(&[-0.05, -0.05, -4.0, -4.0], 0));
        for measure in [Measure::Mean, Measure::Min] {
            let short = check(Endpoint::ChatCompletions, measure, 2);
            assert!(matches!(short.judge(&body), Judgement::Keep(Some(_))));
            for window in [0, 3, 4, 10] {
                let longer = check(Endpoint::ChatCompletions, measure, window);
                assert_eq!(
                    longer.judge(&body),
                    Judgement::Escalate(reason::LOW_CONFIDENCE),
                    "{measure:?} {window}"
                );
            }
        }
    }

    #[test]
    fn completion_nulls_are_skipped_not_counted() {
        // `null` first (echo's first prompt token), then confident tokens: the window of 2
        // covers the two readable tokens, and the null does not count as a zero.
        let body = bytes(&completion_answer(&[
            None,
            Some(-0.1),
            Some(-0.1),
            Some(-5.0),
        ]));
        let windowed = check(Endpoint::Completions, Measure::Min, 2);
        assert!(matches!(windowed.judge(&body), Judgement::Keep(Some(_))));
        let whole = check(Endpoint::Completions, Measure::Min, 0);
        assert_eq!(
            whole.judge(&body),
            Judgement::Escalate(reason::LOW_CONFIDENCE)
        );
    }

    #[test]
    fn threshold_is_strict() {
        let body = bytes(&chat_answer(&[-1.0, -1.0], 0));
        let at = check(Endpoint::ChatCompletions, Measure::Mean, 0);
        assert!(matches!(at.judge(&body), Judgement::Keep(Some(_))));
    }

    #[test]
    fn missing_or_unreadable_logprobs_keep_the_answer() {
        // vLLM's own answers without logprobs: nothing to strip either.
        for (endpoint, body) in [
            (Endpoint::ChatCompletions, CHAT),
            (Endpoint::Completions, COMPLETION),
        ] {
            let body = Bytes::from(body);
            assert_eq!(
                check(endpoint, Measure::Min, 0).judge(&body),
                Judgement::Keep(None)
            );
        }
        // Wrong endpoint's shape, empty lists, no choices, odd types: never an escalation.
        let chat_shaped = bytes(&chat_answer(&UNSURE, 0));
        let completion_check = check(Endpoint::Completions, Measure::Min, 0);
        assert!(matches!(
            completion_check.judge(&chat_shaped),
            Judgement::Keep(_)
        ));
        let odd = [
            r#"{"choices":[]}"#,
            r#"{"choices":[{"logprobs":{"content":[]}}]}"#,
            r#"{"choices":[{"logprobs":{"content":null}}]}"#,
            r#"{"choices":[{"logprobs":{"content":[{"logprob":"-9"}]}}]}"#,
            r#"{"choices":{"0":{"logprobs":{"content":[{"logprob":-9}]}}}}"#,
            r#"{"choices":[{"logprobs":[-9]}]}"#,
            r#"{"object":"error","message":"x"}"#,
            r#"[1,2]"#,
            r#"null"#,
        ];
        for body in odd {
            let judgement = check(Endpoint::ChatCompletions, Measure::Min, 0)
                .judge(&Bytes::from_static(body.as_bytes()));
            assert!(matches!(judgement, Judgement::Keep(_)), "{body}");
        }
    }

    #[test]
    fn unparsable_bodies_are_kept_unchanged() {
        for body in [
            &b""[..],
            b"{",
            b"not json",
            b"\xff\xfe",
            br#"{"choices":[]} trailing"#,
        ] {
            let check = check(Endpoint::ChatCompletions, Measure::Mean, 0);
            assert_eq!(
                check.judge(&Bytes::copy_from_slice(body)),
                Judgement::Keep(None)
            );
        }
    }

    #[test]
    fn every_choice_loses_its_logprobs_but_only_choice_0_is_judged() {
        let mut answer = chat_answer(&CONFIDENT, 1);
        let mut second = answer["choices"][0].clone();
        second["index"] = 1.into();
        second["logprobs"] = serde_json::json!({"content": [chat_entry(" no", -9.0, 0)]});
        answer["choices"].as_array_mut().unwrap().push(second);
        let body = bytes(&answer);
        let kept = kept(
            check(Endpoint::ChatCompletions, Measure::Min, 0).judge(&body),
            &body,
        );
        for choice in kept["choices"].as_array().unwrap() {
            assert!(choice["logprobs"].is_null());
        }
        assert_eq!(kept["choices"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn simulator_ranges_separate_at_minus_one() {
        // The simulator draws confident tokens from [-0.18, -0.02], unsure ones from
        // [-4.4, -2.6]: a -1.0 threshold splits them with either measure. Sim logprobs are
        // f32, rendered as such.
        let f32_render = |lps: &[f64]| -> Vec<f64> {
            lps.iter()
                .map(|lp| {
                    let text = serde_json::to_string(&(*lp as f32)).unwrap();
                    text.parse().unwrap()
                })
                .collect()
        };
        for measure in [Measure::Mean, Measure::Min] {
            let check = check(Endpoint::ChatCompletions, measure, 16);
            let confident = bytes(&chat_answer(&f32_render(&CONFIDENT), 0));
            assert!(matches!(check.judge(&confident), Judgement::Keep(Some(_))));
            let unsure = bytes(&chat_answer(&f32_render(&UNSURE), 0));
            assert_eq!(
                check.judge(&unsure),
                Judgement::Escalate(reason::LOW_CONFIDENCE)
            );
        }
    }

    fn asked(endpoint: Endpoint, body: &str) -> Option<String> {
        let logprobs = endpoint.family().logprobs()?;
        let asked = logprobs.ask(body.as_bytes())?;
        Some(String::from_utf8(asked.to_vec()).unwrap())
    }

    #[test]
    fn chat_gets_logprobs_true_at_the_end_or_in_place() {
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}"#
            )
            .as_deref(),
            Some(
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,"logprobs":true}"#
            )
        );
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"logprobs":false,"model":"m","messages":[],"top_logprobs":0}"#
            )
            .as_deref(),
            Some(r#"{"logprobs":true,"model":"m","messages":[],"top_logprobs":0}"#)
        );
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"logprobs":null,"messages":[]}"#
            )
            .as_deref(),
            Some(r#"{"logprobs":true,"messages":[]}"#)
        );
    }

    #[test]
    fn completions_get_logprobs_zero() {
        assert_eq!(
            asked(
                Endpoint::Completions,
                r#"{"model":"m","prompt":"The capital of France is","max_tokens":16}"#
            )
            .as_deref(),
            Some(
                r#"{"model":"m","prompt":"The capital of France is","max_tokens":16,"logprobs":0}"#
            )
        );
        assert_eq!(
            asked(
                Endpoint::Completions,
                r#"{"prompt":"x","logprobs":null,"echo":false}"#
            )
            .as_deref(),
            Some(r#"{"prompt":"x","logprobs":0,"echo":false}"#)
        );
    }

    #[test]
    fn bodies_that_ask_already_or_cannot_be_asked_are_left_alone() {
        let chat = [
            r#"{"messages":[],"logprobs":true}"#,
            r#"{"messages":[],"logprobs":true,"top_logprobs":5}"#,
            r#"{"messages":[],"logprobs":1}"#,
            r#"{"messages":[],"top_logprobs":2}"#,
            r#"[{"messages":[]}]"#,
            r#""hello""#,
            r#"{"messages":[]"#,
            "",
        ];
        for body in chat {
            assert_eq!(asked(Endpoint::ChatCompletions, body), None, "{body}");
        }
        let completions = [
            r#"{"prompt":"x","logprobs":0}"#,
            r#"{"prompt":"x","logprobs":5}"#,
            r#"{"prompt":"x","logprobs":false}"#,
            r#"{"prompt":"x","echo":true}"#,
            "42",
        ];
        for body in completions {
            assert_eq!(asked(Endpoint::Completions, body), None, "{body}");
        }
    }

    #[test]
    fn a_stream_false_body_is_asked() {
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"messages":[],"stream":false}"#
            )
            .as_deref(),
            Some(r#"{"messages":[],"stream":false,"logprobs":true}"#)
        );
    }

    #[test]
    fn logprobs_are_spliced_into_the_clients_bytes() {
        // Spacing, escapes and other members kept byte for byte; the member appended.
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                "{\n  \"messages\": [{\"role\":\"user\",\"content\":\"a\\nb\"}] ,\n  \"x\": 1.50\n}\n"
            )
            .as_deref(),
            Some("{\n  \"messages\": [{\"role\":\"user\",\"content\":\"a\\nb\"}] ,\n  \"x\": 1.50\n,\"logprobs\":true}\n")
        );
        // An escaped key is the same key, replaced where it is.
        assert_eq!(
            asked(
                Endpoint::Completions,
                r#"{"logpr\u006fbs" : null,"prompt":"x"}"#
            )
            .as_deref(),
            Some(r#"{"logpr\u006fbs" : 0,"prompt":"x"}"#)
        );
        // Repeated keys: the last decides and is the one replaced.
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"logprobs":true,"messages":[],"logprobs":false}"#
            )
            .as_deref(),
            Some(r#"{"logprobs":true,"messages":[],"logprobs":true}"#)
        );
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"logprobs":false,"logprobs":true}"#
            ),
            None
        );
        // `logprobs` nested elsewhere is not the member.
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"x":{"logprobs":true},"messages":[]}"#
            )
            .as_deref(),
            Some(r#"{"x":{"logprobs":true},"messages":[],"logprobs":true}"#)
        );
        assert_eq!(
            asked(
                Endpoint::ChatCompletions,
                r#"{"messages":[],"top_logprobs":2.5}"#
            )
            .as_deref(),
            Some(r#"{"messages":[],"top_logprobs":2.5,"logprobs":true}"#)
        );
    }

    #[test]
    fn stripping_keeps_every_other_byte() {
        let body = "{ \"id\" : \"x\\u0021\",\n \"choices\": [ {\"index\":0, \"logprobs\" : {\"content\":[{\"logprob\":-0.1}]},\"text\":\"a\"},\n  {\"index\":1,\"logprobs\":null}, {\"index\":2,\"logprobs\":{\"content\":[]}} ] }";
        let judgement = check(Endpoint::ChatCompletions, Measure::Mean, 0)
            .judge(&Bytes::copy_from_slice(body.as_bytes()));
        let Judgement::Keep(Some(stripped)) = judgement else {
            panic!("expected a stripped body, got {judgement:?}");
        };
        assert_eq!(
            std::str::from_utf8(&stripped).unwrap(),
            "{ \"id\" : \"x\\u0021\",\n \"choices\": [ {\"index\":0, \"logprobs\" : null,\"text\":\"a\"},\n  {\"index\":1,\"logprobs\":null}, {\"index\":2,\"logprobs\":null} ] }"
        );
    }

    #[test]
    fn choice_0_is_found_as_before() {
        let escalates = |body: &str| {
            check(Endpoint::ChatCompletions, Measure::Min, 0)
                .judge(&Bytes::copy_from_slice(body.as_bytes()))
                == Judgement::Escalate(reason::LOW_CONFIDENCE)
        };
        let unsure = r#"{"content":[{"logprob":-9}]}"#;
        let sure = r#"{"content":[{"logprob":-0.1}]}"#;
        // By index, not by position; a missing or unreadable index is 0.
        assert!(escalates(&format!(
            r#"{{"choices":[{{"index":1,"logprobs":{sure}}},{{"index":0,"logprobs":{unsure}}}]}}"#
        )));
        assert!(!escalates(&format!(
            r#"{{"choices":[{{"index":1,"logprobs":{unsure}}},{{"index":0,"logprobs":{sure}}}]}}"#
        )));
        assert!(escalates(&format!(
            r#"{{"choices":[{{"index":"one","logprobs":{unsure}}}]}}"#
        )));
        assert!(escalates(&format!(
            r#"{{"choices":[{{"logprobs":{unsure}}}]}}"#
        )));
        // The last of a repeated key is read, at every level.
        assert!(escalates(&format!(
            r#"{{"choices":[{{"logprobs":{sure}}}],"choices":[{{"logprobs":{sure},"logprobs":{unsure}}}]}}"#
        )));
        assert!(!escalates(&format!(
            r#"{{"choices":[{{"logprobs":{unsure}}}],"choices":[{{"logprobs":{sure}}}]}}"#
        )));
        assert!(escalates(
            r#"{"choices":[{"logprobs":{"content":[{"logprob":-0.1,"logprob":-9}]}}]}"#
        ));
        // Integers are numbers; anything else in a token is skipped.
        assert!(escalates(
            r#"{"choices":[{"logprobs":{"content":[{"logprob":-9},{"logprob":null},[1],7]}}]}"#
        ));
    }

    #[test]
    fn a_large_answer_is_judged_without_a_tree() {
        // About 4 MiB of logprob entries: only the window is tallied.
        let entries: Vec<Value> = (0..50_000)
            .map(|i| chat_entry(" w", if i < 16 { -0.1 } else { -9.0 }, 0))
            .collect();
        let mut answer: Value = serde_json::from_str(CHAT).unwrap();
        answer["choices"][0]["logprobs"] = serde_json::json!({ "content": entries });
        let body = bytes(&answer);
        assert!(body.len() > 3 << 20);
        let windowed = check(Endpoint::ChatCompletions, Measure::Min, 16);
        let Judgement::Keep(Some(stripped)) = windowed.judge(&body) else {
            panic!("expected a stripped body");
        };
        assert_eq!(std::str::from_utf8(&stripped).unwrap(), CHAT.trim_end());
        let whole = check(Endpoint::ChatCompletions, Measure::Min, 0);
        assert_eq!(
            whole.judge(&body),
            Judgement::Escalate(reason::LOW_CONFIDENCE)
        );
    }
}
