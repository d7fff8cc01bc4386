"""The official `anthropic` Python package talks to Sluice, as Claude Code's kind of client does.

Usage: python3 tests/anthropic_client.py BASE_URL MODEL KEY LIMITED_KEY
Run by tests/agent_apis.rs, which starts the proxy (tenants and cache on) and a simulated
vLLM backend. KEY's tenant is unlimited; LIMITED_KEY's may make 2 requests a minute.
"""
import sys
import time

import anthropic


def until_hit(ask):
    """Asks until the answer comes from the cache (storing is asynchronous), for at most 10 s."""
    deadline = time.monotonic() + 10
    while True:
        raw = ask()
        if raw.headers.get("x-cache") == "HIT" or time.monotonic() > deadline:
            return raw
        time.sleep(0.02)


base_url, model, key, limited_key = sys.argv[1:5]
client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=120,
                             default_headers={"anthropic-beta": "sluice-test-2026"})
question = [{"role": "user", "content": "What is the capital of France?"}]

# Non-stream, with a system prompt.
message = client.messages.create(
    model=model, max_tokens=16, system="Be brief.", messages=question, extra_body={"temperature": 0}
)
assert message.type == "message", message
assert message.role == "assistant"
assert message.content[0].type == "text" and message.content[0].text, message
assert message.stop_reason in ("end_turn", "max_tokens"), message
assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0, message.usage

# The same request again: the cache's answer, under a fresh id, as the SDK reads any.
ask = dict(model=model, max_tokens=16, system="Be brief.", messages=question, extra_body={"temperature": 0})
again = until_hit(lambda: client.messages.with_raw_response.create(**ask))
assert again.headers.get("x-cache") == "HIT", dict(again.headers)
hit = again.parse()
assert hit.content[0].text == message.content[0].text and hit.id != message.id, (hit, message)

# Streamed from the cache: the kept answer replayed as Anthropic's events.
raw = client.messages.with_raw_response.create(**ask, stream=True)
assert raw.headers.get("x-cache") == "HIT", dict(raw.headers)
events = list(raw.parse())
assert [e.type for e in events][0] == "message_start" and events[-1].type == "message_stop"
text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
assert text == message.content[0].text, (text, message)

# Streamed from the engine, through the SDK's stream helper.
with client.messages.stream(
    model=model, max_tokens=16, system="Be thorough.", messages=question, extra_body={"temperature": 0}
) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
assert text and final.content[0].text == text, (text, final)
assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0, final.usage

# Tools: a definition, a call and its result in the conversation.
tools = [{"name": "read_file", "description": "Reads a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
conversation = [
    {"role": "user", "content": "Read a.txt"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Reading it."},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.txt"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello"}]},
]
with_tools = client.messages.create(model=model, max_tokens=16, tools=tools, messages=conversation)
assert with_tools.content, with_tools

# Counting tokens generates nothing.
counted = client.messages.count_tokens(model=model, messages=question)
assert counted.input_tokens > 0, counted

# A key no tenant has: the SDK's own AuthenticationError, in Anthropic's shape.
try:
    anthropic.Anthropic(base_url=base_url, api_key="sk-nobody", max_retries=0).messages.create(
        model=model, max_tokens=8, messages=question)
    raise AssertionError("an unknown key was served")
except anthropic.AuthenticationError as e:
    assert e.status_code == 401, e
    assert e.body["type"] == "error" and e.body["error"]["type"] == "authentication_error", e.body

# Over the limited tenant's 2 requests a minute: RateLimitError, with Anthropic's headers.
limited = client.with_options(api_key=limited_key)
seen = []
for i in range(4):
    try:
        r = limited.messages.with_raw_response.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": f"q{i}"}])
        assert r.headers.get("anthropic-ratelimit-requests-limit") == "2", dict(r.headers)
        seen.append(200)
    except anthropic.RateLimitError as e:
        assert e.body["error"]["type"] == "rate_limit_error", e.body
        headers = e.response.headers
        assert headers.get("anthropic-ratelimit-requests-remaining") == "0", dict(headers)
        assert headers.get("anthropic-ratelimit-requests-reset", "").endswith("Z"), dict(headers)
        assert int(headers["retry-after"]) >= 1, dict(headers)
        assert "x-ratelimit-limit-requests" not in headers, dict(headers)
        seen.append(429)
assert seen == [200, 200, 429, 429], seen

# An unknown model: NotFoundError in Anthropic's shape.
try:
    client.messages.create(model="no-such-model", max_tokens=8, messages=question)
    raise AssertionError("an unknown model was served")
except anthropic.NotFoundError as e:
    assert e.body["error"]["type"] == "not_found_error", e.body

print("anthropic client: ok")
