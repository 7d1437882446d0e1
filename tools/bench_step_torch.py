#!/usr/bin/python3
"""PyTorch counterpart of recipes/bench/step.lua: median ms per training step (forward + backward + AdamW)
of the reference model (common_dtensor.py's Transformer: 4 layers, dim 256, 4 heads, seq 128, batch 8, vocab 256,
fp32, dropout 0, tied output weights), fixed random batch.

    OPENBLAS_NUM_THREADS=2 /usr/bin/python3 tools/bench_step_torch.py [--steps=20] [--warmup=3]
        [--torch_threads=1] [--blas_threads=2] [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128]
        [--batch=8] [--vocab=256]

Thread settings (see shared/reference/environment.md section 7): torch.set_num_threads(1) with OpenBLAS at
2 threads is the fastest configuration on 2 cores.  OPENBLAS_NUM_THREADS is read when the library loads, so
this script sets it (from --blas_threads) before importing torch unless it is already in the environment.
The last line is machine readable: "torch_step_ms median=<ms> min=<ms> max=<ms> params=<n> loss0=<x> lossN=<x>".
"""
import os
import sys


def parse(argv):
    o = dict(steps=20, warmup=3, torch_threads=1, blas_threads=2, n_layers=4, dim=256, n_heads=4, seq=128,
             batch=8, vocab=256, lr=3e-4, weight_decay=0.1, seed=0)
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            sys.exit("bench_step_torch: bad argument %r (expected --key=value)" % a)
        k, v = a[2:].split("=", 1)
        if k not in o:
            sys.exit("bench_step_torch: unknown option --%s" % k)
        o[k] = type(o[k])(v)
    return o


def main():
    o = parse(sys.argv[1:])
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(o["blas_threads"]))
    import time
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gen_fixtures import ModelArgs, Transformer

    torch.set_num_threads(o["torch_threads"])
    torch.manual_seed(o["seed"])
    model = Transformer(ModelArgs(n_layers=o["n_layers"], vocab_size=o["vocab"], max_seq_len=o["seq"],
                                  dim=o["dim"], n_heads=o["n_heads"], dropout_p=0.0, use_attn_mask=True,
                                  weight_tying=True))
    with torch.no_grad():  # GPT-2 style embedding init (N(0,1) with tied output weights gives a loss of ~170)
        model.tok_embeddings.weight.normal_(0.0, 0.02)
        model.pos_embeddings.weight.normal_(0.0, 0.02)
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
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        dt = (time.perf_counter() - t0) * 1e3
        if i >= o["warmup"]:
            times.append(dt)
    times.sort()
    n = len(times)
    med = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
    print("torch %s, torch threads %d, OPENBLAS_NUM_THREADS=%s, OPENBLAS_CORETYPE=%s" % (
        torch.__version__, torch.get_num_threads(), os.environ.get("OPENBLAS_NUM_THREADS"),
        os.environ.get("OPENBLAS_CORETYPE", "(unset)")))
    print("torch_step_ms median=%.3f min=%.3f max=%.3f params=%d loss0=%.4f lossN=%.4f" % (
        med, times[0], times[-1], nparams, losses[0], losses[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
