"""A real OpenAI client (the `openai` package) talks to Sluice, as users' code does.

Usage: python3 tests/openai_client.py BASE_URL MODEL
Run by tests/openai_client.rs, which starts the proxy and a simulated vLLM backend.
"""
import sys

import openai
from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0, timeout=30)

# Non-stream chat.
chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=16,
    temperature=0,
)
assert chat.object == "chat.completion", chat
assert chat.choices[0].message.role == "assistant"
assert chat.choices[0].message.content, chat
assert chat.usage.completion_tokens > 0

# Stream chat, with the usage chunk.
chunks = list(
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert text, chunks
assert chunks[0].choices[0].delta.role == "assistant"
assert any(c.choices and c.choices[0].finish_reason for c in chunks)
assert chunks[-1].usage is not None and chunks[-1].choices == [], chunks[-1]

# Text completion, non-stream and stream.
completion = client.completions.create(model=model, prompt="Paris is", max_tokens=8, temperature=0)
assert completion.choices[0].text, completion
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(model=model, prompt="Paris is", max_tokens=8, temperature=0, stream=True)
    if c.choices
)
assert streamed, "empty completion stream"

# Models.
assert model in [m.id for m in client.models.list().data]

# Errors arrive as the SDK's typed exceptions, with the OpenAI body.
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404 and "no-such-model" in str(e), e
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=9)
    raise AssertionError("temperature 9 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e

print("openai client: all checks passed")
