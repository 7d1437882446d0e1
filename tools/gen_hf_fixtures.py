#!/usr/bin/env python3
"""Generates the Hugging Face interop fixtures (spec/fixtures/hf/), offline, with transformers itself.

    tools/.venv/bin/python tools/gen_hf_fixtures.py

Two tiny random models, built from configs written here (no download), saved with save_pretrained:
  spec/fixtures/hf/gpt2-tiny/    GPT2LMHeadModel: 2 layers, n_embd 32, 4 heads, vocab 96, 32 positions, tied
                                 lm_head, gelu_new (tanh); one model.safetensors.
  spec/fixtures/hf/llama-tiny/   LlamaForCausalLM: 2 layers, hidden 32, 4 heads, 2 kv heads (GQA), intermediate
                                 80 (not torchtitan's SwiGLU size), vocab 96, 64 positions, rope_theta 500000,
                                 rms_norm_eps 1e-6, untied; saved in shards (model.safetensors.index.json).
Every parameter is drawn again after transformers' init (whose biases are 0 and norms 1) so that the biases,
norm weights and each q/k row matter: matrices N(0, 0.15), biases N(0, 0.1), norm weights 1 + N(0, 0.1).
Next to each folder, <name>.logits.safetensors holds "tokens" (i64 [2, 12], fixed ids) and "logits" (f32
[2, 12, vocab]): the model's eval-mode logits for them, which spec/hf_spec.lua compares the engine's with.
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "spec", "fixtures", "hf")
SEED = 29
BATCH, SEQ = 2, 12


def perturb(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
            elif "norm" in name or "ln_" in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def build(name, model, vocab, **save_opts):
    gen = torch.Generator().manual_seed(SEED)
    perturb(model, gen)
    model.eval()
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    with torch.no_grad():
        logits = model(tokens).logits.float().contiguous()
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, **save_opts)
    save_file({"tokens": tokens, "logits": logits}, os.path.join(OUT, name + ".logits.safetensors"),
              metadata={"generator": "tools/gen_hf_fixtures.py", "model": name})
    files = sorted(os.listdir(d))
    print(f"{name}: {files}, logits max |x| {logits.abs().max().item():.3f}, "
          f"{sum(os.path.getsize(os.path.join(d, f)) for f in files)} bytes")


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(SEED)
    gpt2 = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0,
                      eos_token_id=0, activation_function="gelu_new", layer_norm_epsilon=1e-5)
    build("gpt2-tiny", GPT2LMHeadModel(gpt2), 96)

    torch.manual_seed(SEED)
    llama = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=80, vocab_size=96, max_position_embeddings=64, rms_norm_eps=1e-6,
                        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    build("llama-tiny", LlamaForCausalLM(llama), 96, max_shard_size="64KB")
    with open(os.path.join(OUT, "llama-tiny", "config.json")) as f:
        print("llama-tiny rope:", json.load(f).get("rope_parameters"))


if __name__ == "__main__":
    main()
