"""Writes a tiny Llama (Hugging Face format) with random weights and a real tokenizer for vLLM.

The weights are noise (answers are gibberish) but the compute per token is that of a small real
model, so prefill time, prefix caching, KV events and metrics behave as they would with a
trained one. The tokenizer is Mistral-7B's 32k SentencePiece model that PyPI `mistral_common`
(a vLLM dependency) ships, converted by `transformers` to `tokenizer.json`: prompts tokenize
like real text, and nothing comes from the Hugging Face hub.

    build/vllm-venv/bin/python vllm_model.py --out build/vllm-model

Runs in the vLLM venv (scripts/vllm_install.sh); a fixed seed makes the weights reproducible.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import mistral_common
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

# Turns as "[role]\n...\n"; the generation prompt ends in a newline so that the next turn's
# prompt tokenizes as an extension of this one (no trailing space merging into the answer).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]\n{% endif %}"
)


def sentencepiece_model() -> str:
    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: mistral_common does not ship its v1 SentencePiece model here")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as src:
        shutil.copy(sentencepiece_model(), os.path.join(src, "tokenizer.model"))
        tok = LlamaTokenizer.from_pretrained(src)
    tok.chat_template = CHAT_TEMPLATE
    vocab = len(tok)

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        max_position_embeddings=a.ctx,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    if not os.path.isfile(os.path.join(a.out, "tokenizer.json")):
        raise SystemExit(f"{a.out}: transformers wrote no tokenizer.json")
    print(f"wrote {a.out}: vocab {vocab}, {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
