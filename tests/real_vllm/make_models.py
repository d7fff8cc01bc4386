"""Makes the two tiny models the real-vLLM tier serves: Llama-shaped, random weights, and a
byte-level BPE tokenizer trained here on text already on the machine (Python's own sources),
with a chat template that renders tools as the Hermes template does. No weights can be
downloaded; the answers are noise, but every wire, metric and error path is vLLM's own.

Usage: python make_models.py OUT_DIR   -> OUT_DIR/tiny-draft (1 layer), OUT_DIR/tiny-target (2),
OUT_DIR/tiny-draft-lora (a LoRA adapter of tiny-draft, in PEFT's format)
"""

import glob
import json
import os
import sys
import sysconfig

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# ChatML with tools, after the Hermes template vLLM's `hermes` tool parser reads: the tool
# list as JSON in the system turn, calls as <tool_call>{json}</tool_call>.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- elif message.content %}{%- for part in message.content %}{%- if part.type == 'text' %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{%- endfor %}{%- endif %}"
    "<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def corpus():
    """Python's standard library sources: text every machine with Python has."""
    lib = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(lib, "*.py")))[:400]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            yield f.read()


def tokenizer(out):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def model(out, layers, fast):
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        # One head of 64: vLLM's CPU attention kernels take head sizes of 32 and up.
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=16384,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    # Seeded: every machine makes the same weights, so a greedy answer that holds text here
    # holds it everywhere (unseeded, one model in a few thousand ends its answers at once).
    torch.manual_seed(layers)
    LlamaForCausalLM(config).save_pretrained(out)


def lora(out, base, rank=8):
    """A LoRA adapter of the model in `base`, written as PEFT saves one (PEFT itself is not
    needed): rank `rank` on every layer's q_proj and v_proj, small random weights (lora_B not
    zero, so it changes the answers). vLLM reads `r`, `lora_alpha` and `target_modules`."""
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim)}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.1
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": os.path.abspath(base),
                "r": rank,
                "lora_alpha": rank * 2,
                "lora_dropout": 0.0,
                "target_modules": list(shapes),
                "bias": "none",
                "fan_in_fan_out": False,
                "inference_mode": True,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            },
            f,
            indent=2,
        )


def main():
    root = sys.argv[1]
    for name, layers in [("tiny-draft", 1), ("tiny-target", 2)]:
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        fast = tokenizer(out)
        model(out, layers, fast)
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}, f)
    lora(os.path.join(root, "tiny-draft-lora"), os.path.join(root, "tiny-draft"))
    print(root)


if __name__ == "__main__":
    main()
