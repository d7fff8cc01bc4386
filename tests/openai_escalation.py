"""The `openai` package against the speculative selector: every case must look like a normal
answer to it, whichever pool answered and why.

Usage: python3 tests/openai_escalation.py BASE_URL MODEL CASES_JSON
Each case: {"name", "endpoint": "chat"|"completions", "prompt" (or "prompt_bytes": a prompt
of that many bytes, too long for an argument), "stream", "extra_body",
"headers", "pool", "escalated"}; `pool` and `escalated` are the `x-sluice-pool` and
`x-sluice-escalated` headers expected (`escalated` null when the draft answered).
Run by tests/openai_client.rs, which starts the proxy, the simulators and the faults.
"""
import json
import sys

from openai import OpenAI

base_url, model, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0, timeout=30)


def create(case):
    prompt = case.get("prompt") or "x" * case["prompt_bytes"]
    kwargs = dict(
        model=model,
        max_tokens=16,
        temperature=0,
        stream=case["stream"],
        extra_headers=case.get("headers") or None,
        extra_body=case.get("extra_body") or None,
    )
    if case["endpoint"] == "chat":
        messages = [{"role": "user", "content": prompt}]
        return client.chat.completions.with_raw_response.create(messages=messages, **kwargs)
    return client.completions.with_raw_response.create(prompt=prompt, **kwargs)


def text_of(choice, endpoint):
    if endpoint == "chat":
        return (choice.delta.content if hasattr(choice, "delta") else choice.message.content) or ""
    return choice.text or ""


for case in cases:
    name, endpoint = case["name"], case["endpoint"]
    raw = create(case)
    where = (raw.headers.get("x-sluice-pool"), raw.headers.get("x-sluice-escalated"))
    assert where == (case["pool"], case["escalated"]), (name, where)
    answer = raw.parse()
    if case["stream"]:
        chunks = list(answer)
        text = "".join(text_of(c.choices[0], endpoint) for c in chunks if c.choices)
        finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finished) == 1, (name, finished)
        # Neither asked for: no usage chunk, no logprobs.
        assert all(c.choices for c in chunks), (name, "a usage chunk")
        assert all(c.choices[0].logprobs is None for c in chunks), (name, "logprobs")
    else:
        text = text_of(answer.choices[0], endpoint)
        assert answer.usage.completion_tokens > 0, (name, answer)
        assert answer.choices[0].logprobs is None, (name, "logprobs")
        assert answer.choices[0].finish_reason in ("stop", "length"), (name, answer)
    assert text, (name, "no text")
    print(f"{name}: {where[0]} ({where[1] or 'not escalated'}), {len(text)} characters")

print(f"openai client: {len(cases)} escalation cases passed")
