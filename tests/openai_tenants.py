"""The `openai` package against Sluice's tenants: what a user's code sees of its limits.

Usage: python3 tests/openai_tenants.py BASE_URL MODEL KEY LIMIT
Run by tests/openai_client.rs: KEY's tenant may make LIMIT requests a minute.
"""
import sys

import openai
from openai import OpenAI

base_url, model, key, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


def ask(client):
    return client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
    )


# An unknown key: the SDK's AuthenticationError.
stranger = OpenAI(base_url=f"{base_url}/v1", api_key="sk-nobody", max_retries=0, timeout=30)
try:
    ask(stranger)
    raise SystemExit("an unknown key was served")
except openai.AuthenticationError as e:
    assert e.status_code == 401, e

client = OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=30)
for i in range(limit):
    raw = ask(client)
    assert raw.http_response.status_code == 200, raw
    assert raw.headers["x-ratelimit-limit-requests"] == str(limit), dict(raw.headers)
    assert raw.headers["x-ratelimit-remaining-requests"] == str(limit - 1 - i), dict(raw.headers)
    assert raw.parse().choices[0].message.content

# One more: the SDK surfaces the 429 as RateLimitError, with the headers it backs off by.
try:
    ask(client)
    raise SystemExit(f"request {limit + 1} was served")
except openai.RateLimitError as e:
    headers = e.response.headers
    assert e.status_code == 429, e
    assert int(headers["retry-after"]) >= 1, dict(headers)
    assert headers["x-ratelimit-remaining-requests"] == "0", dict(headers)
    assert headers["x-ratelimit-reset-requests"], dict(headers)
    assert headers["x-sluice-rejected"] == "rate-limited", dict(headers)
    error = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
    assert error.get("reason") == "rate-limited", e.body

print(f"ok: {limit} served, then RateLimitError")
