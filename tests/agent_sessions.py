"""Coding agents' sessions through Sluice, each named where its harness names it, with the
official `anthropic` and `openai` Python packages.

Usage: python3 tests/agent_sessions.py BASE_URL MODEL KEY RUN TURNS SESSION_ID...
Run by tests/agent_sessions.rs, which starts the proxy and two simulated vLLM engines and then
checks which engine each turn reached. Each SESSION_ID is used by every harness below, each
in its own way (the test tells them apart by what reached the engines):
- Claude Code: the `x-claude-code-session-id` header and its session in `metadata.user_id`
  (Anthropic's Messages);
- Codex: the `session-id` header and `prompt_cache_key` (OpenAI's Responses);
- opencode: the `x-session-affinity` header (chat completions);
- an OpenAI SDK user: `prompt_cache_key` alone (chat completions).
Every session's conversation grows by one turn at a time, as an agent's does.
"""
import sys

import anthropic
import openai

base_url, model, key, run, turns = sys.argv[1:6]
session_ids = sys.argv[6:]
turns = int(turns)

# `x-run` tells the test which run (tenant) a request reaching an engine was of.
claude = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=30,
                             default_headers={"x-run": run})
oai = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=30,
                    default_headers={"x-run": run})


def claude_code(sid):
    history = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"claude {sid} turn {turn}: read the file"})
        message = claude.messages.create(
            model=model,
            max_tokens=8,
            messages=history,
            metadata={"user_id": f"user_0f3a_account__session_{sid}"},
            extra_headers={"x-claude-code-session-id": sid, "x-agent": "claude-code"},
        )
        assert message.content[0].type == "text", message
        history.append({"role": "assistant", "content": message.content[0].text})


def codex(sid):
    previous = []
    for turn in range(turns):
        previous.append({"role": "user", "content": f"codex {sid} turn {turn}: run the tests"})
        response = oai.responses.create(
            model=model,
            input=previous,
            max_output_tokens=8,
            store=False,
            extra_headers={"session-id": sid, "x-agent": "codex"},
            extra_body={"prompt_cache_key": sid},
        )
        assert response.status in ("completed", "incomplete"), response
        previous.append({"role": "assistant", "content": response.output_text})


def chat(sid, agent, headers, body):
    messages = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{agent} {sid} turn {turn}: fix it"})
        answer = oai.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=8,
            extra_headers={**headers, "x-agent": agent},
            extra_body=body,
        )
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})


# The sessions' turns interleave, as many agents' do.
for sid in session_ids:
    claude_code(sid)
    codex(sid)
    chat(sid, "opencode", {"x-session-affinity": sid}, {})
    chat(sid, "openai-sdk", {}, {"prompt_cache_key": sid})
print(f"{len(session_ids)} sessions of 4 harnesses, {turns} turns each")
