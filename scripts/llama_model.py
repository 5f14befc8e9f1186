"""Writes a tiny llama-architecture GGUF model with random weights for llama-server.

The weights are noise (the output is gibberish), but the compute per token is that of a real
small model, so prefill time, prefix caching, slots and the /metrics endpoint behave as they
would with a trained one. The tokenizer (`tokenizer.*` keys: the 32,000-token llama SPM
vocabulary) is copied from a vocabulary-only GGUF of the llama.cpp tree, so prompts tokenize
like real llama text.

    python llama_model.py --vocab <tree>/models/ggml-vocab-llama-spm.gguf --out tiny.gguf

Needs the PyPI `gguf` and `numpy` packages (scripts/llama.sh installs them under build/).
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Copies every `tokenizer.*` key; returns the vocabulary size."""
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            writer.add_key_value(name, value, vtype, sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(name, value, vtype)
    return n_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", required=True, help="a vocabulary-only llama GGUF (ggml-vocab-llama-spm.gguf)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    arch = "llama"
    w = gguf.GGUFWriter(a.out, arch)
    w.add_name("kvroute-tiny-random")
    n_vocab = copy_tokenizer(gguf.GGUFReader(a.vocab), w)
    if n_vocab == 0:
        raise SystemExit(f"{a.vocab}: no tokenizer.ggml.tokens")
    head_dim = a.embd // a.heads
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # numpy shape (rows, cols) is GGUF's ne = [cols, rows]: `cols` is the input width.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    w.add_tensor("token_embd.weight", matrix(n_vocab, a.embd))
    for i in range(a.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(a.embd))
        w.add_tensor(p + "attn_q.weight", matrix(a.embd, a.embd))
        w.add_tensor(p + "attn_k.weight", matrix(a.embd, a.embd))
        w.add_tensor(p + "attn_v.weight", matrix(a.embd, a.embd))
        w.add_tensor(p + "attn_output.weight", matrix(a.embd, a.embd))
        w.add_tensor(p + "ffn_norm.weight", ones(a.embd))
        w.add_tensor(p + "ffn_gate.weight", matrix(a.ffn, a.embd))
        w.add_tensor(p + "ffn_up.weight", matrix(a.ffn, a.embd))
        w.add_tensor(p + "ffn_down.weight", matrix(a.embd, a.ffn))
    w.add_tensor("output_norm.weight", ones(a.embd))
    w.add_tensor("output.weight", matrix(n_vocab, a.embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
