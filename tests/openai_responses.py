"""The official `openai` Python package's Responses API through Sluice, across a pool of backends
that each keep their own responses (vLLM's in-memory store).

Usage: python3 tests/openai_responses.py BASE_URL MODEL CHAINS
Run by tests/agent_apis.rs. Makes CHAINS conversations of 5 turns, each turn continuing the
last with `previous_response_id`, half of them streamed; every turn must succeed.
"""
import sys
import time

import openai
from openai import OpenAI

base_url, model, chains = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0, timeout=120)

# JSON.
# `ignore_eos` (vLLM's extension) where the test needs text: a sampled answer may otherwise end
# at its first token.
full = {"ignore_eos": True}
first = client.responses.create(model=model, input="What is the capital of France?",
                                instructions="Be brief.", max_output_tokens=16, extra_body=full)
assert first.object == "response" and first.id.startswith("resp_"), first
assert first.output_text, first
assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0, first.usage

# Streamed: numbered events, the whole response at the end.
events = list(client.responses.create(model=model, input="Tell me a story",
                                      max_output_tokens=16, stream=True, extra_body=full))
kinds = [e.type for e in events]
assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
assert [e.sequence_number for e in events] == list(range(len(events))), kinds
done = events[-1].response
text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert text and text == done.output_text, (text, done)
assert done.usage.output_tokens > 0

# Conversations of 5 turns: each follow-up goes to the backend that keeps its predecessor.
failures = []
for chain in range(chains):
    previous = None
    for turn in range(5):
        question = f"conversation {chain}, question {turn}"
        try:
            if chain % 2:
                stream = client.responses.create(model=model, input=question,
                                                 previous_response_id=previous,
                                                 max_output_tokens=8, stream=True,
                                                 extra_body=full)
                response = [e for e in stream if e.type == "response.completed"][0].response
            else:
                response = client.responses.create(model=model, input=question,
                                                   previous_response_id=previous,
                                                   max_output_tokens=8, extra_body=full)
            assert response.previous_response_id == previous, response
            previous = response.id
        except Exception as e:  # noqa: BLE001 - every failure is counted and shown
            failures.append(f"chain {chain} turn {turn}: {e!r}")
            break
assert not failures, failures

# The last response is there to read back, from the backend that keeps it.
kept = client.responses.retrieve(previous)
assert kept.id == previous and kept.output_text, kept

# A response no backend keeps: the SDK's own NotFoundError, in OpenAI's shape.
try:
    client.responses.create(model=model, input="go on", previous_response_id="resp_unknown")
    raise AssertionError("an unknown response was continued")
except openai.NotFoundError as e:
    assert "resp_unknown" in e.body["message"], e.body
try:
    client.responses.retrieve("resp_unknown")
    raise AssertionError("an unknown response was read")
except openai.NotFoundError:
    pass

# Not stored: the cache may keep it, and replays it both ways.
ask = dict(model=model, input="A cached question", max_output_tokens=8, temperature=0,
           store=False)
once = client.responses.create(**ask)
deadline = time.monotonic() + 10  # storing is asynchronous: asked until it is done
while True:
    twice = client.responses.with_raw_response.create(**ask)
    if twice.headers.get("x-cache") == "HIT" or time.monotonic() > deadline:
        break
    time.sleep(0.02)
assert twice.headers.get("x-cache") == "HIT", dict(twice.headers)
assert twice.parse().output_text == once.output_text
raw = client.responses.with_raw_response.create(**ask, stream=True)
assert raw.headers.get("x-cache") == "HIT", dict(raw.headers)
replayed = list(raw.parse())
assert [e.sequence_number for e in replayed] == list(range(len(replayed)))
assert replayed[-1].response.output_text == once.output_text, replayed[-1]

print(f"responses: ok, {chains} conversations of 5 turns")
