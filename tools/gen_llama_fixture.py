#!/usr/bin/env python3
"""Generates the PyTorch parity fixtures of the Llama model (spec/fixtures/llama_{f32,f64}.safetensors).

    tools/.venv/bin/python tools/gen_llama_fixture.py      # torch 2.x (tools/install-torch.sh)

The model is torchtitan's Llama (torchtitan/models/llama/model.py) written out here: RMSNorm (torch.nn.RMSNorm),
rotary embeddings applied to q and k through view_as_complex (pairs (x[2i], x[2i+1])), grouped-query attention
with repeat_kv, F.scaled_dot_product_attention(is_causal=True), SwiGLU feed-forward w2(silu(w1 x) * w3 x), no
biases, untied output, logits cast with .float().  One difference from torchtitan, matched by the engine
(lua/engine/models.lua): the rotary angles t * theta^(-2i/head_dim) are computed in float64 and freqs_cis is
cast to the model's complex dtype (torchtitan computes them in float32).

Files (safetensors, written with tools/gen_fixtures.py's writer):
  llama_f32.safetensors: every parameter under its torchtitan name, "tokens" and "targets" (i64 [B, T]),
      "logits" (f32 [B, T, V]), "loss" (mean cross entropy), "grad.<name>" for every parameter, and
      "adamw_losses" (f32 [10]): the loss before each of 10 AdamW steps on the same batch.
  llama_f64.safetensors: the same model in float64 (parameters converted exactly): "logits", "loss", "grad.<name>".
  The configuration is in each file's __metadata__.
"""
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_fixtures import save_safetensors, load_safetensors  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "spec", "fixtures")

CONFIG = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, ffn_dim_multiplier=1.5,
              norm_eps=1e-5, rope_theta=10000.0, max_seq_len=16)
BATCH, SEQ = 2, 16
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
ADAMW_STEPS = 10
SEED = 4321


class Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def precompute_freqs_cis(dim, end, theta, dtype):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles).to(dtype)


def apply_rotary_emb(xq, xk, freqs_cis):
    seqlen = xq.shape[1]
    fc = freqs_cis[:seqlen].view(1, seqlen, 1, -1)
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    return torch.view_as_real(xq_ * fc).flatten(3).type_as(xq), torch.view_as_real(xk_ * fc).flatten(3).type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                      head_dim)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads, self.n_kv_heads = a.n_heads, a.n_kv_heads
        self.n_rep = a.n_heads // a.n_kv_heads
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, a):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a.dim, 4 * a.dim, a.multiple_of, a.ffn_dim_multiplier)
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def init_weights(self):
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=layer.weight_init_std)
        std = self.a.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens):
        dtype = torch.complex128 if self.output.weight.dtype == torch.float64 else torch.complex64
        freqs_cis = precompute_freqs_cis(self.a.dim // self.a.n_heads, 2 * self.a.max_seq_len, self.a.rope_theta,
                                         dtype)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        out = self.output(self.norm(h))
        return out if out.dtype == torch.float64 else out.float()


def build_model():
    torch.manual_seed(SEED)
    model = Transformer(Args(**CONFIG))
    model.init_weights()
    with torch.no_grad():  # norm weights moved off 1 so that their gradients are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def forward_backward(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    return logits.detach(), loss.detach()


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.set_num_threads(1)
    model = build_model().float()
    g = torch.Generator().manual_seed(SEED + 1)
    seq = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=g, dtype=torch.int64)
    tokens, targets = seq[:, :SEQ].contiguous(), seq[:, 1:].contiguous()
    params_f32 = [(k, v.clone()) for k, v in model.state_dict().items()]
    meta = dict(CONFIG)
    meta.update(batch=BATCH, seq=SEQ, seed=SEED, torch_version=torch.__version__,
                adamw_lr=ADAMW["lr"], adamw_beta1=ADAMW["betas"][0], adamw_beta2=ADAMW["betas"][1],
                adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"], adamw_steps=ADAMW_STEPS,
                rope="view_as_complex pairs, angles in float64", loss="mean cross entropy over B*T")

    model64 = build_model().double()
    model64.load_state_dict({k: v.double() for k, v in params_f32})
    logits64, loss64 = forward_backward(model64, tokens, targets)
    grads64 = [("grad." + n, p.grad.clone()) for n, p in model64.named_parameters()]

    logits, loss = forward_backward(model, tokens, targets)
    grads = [("grad." + n, p.grad.clone()) for n, p in model.named_parameters()]

    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for _ in range(ADAMW_STEPS):
        opt.zero_grad(set_to_none=True)
        lg = model(tokens)
        l = F.cross_entropy(lg.reshape(-1, lg.size(-1)), targets.reshape(-1))
        l.backward()
        opt.step()
        losses.append(l.item())
    assert losses[0] == loss.item()

    f32_entries = params_f32 + [("tokens", tokens), ("targets", targets), ("logits", logits),
                                ("loss", loss.reshape(()))] + grads + \
        [("adamw_losses", torch.tensor(losses, dtype=torch.float32))]
    f64_entries = [("logits", logits64), ("loss", loss64.reshape(()))] + grads64
    p32 = os.path.join(OUT, "llama_f32.safetensors")
    p64 = os.path.join(OUT, "llama_f64.safetensors")
    save_safetensors(p32, f32_entries, meta)
    save_safetensors(p64, f64_entries, dict(meta, dtype="f64"))
    for path, entries in ((p32, f32_entries), (p64, f64_entries)):
        back, _ = load_safetensors(path)
        assert list(back.keys()) == [n for n, _ in entries], path
        for n, t in entries:
            assert torch.equal(back[n], t.detach().contiguous()), (path, n)
    print("wrote %s (%d bytes) and %s (%d bytes)" % (p32, os.path.getsize(p32), p64, os.path.getsize(p64)))
    print("params %d, loss %.6f (f64 %.12f), adamw losses %s" % (
        sum(p.numel() for p in model.parameters()), loss.item(), loss64.item(), " ".join("%.6f" % x for x in losses)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
