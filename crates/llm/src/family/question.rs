//! What a semantic cache compares of a request ([`ApiFamily::question`]): the question the
//! request ends with (its last user turn's text), and everything else that changes the
//! answer (the body with that text taken out), and whether the request is a tool-calling or
//! agent turn, whose answer depends on more than its words.
//!
//! The families share one reading: a list of turns (`messages`, `input`), each with a `role`
//! and a `content` that is a string or a list of parts whose text is in `text`. A request
//! whose last turn is not a user's (an assistant prefill, a tool result), or whose last turn
//! holds anything but text (an image), has no question. See
//! [`super::ApiFamily::question`].

use serde_json::{Map, Value};

/// The question of a request, and the rest of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    /// The last user turn's text (its text parts joined by a newline).
    pub text: String,
    /// The body, as JSON, with that text taken out (the turn's content made `""`): what the
    /// fingerprint is made of, so that two questions are compared only when everything else
    /// that shapes their answers is the same.
    pub rest: Vec<u8>,
    /// The request defines tools, carries tool calls or their results, or continues a stored
    /// conversation: an agent's turn.
    pub agentic: bool,
}

/// Where a family keeps its turns.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Turns {
    /// A list of turns under this member (`messages`); a chat's system prompt and
    /// Anthropic's `system` stay in the rest.
    List(&'static str),
    /// Like `List`, but the member may also be a plain string: the whole question (the
    /// Responses API's `input`).
    ListOrString(&'static str),
    /// A text completion's `prompt`, a string: the whole question.
    Prompt,
}

/// Members whose presence makes a request an agent's turn.
const AGENT_MEMBERS: &[&str] = &["tools", "functions", "previous_response_id", "conversation"];

/// Turn roles and part types that are tool traffic.
const TOOL_MARKS: &[&str] = &[
    "tool",
    "function",
    "tool_use",
    "tool_result",
    "function_call",
    "function_call_output",
    "server_tool_use",
    "mcp_call",
];

/// The question of `body`, read as `turns` says.
pub(crate) fn read(body: &[u8], turns: Turns) -> Option<Question> {
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    let mut agentic = AGENT_MEMBERS
        .iter()
        .any(|m| object.get(*m).is_some_and(|v| !is_empty(v)));
    let text = match turns {
        Turns::Prompt => match object.get_mut("prompt") {
            Some(Value::String(prompt)) => std::mem::take(prompt),
            _ => return None,
        },
        Turns::ListOrString(member) if matches!(object.get(member), Some(Value::String(_))) => {
            match object.get_mut(member) {
                Some(Value::String(input)) => std::mem::take(input),
                _ => return None,
            }
        }
        Turns::List(member) | Turns::ListOrString(member) => {
            let Some(Value::Array(list)) = object.get_mut(member) else {
                return None;
            };
            agentic |= list.iter().any(has_tool_marks);
            let last = list.last_mut()?.as_object_mut()?;
            if last.get("role").and_then(Value::as_str) != Some("user") {
                return None;
            }
            take_text(last)?
        }
    };
    if text.trim().is_empty() {
        return None;
    }
    let rest = serde_json::to_vec(&value).ok()?;
    Some(Question {
        text,
        rest,
        agentic,
    })
}

/// The text of a turn's `content`, taken out of it (left `""`); `None` when it holds
/// anything but text.
fn take_text(turn: &mut Map<String, Value>) -> Option<String> {
    let content = turn.get_mut("content")?;
    let text = match content {
        Value::String(text) => std::mem::take(text),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts.iter() {
                let part = part.as_object()?;
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
                if !matches!(kind, "text" | "input_text") {
                    return None;
                }
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(part.get("text")?.as_str()?);
            }
            text
        }
        _ => return None,
    };
    *content = Value::String(String::new());
    Some(text)
}

/// Whether a turn is, or carries, tool traffic.
fn has_tool_marks(turn: &Value) -> bool {
    let Some(turn) = turn.as_object() else {
        return false;
    };
    let marked = |v: Option<&Value>| {
        v.and_then(Value::as_str)
            .is_some_and(|s| TOOL_MARKS.contains(&s))
    };
    if marked(turn.get("role")) || marked(turn.get("type")) {
        return true;
    }
    if ["tool_calls", "function_call", "tool_call_id"]
        .iter()
        .any(|m| turn.get(*m).is_some_and(|v| !is_empty(v)))
    {
        return true;
    }
    match turn.get("content") {
        Some(Value::Array(parts)) => parts.iter().any(|p| marked(p.get("type"))),
        _ => false,
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// The words of an answer in a family's kept form: the strings of its `text`, `content`,
/// `refusal`, `name` (a tool call's function) and `arguments` members in order, whatever the
/// family: what two answers are compared by (their ids, times and usage differ always).
pub fn answer_words(answer: &str) -> String {
    let mut words = String::new();
    if let Ok(value) = serde_json::from_str::<Value>(answer) {
        collect(&value, &mut words);
    }
    words
}

fn collect(value: &Value, into: &mut String) {
    match value {
        Value::Object(members) => {
            for (key, member) in members {
                match member {
                    Value::String(text)
                        if matches!(
                            key.as_str(),
                            "text" | "content" | "refusal" | "name" | "arguments"
                        ) =>
                    {
                        if !into.is_empty() {
                            into.push('\n');
                        }
                        into.push_str(text);
                    }
                    _ => collect(member, into),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| collect(item, into)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_question_is_its_last_user_turn_and_the_rest_keeps_the_system_prompt() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"What is the capital of France?"}],"temperature":0}"#;
        let q = read(body, Turns::List("messages")).unwrap();
        assert_eq!(q.text, "What is the capital of France?");
        assert!(!q.agentic);
        let rest: Value = serde_json::from_slice(&q.rest).unwrap();
        assert_eq!(rest["messages"][0]["content"], "be brief");
        assert_eq!(rest["messages"][1]["content"], "");
        // Another wording of the question leaves the same rest.
        let other = br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"France's capital?"}],"temperature":0}"#;
        assert_eq!(read(other, Turns::List("messages")).unwrap().rest, q.rest);
    }

    #[test]
    fn text_parts_are_joined_and_an_image_leaves_no_question() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;
        assert_eq!(read(body, Turns::List("messages")).unwrap().text, "a\nb");
        let image = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert_eq!(read(image, Turns::List("messages")), None);
    }

    #[test]
    fn a_request_that_does_not_end_with_a_user_turn_has_no_question() {
        let body = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure,"}]}"#;
        assert_eq!(read(body, Turns::List("messages")), None);
        assert_eq!(read(br#"{"messages":[]}"#, Turns::List("messages")), None);
        assert_eq!(
            read(
                br#"{"messages":[{"role":"user","content":"  "}]}"#,
                Turns::List("messages")
            ),
            None
        );
    }

    #[test]
    fn tools_tool_results_and_stored_conversations_are_agent_turns() {
        let tools = br#"{"messages":[{"role":"user","content":"weather?"}],"tools":[{"type":"function","function":{"name":"w"}}]}"#;
        assert!(read(tools, Turns::List("messages")).unwrap().agentic);
        let called = br#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},{"role":"tool","tool_call_id":"1","content":"sunny"},{"role":"user","content":"and tomorrow?"}]}"#;
        assert!(read(called, Turns::List("messages")).unwrap().agentic);
        let anthropic = br#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"1","content":"x"}]},{"role":"assistant","content":"ok"},{"role":"user","content":"go on"}]}"#;
        assert!(read(anthropic, Turns::List("messages")).unwrap().agentic);
        let stored = br#"{"input":"go on","previous_response_id":"resp_1"}"#;
        assert!(read(stored, Turns::ListOrString("input")).unwrap().agentic);
        let empty_tools = br#"{"messages":[{"role":"user","content":"hi"}],"tools":[]}"#;
        assert!(!read(empty_tools, Turns::List("messages")).unwrap().agentic);
    }

    #[test]
    fn a_prompt_and_a_plain_input_are_the_whole_question() {
        let q = read(br#"{"prompt":"Once upon","max_tokens":5}"#, Turns::Prompt).unwrap();
        assert_eq!(q.text, "Once upon");
        let rest: Value = serde_json::from_slice(&q.rest).unwrap();
        assert_eq!(rest["prompt"], "");
        assert_eq!(rest["max_tokens"], 5);
        let input = read(br#"{"input":"hello there"}"#, Turns::ListOrString("input")).unwrap();
        assert_eq!(input.text, "hello there");
        let items = br#"{"input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]}]}"#;
        assert_eq!(
            read(items, Turns::ListOrString("input")).unwrap().text,
            "hi"
        );
        // A batch of prompts is no one question.
        assert_eq!(read(br#"{"prompt":["a","b"]}"#, Turns::Prompt), None);
    }

    #[test]
    fn an_answers_words_are_its_text_whatever_the_family() {
        let chat = r#"{"id":"x","created":1,"choices":[{"index":0,"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],"usage":{"prompt_tokens":3}}"#;
        assert_eq!(answer_words(chat), "Paris.");
        let messages = r#"{"id":"m","content":[{"type":"text","text":"Paris"},{"type":"text","text":"is it"}]}"#;
        assert_eq!(answer_words(messages), "Paris\nis it");
        let completion = r#"{"choices":[{"text":" upon a time"}]}"#;
        assert_eq!(answer_words(completion), " upon a time");
        // Two tools called with the same arguments are two answers.
        let call = |name: &str| {
            format!(
                r#"{{"choices":[{{"message":{{"tool_calls":[{{"function":{{"name":"{name}","arguments":"{{}}"}}}}]}}}}]}}"#
            )
        };
        assert_ne!(
            answer_words(&call("weather")),
            answer_words(&call("stocks"))
        );
    }
}
