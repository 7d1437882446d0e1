#!/usr/bin/python3
"""Generates the PyTorch parity fixtures in spec/fixtures/ (committed).

    /usr/bin/python3 tools/gen_fixtures.py        # Debian's torch 1.13 (tools/install-deps.sh --torch)

The model is PyTorch's toy test Transformer (common_dtensor.py: ModelArgs, Attention, FeedForward with GELU,
pre-LN TransformerBlock, learned position embeddings, weight tying) in a small configuration with
dropout 0.  torch 1.13 has no F.scaled_dot_product_attention, so attention is written out with the same
math: softmax(Q K^T / sqrt(head_dim) + causal mask) V.

Files (safetensors, written here with struct + json so that the `safetensors` package is not needed):
  spec/fixtures/transformer_f32.safetensors
      every entry of model.state_dict() under its PyTorch name (output.weight is tied to
      tok_embeddings.weight and stored too, as state_dict() does), "tokens" and "targets" (i64 [B, T]),
      "logits" (f32 [B, T, V]), "loss" (f32 scalar, mean cross entropy), "grad.<name>" for every
      parameter of model.named_parameters() (tied weights appear once, under tok_embeddings.weight),
      and "adamw_losses" (f32 [10]): the loss at each of 10 AdamW steps on the same batch
      (lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight_decay 0.1); losses[i] is computed before step i's
      update, so losses[1] == loss.
  spec/fixtures/transformer_f64.safetensors
      the same model in float64 (parameters are the f32 ones, converted exactly): "logits", "loss"
      and "grad.<name>" in f64 (parameters, tokens and targets come from the f32 file).
  The model configuration is in each file's __metadata__ (string values).
"""
import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "spec", "fixtures")

CONFIG = dict(n_layers=2, vocab_size=64, max_seq_len=16, dim=32, n_heads=4, dropout_p=0.0,
              use_attn_mask=True, weight_tying=True)
BATCH, SEQ = 2, 16
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
ADAMW_STEPS = 10
SEED = 1234


class ModelArgs:
    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        assert args.dim % args.n_heads == 0
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.use_attn_mask = args.use_attn_mask
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        # F.scaled_dot_product_attention(q, k, v, None, 0, is_causal=use_attn_mask), spelled out
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if self.use_attn_mask:
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).contiguous().view(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        _bsz, seq_len = tokens.size()
        assert seq_len <= self.max_seq_len
        h = self.tok_embeddings(tokens)
        h = h + self.pos_embeddings(torch.arange(0, seq_len))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # the seed's .float() is a no-op for f32 and dropped for f64


def build_model():
    torch.manual_seed(SEED)
    model = Transformer(ModelArgs(**CONFIG))
    with torch.no_grad():
        # Default init, then: embeddings scaled to std 0.2 (std 1 with tied output weights gives very peaked
        # softmaxes), and LayerNorm affine parameters moved off 1/0 so their gradients are exercised.
        model.tok_embeddings.weight.mul_(0.2)
        model.pos_embeddings.weight.mul_(0.2)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------- safetensors writer
_DT = {torch.float32: ("F32", "<f4"), torch.float64: ("F64", "<f8"), torch.int64: ("I64", "<i8"),
       torch.int32: ("I32", "<i4")}


def save_safetensors(path, tensors, metadata):
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    blobs, offset = [], 0
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        code, _ = _DT[t.dtype]
        raw = t.numpy().tobytes()  # little-endian on x86
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    """Reader used to verify what was written."""
    import numpy as np
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    rev = {v[0]: v[1] for v in _DT.values()}
    for name, info in header.items():
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[8 + n + a:8 + n + b], dtype=rev[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out, meta


# ---------------------------------------------------------------- reference computations
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
    model.train()  # dropout_p is 0: train and eval agree
    g = torch.Generator().manual_seed(SEED + 1)
    seq = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=g, dtype=torch.int64)
    tokens, targets = seq[:, :SEQ].contiguous(), seq[:, 1:].contiguous()

    params_f32 = [(k, v.clone()) for k, v in model.state_dict().items()]
    meta = dict(CONFIG)
    meta.update(batch=BATCH, seq=SEQ, seed=SEED, torch_version=torch.__version__,
                adamw_lr=ADAMW["lr"], adamw_beta1=ADAMW["betas"][0], adamw_beta2=ADAMW["betas"][1],
                adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"], adamw_steps=ADAMW_STEPS,
                attention="softmax(QK^T/sqrt(head_dim) + causal mask) V", layer_norm_eps=1e-5,
                gelu="exact (erf)", loss="mean cross entropy over B*T")

    # f64 reference with exactly the same parameters (before any optimizer step)
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
                                ("loss", loss.reshape(())), ] + grads + \
                  [("adamw_losses", torch.tensor(losses, dtype=torch.float32))]
    f64_entries = [("logits", logits64), ("loss", loss64.reshape(()))] + grads64
    p32 = os.path.join(OUT, "transformer_f32.safetensors")
    p64 = os.path.join(OUT, "transformer_f64.safetensors")
    save_safetensors(p32, f32_entries, meta)
    save_safetensors(p64, f64_entries, dict(meta, dtype="f64"))

    # read back and verify
    for path, entries in ((p32, f32_entries), (p64, f64_entries)):
        back, _ = load_safetensors(path)
        assert list(back.keys()) == [n for n, _ in entries], path
        for n, t in entries:
            assert torch.equal(back[n], t.detach().contiguous()), (path, n)
    nparams = sum(p.numel() for p in model.parameters())
    print("wrote %s (%d bytes) and %s (%d bytes)" % (p32, os.path.getsize(p32), p64, os.path.getsize(p64)))
    print("params %d, loss %.6f (f64 %.12f), adamw losses %s" % (nparams, loss.item(), loss64.item(),
                                                                 " ".join("%.6f" % x for x in losses)))
    print("max |logits32 - logits64| = %.3g" % (logits.double() - logits64).abs().max().item())
    return 0


if __name__ == "__main__":
    sys.exit(main())
