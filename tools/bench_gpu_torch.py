#!/usr/bin/env python3
"""PyTorch counterpart of recipes/bench/gpu_step.lua: training-step throughput of the same
GPT-2-small-shaped model on the GPU, in eager mode and with torch.compile.

    python3 tools/bench_gpu_torch.py [--model=gpt|llama] [--steps=20] [--warmup=5] [--batch=8] [--seq=1024]
        [--n_layers=12] [--dim=768] [--n_heads=12] [--n_kv_heads=4] [--vocab=50304] [--modes=eager,compile]
        [--peak_tflops=<measured>] [--device=cuda|cpu]

The model mirrors engine.nn.Transformer (common_dtensor.py's architecture): token + learned position embeddings,
pre-LayerNorm blocks with bias-free q/k/v/o projections and causal F.scaled_dot_product_attention, a 4x MLP
with GELU (exact, or --gelu=tanh: GPT-2's, as gpu_step.lua passes), final LayerNorm, output projection tied to
the token embeddings, logits cast to float32.  --model=llama mirrors engine.nn.Llama (torchtitan's Llama): RMSNorm,
rotary positions on interleaved pairs, grouped-query attention (n_kv_heads k/v heads), SwiGLU feed-forward of
hidden size int(8 dim / 3) rounded up to 256, no biases, untied output.  --device=cpu runs the same code on the CPU
(a smoke test of the script, not a baseline).
Parameters, activations and AdamW states (fused AdamW) are bf16; dropout 0; random tokens; one step =
forward + cross entropy + backward + optimizer step + zero_grad, timed to torch.cuda.synchronize().

MFU = (6 * params + 12 * n_layers * dim * seq) * tokens/s / peak, with the peak passed in by gpu_step.lua
(the engine's measured cuBLASLt bf16 rate) or measured here with torch.matmul when not given.

Machine-readable lines:
    RESULT peak_bf16_tflops=<x>
    RESULT mode=<eager|compile> tokens_per_s=<x> step_ms=<x> mfu=<x> params=<n> loss0=<x> lossN=<x>
Without a GPU (or without torch) it prints why and exits with status 0.
"""
import argparse
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for k, v in dict(steps=20, warmup=5, batch=8, seq=1024, n_layers=12, dim=768, n_heads=12, n_kv_heads=4,
                     vocab=50304).items():
        p.add_argument("--" + k, type=int, default=v)
    p.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--peak_tflops", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gelu", default="none", choices=["none", "tanh"],
                   help="the feed-forward GELU: exact, or GPT-2's tanh approximation (the engine's gelu option)")
    return p.parse_args()


def main():
    o = parse()
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "no baseline here"
        print("bench_gpu_torch: no GPU baseline: PyTorch cannot be imported (%s)" % e)
        return 0
    if o.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_torch: no GPU: torch.cuda.is_available() is False (torch %s, built for CUDA %s)"
              % (torch.__version__, torch.version.cuda))
        return 0
    if not hasattr(F, "scaled_dot_product_attention"):
        print("bench_gpu_torch: torch %s has no F.scaled_dot_product_attention (needs torch >= 2.0)"
              % torch.__version__)
        return 1
    cuda = o.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    print("bench_gpu_torch: torch %s, CUDA %s, %s" % (torch.__version__, torch.version.cuda,
                                                       torch.cuda.get_device_name(dev) if cuda else "cpu"))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Block(nn.Module):
        def __init__(self, dim, n_heads):
            super().__init__()
            self.n_heads = n_heads
            self.attention_norm = nn.LayerNorm(dim)
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wk = nn.Linear(dim, dim, bias=False)
            self.wv = nn.Linear(dim, dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)
            self.ffn_norm = nn.LayerNorm(dim)
            self.w1 = nn.Linear(dim, 4 * dim)
            self.gelu = nn.GELU(approximate=o.gelu)
            self.w2 = nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, d = x.shape
            h = self.attention_norm(x)
            q, k, v = (w(h).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                       for w in (self.wq, self.wk, self.wv))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(a.transpose(1, 2).contiguous().view(b, t, d))
            return x + self.w2(self.gelu(self.w1(self.ffn_norm(x))))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(o.vocab, o.dim)
            self.pos_embeddings = nn.Embedding(o.seq, o.dim)
            self.layers = nn.ModuleList([Block(o.dim, o.n_heads) for _ in range(o.n_layers)])
            self.norm = nn.LayerNorm(o.dim)
            self.output = nn.Linear(o.dim, o.vocab, bias=False)
            self.output.weight = self.tok_embeddings.weight
            with torch.no_grad():
                self.tok_embeddings.weight.normal_(0.0, 0.02)
                self.pos_embeddings.weight.normal_(0.0, 0.02)

        def forward(self, tokens):
            t = tokens.shape[1]
            h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(t, device=tokens.device))
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h)).float()

    def rms_norm(dim):
        if hasattr(nn, "RMSNorm"):
            return nn.RMSNorm(dim, eps=1e-5)

        class RMSNorm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(dim))

            def forward(self, x):
                xf = x.float()
                return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight
        return RMSNorm()

    def rope(x, cos, sin):  # x [b, t, h, hd]; pairs (2i, 2i + 1) rotated by the angle of position and i
        xr = x.float().reshape(*x.shape[:-1], -1, 2)
        x0, x1 = xr[..., 0], xr[..., 1]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2).type_as(x)

    class LlamaBlock(nn.Module):
        def __init__(self):
            super().__init__()
            hd = o.dim // o.n_heads
            hidden = int(2 * 4 * o.dim / 3)
            hidden = 256 * ((hidden + 255) // 256)
            self.h, self.hkv, self.hd = o.n_heads, o.n_kv_heads, hd
            self.attention_norm = rms_norm(o.dim)
            self.wq = nn.Linear(o.dim, o.n_heads * hd, bias=False)
            self.wk = nn.Linear(o.dim, o.n_kv_heads * hd, bias=False)
            self.wv = nn.Linear(o.dim, o.n_kv_heads * hd, bias=False)
            self.wo = nn.Linear(o.n_heads * hd, o.dim, bias=False)
            self.ffn_norm = rms_norm(o.dim)
            self.w1 = nn.Linear(o.dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, o.dim, bias=False)
            self.w3 = nn.Linear(o.dim, hidden, bias=False)

        def forward(self, x, cos, sin):
            b, t, d = x.shape
            h = self.attention_norm(x)
            q = rope(self.wq(h).view(b, t, self.h, self.hd), cos, sin).transpose(1, 2)
            k = rope(self.wk(h).view(b, t, self.hkv, self.hd), cos, sin).transpose(1, 2)
            v = self.wv(h).view(b, t, self.hkv, self.hd).transpose(1, 2)
            try:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except TypeError:  # torch < 2.5
                r = self.h // self.hkv
                a = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                                                   is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(o.vocab, o.dim)
            self.layers = nn.ModuleList([LlamaBlock() for _ in range(o.n_layers)])
            self.norm = rms_norm(o.dim)
            self.output = nn.Linear(o.dim, o.vocab, bias=False)
            hd = o.dim // o.n_heads
            freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            ang = torch.outer(torch.arange(o.seq, dtype=torch.float32), freqs)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, tokens):
            t = tokens.shape[1]
            h = self.tok_embeddings(tokens)
            cos, sin = self.cos[:t].float(), self.sin[:t].float()
            for layer in self.layers:
                h = layer(h, cos, sin)
            return self.output(self.norm(h)).float()

    peak = o.peak_tflops * 1e12
    if peak <= 0:
        n = 8192 if cuda else 256
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        for trial in range(4):
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                a @ b
            sync()
            dt = time.perf_counter() - t0
            if trial > 0:
                peak = max(peak, 2 * n ** 3 * 10 / dt)
        del a, b
    print("RESULT peak_bf16_tflops=%.3f" % (peak / 1e12))

    tokens = o.batch * o.seq
    for mode in [m for m in o.modes.split(",") if m]:
        if mode not in ("eager", "compile"):
            print("bench_gpu_torch: unknown mode %r (eager, compile)" % mode)
            return 1
        torch.manual_seed(o.seed)
        model = (Transformer() if o.model == "gpt" else Llama()).to(dev, dtype=torch.bfloat16).train()
        nparams = sum(p.numel() for p in model.parameters())
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                                    fused=True)
        except (TypeError, RuntimeError):
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
        run = torch.compile(model) if mode == "compile" else model
        g = torch.Generator(device="cpu").manual_seed(o.seed)
        seq = torch.randint(0, o.vocab, (o.batch, o.seq + 1), generator=g).to(dev)
        x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        warmup = o.warmup + (3 if mode == "compile" else 0)
        times, loss0, lossn = [], None, None
        for i in range(warmup + o.steps):
            sync()
            t0 = time.perf_counter()
            logits = run(x)
            loss = F.cross_entropy(logits.view(-1, o.vocab), y.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            dt = time.perf_counter() - t0
            if i == 0:
                loss0 = loss.item()
            if i == warmup + o.steps - 1:
                lossn = loss.item()
            if i >= warmup:
                times.append(dt)
        times.sort()
        k = len(times)
        med = times[k // 2] if k % 2 else 0.5 * (times[k // 2 - 1] + times[k // 2])
        tps = tokens / med
        flops_per_token = 6 * nparams + 12 * o.n_layers * o.dim * o.seq
        mfu = flops_per_token * tps / peak
        print("RESULT mode=%s tokens_per_s=%.1f step_ms=%.3f mfu=%.4f params=%d loss0=%.4f lossN=%.4f "
              "peak_mem_gib=%.2f" % (mode, tps, med * 1e3, mfu, nparams, loss0, lossn,
                                     torch.cuda.max_memory_allocated(dev) / 2 ** 30 if cuda else 0.0))
        del model, opt, run
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
