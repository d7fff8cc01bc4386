//! A family shaped like Google's `generateContent`, in the tests only: the proof that a
//! family whose format is not OpenAI's is one module and one line in `families!`.
//!
//! What makes it unlike the shipped families, and what each needs of the seam:
//! - the model and the stream flag are in the path
//!   (`/v1beta/models/{model}:streamGenerateContent`): [`ApiFamily::route`];
//! - its own members (`contents`, `systemInstruction`, `generationConfig.maxOutputTokens`),
//!   read by its own parse into the shared request model with the shared building blocks
//!   ([`Input::from_json`], [`Content::from_json`], [`LlmRequest::check_sampling`]);
//! - the pool's served name goes in the path, not the body: [`ApiFamily::path_with_model`];
//! - its budget is nested (`generationConfig.maxOutputTokens`): [`ApiFamily::with_budget`];
//! - its usage is `usageMetadata` with its own names: [`ApiFamily::usage_names`];
//! - its stream is `data:` events of partial answers, without `[DONE]`;
//! - its errors are `{"error": {"code", "message", "status"}}`.

use super::openai::AnswerText;
use super::{AnswerError, ApiFamily, RouteMatch, StreamAnswer, WholeStream, WireError};
use crate::request::{Content, Endpoint, Input, InvalidRequest, LlmCall, LlmRequest};
use crate::usage::{Usage, UsageNames};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

#[derive(Debug)]
pub struct Gemini;

pub static GEMINI: Gemini = Gemini;

const MODELS: &str = "/v1beta/models/";

/// The path's method for a whole answer and for a stream.
const WHOLE: &str = "generateContent";
const STREAM: &str = "streamGenerateContent";

impl ApiFamily for Gemini {
    fn name(&self) -> &'static str {
        "test_gemini"
    }

    fn path(&self) -> &'static str {
        "/v1beta/models/{model}:generateContent"
    }

    fn route(&self, path: &str) -> Option<RouteMatch> {
        let (model, method) = path.strip_prefix(MODELS)?.rsplit_once(':')?;
        let stream = match method {
            WHOLE => false,
            STREAM => true,
            _ => return None,
        };
        (!model.is_empty() && !model.contains('/')).then(|| RouteMatch {
            model: Some(model.to_string()),
            stream: Some(stream),
        })
    }

    fn parse(
        &self,
        endpoint: Endpoint,
        route: RouteMatch,
        body: Bytes,
    ) -> Result<LlmCall, InvalidRequest> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Request<'a> {
            #[serde(borrow)]
            contents: Option<&'a RawValue>,
            #[serde(borrow)]
            system_instruction: Option<Parts<'a>>,
            #[serde(default)]
            generation_config: Config,
        }
        #[derive(Deserialize)]
        struct Parts<'a> {
            #[serde(borrow)]
            parts: &'a RawValue,
        }
        #[derive(Deserialize, Default)]
        #[serde(rename_all = "camelCase")]
        struct Config {
            max_output_tokens: Option<u32>,
            temperature: Option<f64>,
            top_p: Option<f64>,
            candidate_count: Option<u32>,
            seed: Option<i64>,
        }
        let invalid = |message: String, param: Option<&str>| InvalidRequest {
            message,
            param: param.map(str::to_string),
        };
        let text = std::str::from_utf8(&body)
            .map_err(|_| invalid("Invalid JSON payload received.".into(), None))?;
        let read: Request = serde_json::from_str(text)
            .map_err(|e| invalid(format!("Invalid JSON payload received. {e}"), None))?;
        let contents = read
            .contents
            .and_then(|c| Input::from_json(&body, c))
            .filter(|c| matches!(c, Input::Items { items, .. } if !items.is_empty()))
            .ok_or_else(|| invalid("* contents: must not be empty".into(), Some("contents")))?;
        let system = match read.system_instruction {
            Some(s) => Some(Content::from_json(&body, s.parts).ok_or_else(|| {
                invalid(
                    "* system_instruction.parts: must be a list".into(),
                    Some("systemInstruction"),
                )
            })?),
            None => None,
        };
        let config = read.generation_config;
        let request = LlmRequest {
            model: route.model.clone(),
            stream: route.stream,
            input: Some(contents),
            system,
            max_tokens: config.max_output_tokens,
            temperature: config.temperature,
            top_p: config.top_p,
            n: config.candidate_count,
            seed: config.seed,
            ..LlmRequest::default()
        };
        request.check_sampling()?;
        Ok(LlmCall::from_parts(endpoint, route, body, request, None))
    }

    fn path_with_model(&self, route: &RouteMatch, model: &str) -> Option<String> {
        let method = if route.stream == Some(true) {
            STREAM
        } else {
            WHOLE
        };
        Some(format!("{MODELS}{model}:{method}"))
    }

    fn budget_key(&self, _request: &LlmRequest) -> &'static str {
        "generationConfig.maxOutputTokens"
    }

    fn with_budget(&self, _request: &LlmRequest, body: &[u8], ceiling: u32) -> Option<Vec<u8>> {
        // A test family: a tree is simple, and bodies here are small.
        let mut tree: Value = serde_json::from_slice(body).ok()?;
        let object = tree.as_object_mut()?;
        let config = object
            .entry("generationConfig")
            .or_insert_with(|| json!({}));
        config
            .as_object_mut()?
            .insert("maxOutputTokens".into(), ceiling.into());
        serde_json::to_vec(&tree).ok()
    }

    fn usage_names(&self) -> UsageNames {
        UsageNames {
            key: "\"usageMetadata\"",
            prompt: &["promptTokenCount"],
            completion: "candidatesTokenCount",
            cached: &["cachedContentTokenCount"],
            created: &[],
        }
    }

    fn is_error_event(&self, data: &[u8]) -> bool {
        data.trim_ascii_start().starts_with(b"{\"error\"")
    }

    fn answer_from_json(&self, body: Bytes) -> Result<AnswerText, AnswerError> {
        let answer: Value = serde_json::from_slice(&body).map_err(|_| AnswerError::NotAnAnswer)?;
        let candidates = answer["candidates"]
            .as_array()
            .filter(|c| !c.is_empty())
            .ok_or(AnswerError::NotAnAnswer)?;
        if candidates.iter().any(|c| c["finishReason"].is_null()) {
            return Err(AnswerError::Incomplete);
        }
        AnswerText::checked(body).ok_or(AnswerError::NotAnAnswer)
    }

    /// Each event is a partial answer: the texts are joined, the last finish reason and
    /// usage kept.
    fn answer_from_stream(
        &self,
        chunks: &[Bytes],
        usage: Option<Usage>,
    ) -> Result<AnswerText, AnswerError> {
        let mut text = String::new();
        let (mut finish, mut metadata, mut version) = (Value::Null, Value::Null, Value::Null);
        for event in super::stream_events(chunks)? {
            if !event["error"].is_null() {
                return Err(AnswerError::ErrorEvent);
            }
            let candidate = &event["candidates"][0];
            for part in candidate["content"]["parts"]
                .as_array()
                .into_iter()
                .flatten()
            {
                text.push_str(part["text"].as_str().unwrap_or_default());
            }
            if !candidate["finishReason"].is_null() {
                finish = candidate["finishReason"].clone();
            }
            if !event["usageMetadata"].is_null() {
                metadata = event["usageMetadata"].clone();
            }
            if !event["modelVersion"].is_null() {
                version = event["modelVersion"].clone();
            }
        }
        if finish.is_null() {
            return Err(AnswerError::Incomplete);
        }
        if let (true, Some(usage)) = (metadata.is_null(), usage) {
            metadata = json!({
                "promptTokenCount": usage.prompt_tokens,
                "candidatesTokenCount": usage.completion_tokens,
            });
        }
        AnswerText::from_value(&json!({
            "candidates": [{
                "content": {"role": "model", "parts": [{"text": text}]},
                "finishReason": finish,
                "index": 0,
            }],
            "usageMetadata": metadata,
            "modelVersion": version,
        }))
    }

    fn stream_answer(&'static self) -> Box<dyn StreamAnswer> {
        WholeStream::boxed(self)
    }

    fn render_json(&self, answer: &AnswerText, id: &str, _created: u64) -> Bytes {
        let mut tree = answer.tree();
        tree["responseId"] = Value::from(id);
        Bytes::from(serde_json::to_vec(&tree).unwrap_or_default())
    }

    /// The whole answer as one event: a Gemini stream has no end marker.
    fn render_stream(
        &self,
        answer: &AnswerText,
        id: &str,
        created: u64,
        _include_usage: bool,
    ) -> Bytes {
        let json = self.render_json(answer, id, created);
        Bytes::from([b"data: ", &json[..], b"\n\n"].concat())
    }

    fn id_prefix(&self) -> &'static str {
        "gemini"
    }

    fn error_body(&self, error: &WireError<'_>) -> Vec<u8> {
        let status = match error.status {
            400 => "INVALID_ARGUMENT",
            429 => "RESOURCE_EXHAUSTED",
            503 => "UNAVAILABLE",
            504 => "DEADLINE_EXCEEDED",
            _ => "INTERNAL",
        };
        serde_json::to_vec(&json!({"error": {
            "code": error.status,
            "message": error.message,
            "status": status,
        }}))
        .unwrap_or_default()
    }

    fn error_event(&self, error: &WireError<'_>) -> Vec<u8> {
        [b"data: ", &self.error_body(error)[..], b"\n\n"].concat()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::UsageScanner;

    const BODY: &str = r#"{
        "contents": [{"role": "user", "parts": [{"text": "Why is the sky blue? Say it in a paragraph."}]}],
        "systemInstruction": {"parts": [{"text": "You are a physicist."}]},
        "generationConfig": {"maxOutputTokens": 64, "temperature": 0.5}
    }"#;

    fn routed(path: &str) -> (Endpoint, RouteMatch) {
        Endpoint::route(path).unwrap_or_else(|| panic!("{path} is not routed"))
    }

    #[test]
    fn the_path_names_the_model_and_the_stream() {
        let (endpoint, found) = routed("/v1beta/models/gemma-3:streamGenerateContent");
        assert_eq!(endpoint, Endpoint::TestGemini);
        assert_eq!(found.model.as_deref(), Some("gemma-3"));
        assert_eq!(found.stream, Some(true));
        let (_, found) = routed("/v1beta/models/gemma-3:generateContent");
        assert_eq!(found.stream, Some(false));
        for path in [
            "/v1beta/models/:generateContent",
            "/v1beta/models/a/b:generateContent",
            "/v1beta/models/gemma-3:countTokens",
            "/v1beta/models/gemma-3",
        ] {
            assert_eq!(Endpoint::route(path), None, "{path}");
        }
        // The shipped families are found as before.
        assert_eq!(
            Endpoint::route("/v1/chat/completions"),
            Some((Endpoint::ChatCompletions, RouteMatch::default()))
        );
    }

    #[test]
    fn its_own_members_make_the_request_and_its_demand() {
        let (endpoint, found) = routed("/v1beta/models/gemma-3:streamGenerateContent");
        let call = LlmCall::parse_routed(endpoint, found, Bytes::from(BODY)).unwrap();
        assert_eq!(call.request.model.as_deref(), Some("gemma-3"));
        assert!(call.request.is_stream());
        assert_eq!(call.request.max_output_tokens(), Some(64));
        assert_eq!(call.demand.output_tokens, 64);
        // The contents and the system instruction are the prompt's estimate.
        let bare = BODY.replace(
            r#""systemInstruction": {"parts": [{"text": "You are a physicist."}]},"#,
            "",
        );
        let without = LlmCall::parse_routed(
            endpoint,
            routed("/v1beta/models/gemma-3:generateContent").1,
            Bytes::from(bare),
        )
        .unwrap();
        assert!(call.demand.prompt_tokens > without.demand.prompt_tokens);
        assert!(without.demand.prompt_tokens > 10, "{:?}", without.demand);
        // Its own checks and the shared ones.
        let (endpoint, found) = routed("/v1beta/models/gemma-3:generateContent");
        let refused = |body: &'static str| {
            LlmCall::parse_routed(endpoint, found.clone(), Bytes::from(body)).unwrap_err()
        };
        assert_eq!(
            refused(r#"{"contents": []}"#).param.as_deref(),
            Some("contents")
        );
        assert_eq!(
            refused(r#"{"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"temperature": 3}}"#)
                .param
                .as_deref(),
            Some("temperature")
        );
        // A ceiling sets its nested budget, and the request read again says so.
        let capped = call.capped(16).unwrap().unwrap();
        assert_eq!(capped.request.max_output_tokens(), Some(16));
        assert_eq!(capped.route, call.route);
        assert!(call.capped(100).is_none());
    }

    #[test]
    fn the_served_name_goes_in_the_path() {
        let (endpoint, found) = routed("/v1beta/models/public:streamGenerateContent");
        assert_eq!(
            endpoint.family().path_with_model(&found, "gemma-3-1b"),
            Some("/v1beta/models/gemma-3-1b:streamGenerateContent".to_string())
        );
        // The shipped families put it in the body.
        assert_eq!(
            Endpoint::ChatCompletions
                .family()
                .path_with_model(&RouteMatch::default(), "m"),
            None
        );
    }

    #[test]
    fn its_usage_is_read_under_its_names_and_its_answers_kept() {
        let stream = [
            "data: {\"candidates\":[{\"content\":{\"role\":\"model\",\"parts\":[{\"text\":\"Rayleigh \"}]},\"index\":0}],\"modelVersion\":\"gemma-3\"}\n\n",
            "data: {\"candidates\":[{\"content\":{\"role\":\"model\",\"parts\":[{\"text\":\"scattering.\"}]},\"finishReason\":\"STOP\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":12,\"candidatesTokenCount\":4,\"totalTokenCount\":16},\"modelVersion\":\"gemma-3\"}\n\n",
        ];
        let family = Endpoint::TestGemini.family();
        let mut scanner: UsageScanner = family.usage_scanner(true);
        for chunk in stream {
            scanner.feed(chunk.as_bytes());
        }
        assert_eq!(
            scanner.usage(),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 4
            })
        );
        let chunks: Vec<Bytes> = stream.iter().map(|c| Bytes::from(*c)).collect();
        let kept = family.answer_from_stream(&chunks, None).unwrap();
        let tree = kept.tree();
        assert_eq!(
            tree["candidates"][0]["content"]["parts"][0]["text"],
            "Rayleigh scattering."
        );
        // Replayed as a stream, it reads back the same; a cut stream is not kept.
        let replay = family.render_stream(&kept, "r-1", 0, true);
        let back = family.answer_from_stream(&[replay], None).unwrap();
        assert_eq!(back.tree()["candidates"], tree["candidates"]);
        assert_eq!(
            family.answer_from_stream(&chunks[..1], None),
            Err(AnswerError::Incomplete)
        );
        // Its errors take its shape.
        let error = WireError {
            status: 429,
            message: "slow down",
            param: None,
            reason: "tenant-rate",
        };
        let body: Value = serde_json::from_slice(&family.error_body(&error)).unwrap();
        assert_eq!(body["error"]["status"], "RESOURCE_EXHAUSTED");
        assert!(family.is_error_event(&family.error_body(&error)));
    }
}
