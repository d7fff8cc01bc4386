#!/usr/bin/env python3
"""Parse a vLLM /metrics exposition (stdin) with the reference parser and check it.

usage: parse_metrics.py v1|v0 [--spec] < metrics.txt
Exits non-zero if the text does not parse or a required family is missing; prints the samples
as JSON ([[name, labels, value], ...]) on success so a caller can check values.
"""
import json
import sys

from prometheus_client.parser import text_string_to_metric_families

COMMON = [
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:cache_config_info", "gauge"),
]
V1 = COMMON + [
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
]
V0 = COMMON + [("vllm:gpu_cache_usage_perc", "gauge")]
SPEC_V1 = [
    ("vllm:spec_decode_num_drafts", "counter"),
    ("vllm:spec_decode_num_draft_tokens", "counter"),
    ("vllm:spec_decode_num_accepted_tokens", "counter"),
]
SPEC_V0 = [
    ("vllm:spec_decode_num_accepted_tokens", "counter"),
    ("vllm:spec_decode_num_draft_tokens", "counter"),
    ("vllm:spec_decode_num_emitted_tokens", "counter"),
]


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "v1"
    spec = "--spec" in sys.argv
    text = sys.stdin.read()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    required = list(V1 if mode == "v1" else V0)
    if spec:
        required += SPEC_V1 if mode == "v1" else SPEC_V0
    errors = []
    for name, kind in required:
        f = families.get(name)
        if f is None:
            errors.append(f"missing family {name}")
        elif f.type != kind:
            errors.append(f"{name}: type {f.type}, expected {kind}")
    samples = []
    for f in families.values():
        for s in f.samples:
            labels = dict(s.labels)
            if f.name.startswith("vllm:") and f.name not in ("vllm:lora_requests_info", "vllm:cache_config_info"):
                if "model_name" not in labels:
                    errors.append(f"{s.name} has no model_name label")
                # vLLM 0.32 counts admission rejections per model, not per engine.
                per_engine = not f.name.startswith("vllm:admission_rejections")
                if mode == "v1" and per_engine and labels.get("engine") != "0":
                    errors.append(f"{s.name} has no engine=\"0\" label")
                if mode == "v0" and "engine" in labels:
                    errors.append(f"{s.name} has an engine label in v0 mode")
            if mode == "v0" and s.name.endswith("_created"):
                errors.append(f"{s.name}: v0 has no _created series")
            samples.append([s.name, labels, s.value])
    if mode == "v1" and not any(s[0].endswith("_created") for s in samples):
        errors.append("v1 exposes _created series")
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(1)
    json.dump(samples, sys.stdout)


if __name__ == "__main__":
    main()
