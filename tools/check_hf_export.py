#!/usr/bin/env python3
"""Checks that Hugging Face folders exported by the engine (engine.hf.save) load in transformers with equal logits.

    tools/.venv/bin/python tools/check_hf_export.py [--engine build/engine] [--keep DIR]

Runs the engine on a small Lua program (written to a temporary folder) that builds random models, saves each
with hf.save and writes its logits for fixed token ids (engine.save): a GPT (nn.Transformer) with GPT-2's
attention biases and tanh GELU, a GPT without attention biases (exported as zero biases), exact GELU and an
untied output, a Llama with grouped-query attention, and a Llama with tied embeddings, one k/v head and its
own feed-forward size.  Each folder is then loaded with transformers' AutoModelForCausalLM (offline) and its
logits compared with the engine's: the check passes when every max |difference| is below 1e-5 (f32).
Prints one line per model and exits non-zero on a failure.  docs/hf.md records a run.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5

LUA = r"""
local engine = require("engine")
local hf = require("engine.hf")
local nn = engine.nn
local out = arg[1]
local models = {
  { "gpt-bias", nn.Transformer{ n_layers = 2, dim = 48, n_heads = 4, vocab_size = 80, max_seq_len = 32,
      attn_bias = true, gelu = "tanh" } },
  { "gpt-nobias", nn.Transformer{ n_layers = 2, dim = 32, n_heads = 2, vocab_size = 64, max_seq_len = 24,
      weight_tying = false } },
  { "llama-gqa", nn.Llama{ dim = 64, n_layers = 2, n_heads = 8, n_kv_heads = 2, vocab_size = 100, multiple_of = 32,
      max_seq_len = 32, rope_theta = 10000, norm_eps = 1e-5 } },
  { "llama-tied", nn.Llama{ dim = 32, n_layers = 3, n_heads = 4, n_kv_heads = 1, vocab_size = 72, ffn_hidden_dim = 72,
      max_seq_len = 32, rope_theta = 500000, norm_eps = 1e-6, weight_tying = true } },
}
engine.manual_seed(2029)
for _, e in ipairs(models) do
  local name, m = e[1], e[2]
  m:eval()
  -- spread the parameters away from their init (zero biases, unit norms) so that every one matters
  engine.no_grad(function()
    for _, p in ipairs(m:parameters()) do p:add_(engine.randn(p:shape()) * 0.05) end
    m.tok_embeddings.weight:mul_(0.1)   -- N(0, 1) embeddings, tied as the output, give logits ~40: keep them ~4
  end)
  local V = m.model_args.vocab_size
  local tokens = (engine.rand(2, 16) * V):to("i64")
  local logits = engine.no_grad(function() return m(tokens) end)
  hf.save(m, out .. "/" .. name, { config = { bos_token_id = 0, eos_token_id = 0 } })
  engine.save(out .. "/" .. name .. ".logits.safetensors", { tokens = tokens, logits = logits:contiguous() })
  print(name .. ": exported")
end
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default=os.path.join(ROOT, "build", "engine"), help="the engine host")
    ap.add_argument("--keep", default=None, help="write the folders here (kept) instead of a temporary folder")
    a = ap.parse_args()

    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()

    out = a.keep or tempfile.mkdtemp(prefix="hf_export_")
    if a.keep:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
    script = os.path.join(out, "export.lua")
    with open(script, "w") as f:
        f.write(LUA)
    r = subprocess.run([a.engine, script, out], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout + r.stderr)
        sys.exit("engine export failed")

    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    ok = True
    for name in ["gpt-bias", "gpt-nobias", "llama-gqa", "llama-tied"]:
        d = os.path.join(out, name)
        ref = load_file(d + ".logits.safetensors")
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
        model.eval()
        with torch.no_grad():
            logits = model(ref["tokens"]).logits.float()
        diff = (logits - ref["logits"]).abs().max().item()
        good = diff < TOL
        ok = ok and good
        print(f"{name:11s} {type(model).__name__:17s} logits {tuple(logits.shape)} max |engine - transformers| "
              f"{diff:.3g} (max |logit| {ref['logits'].abs().max().item():.2f}) {'ok' if good else 'FAIL'}")
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
