#!/usr/bin/env python3
"""PyTorch counterpart of `recipes/bench/step.lua --model=llama`: median ms per training step (forward + cross
entropy + backward + AdamW + zero_grad) of the Llama of tools/gen_llama_fixture.py (torchtitan's model) at the
issue's reference size (4 layers, dim 256, 4 heads, 2 kv heads, seq 128, batch 8, vocab 256, fp32), fixed random
batch.  Needs torch 2.x (nn.RMSNorm, F.scaled_dot_product_attention): tools/.venv/bin/python.

    tools/.venv/bin/python tools/bench_llama_torch.py [--steps=20] [--warmup=3] [--threads=2] [--n_layers=4]
        [--dim=256] [--n_heads=4] [--n_kv_heads=2] [--seq=128] [--batch=8] [--vocab=256] [--multiple_of=256]

The last line is machine readable: "torch_step_ms median=<ms> min=<ms> max=<ms> params=<n> loss0=<x> lossN=<x>".
"""
import os
import sys


def parse(argv):
    o = dict(steps=20, warmup=3, threads=2, n_layers=4, dim=256, n_heads=4, n_kv_heads=2, seq=128, batch=8,
             vocab=256, multiple_of=256, lr=3e-4, weight_decay=0.1, seed=0)
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            sys.exit("bench_llama_torch: bad argument %r (expected --key=value)" % a)
        k, v = a[2:].split("=", 1)
        if k not in o:
            sys.exit("bench_llama_torch: unknown option --%s" % k)
        o[k] = type(o[k])(v)
    return o


def main():
    o = parse(sys.argv[1:])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(o["threads"]))
    import time
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gen_llama_fixture import Args, Transformer

    torch.set_num_threads(o["threads"])
    torch.manual_seed(o["seed"])
    model = Transformer(Args(dim=o["dim"], n_layers=o["n_layers"], n_heads=o["n_heads"], n_kv_heads=o["n_kv_heads"],
                             vocab_size=o["vocab"], multiple_of=o["multiple_of"], ffn_dim_multiplier=None,
                             norm_eps=1e-5, rope_theta=10000.0, max_seq_len=o["seq"]))
    model.init_weights()
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=o["weight_decay"])
    g = torch.Generator().manual_seed(o["seed"])
    seq = torch.randint(0, o["vocab"], (o["batch"], o["seq"] + 1), generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    times, losses = [], []
    for i in range(o["warmup"] + o["steps"]):
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, o["vocab"]), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        dt = (time.perf_counter() - t0) * 1e3
        if i >= o["warmup"]:
            times.append(dt)
    times.sort()
    n = len(times)
    med = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
    print("torch %s, %d threads (%s)" % (torch.__version__, torch.get_num_threads(),
                                         "MKL" if torch.backends.mkl.is_available() else "BLAS"))
    print("torch_step_ms median=%.3f min=%.3f max=%.3f params=%d loss0=%.4f lossN=%.4f" % (
        med, times[0], times[-1], nparams, losses[0], losses[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
