#!/usr/bin/env python3
"""PyTorch counterpart of recipes/bench/tp_step.lua: median ms per training step (forward + cross entropy +
backward + AdamW step + zero_grad) of the reference GPT (PyTorch's test Transformer from
torch/testing/_internal/distributed/_tensor/common_dtensor.py: 4 layers, dim 256, 4 heads, seq 128, batch 8,
vocab 256, fp32, dropout 0, tied output weights), one fixed random batch:
  1. single process, torch.set_num_threads(--single_threads);
  2. tensor parallel on 2 processes (gloo, CPU, torch.set_num_threads(1) each) with the test model's own plan,
     Transformer.parallelize(model, mesh, use_seq_parallel=False, local_output_for_attn=True);
  3. the same with use_seq_parallel=True.
local_output_for_attn is always True here: on CPU PyTorch's DTensor has no sharding strategy for
aten._scaled_dot_product_flash_attention_for_cpu (NotImplementedError), so attention must run on the local
heads; --local_attn is accepted for symmetry with the recipe and only 1 is valid.
Collectives per step are counted with CommDebugMode on one extra step after the timed ones (CommDebugMode
intercepts every op, so it is kept out of the timings).

    tools/.venv/bin/python tools/bench_tp_torch.py [--steps=20] [--warmup=3] [--single_threads=2]
        [--local_attn=0] [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--vocab=256]

Needs PyTorch 2.x (tools/install-torch.sh puts it in tools/.venv) and expecttest (imported by PyTorch's
testing helpers; without it the plan below, a copy of common_dtensor's, is applied to tools/gen_fixtures.py's
Transformer).  Machine-readable lines: "torch_<single|tp|tpsp>_ms median=<ms> min=<ms> max=<ms>
collectives=<n> ...".
"""
import os
import socket
import sys


def parse(argv):
    o = dict(steps=20, warmup=3, single_threads=2, local_attn=0, n_layers=4, dim=256, n_heads=4, seq=128,
             batch=8, vocab=256, lr=3e-4, weight_decay=0.1, seed=0)
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            sys.exit("bench_tp_torch: bad argument %r (expected --key=value)" % a)
        k, v = a[2:].split("=", 1)
        if k not in o:
            sys.exit("bench_tp_torch: unknown option --%s" % k)
        o[k] = type(o[k])(v)
    return o


def model_classes():
    """(ModelArgs, Transformer, parallelize, source): PyTorch's test model, or the fixture copy + its plan."""
    try:
        from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
        return ModelArgs, Transformer, Transformer.parallelize, "torch common_dtensor.Transformer"
    except Exception as e:  # expecttest missing, or the helpers moved
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gen_fixtures import ModelArgs, Transformer
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        def parallelize(module, mesh, use_seq_parallel, local_output_for_attn=False):
            # common_dtensor.Transformer.parallelize (PyTorch 2.x), copied
            if use_seq_parallel:
                root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
                        "norm": SequenceParallel()}
            else:
                root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
            parallelize_module(module, mesh, root)
            for layer in module.layers:
                plan = {}
                if use_seq_parallel:
                    plan["attention"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
                    plan["attention_norm"] = SequenceParallel()
                    plan["ffn_norm"] = SequenceParallel()
                for n in ("wq", "wk", "wv"):
                    plan["attention." + n] = ColwiseParallel(use_local_output=local_output_for_attn)
                plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1)) if use_seq_parallel else RowwiseParallel()
                plan["feed_forward.w1"] = (ColwiseParallel(input_layouts=Shard(1)) if use_seq_parallel
                                           else ColwiseParallel())
                plan["feed_forward.w2"] = (RowwiseParallel(output_layouts=Shard(1)) if use_seq_parallel
                                           else RowwiseParallel())
                parallelize_module(layer, mesh, plan)
            parallelize_module(module.output, mesh,
                               ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()) if use_seq_parallel
                               else ColwiseParallel(output_layouts=Replicate()))
            if local_output_for_attn:
                for layer in module.layers:
                    layer.attention.n_heads = module.model_args.n_heads // mesh.size()
            if module.model_args.weight_tying:
                module.output.weight = module.tok_embeddings.weight
            return module

        return ModelArgs, Transformer, parallelize, "tools/gen_fixtures.py Transformer (%s)" % type(e).__name__


def build(o):
    import torch
    ModelArgs, Transformer, parallelize, src = model_classes()
    torch.manual_seed(o["seed"])
    model = Transformer(ModelArgs(n_layers=o["n_layers"], vocab_size=o["vocab"], max_seq_len=o["seq"],
                                  dim=o["dim"], n_heads=o["n_heads"], dropout_p=0.0, use_attn_mask=True,
                                  weight_tying=True))
    with torch.no_grad():  # GPT-2 style embedding init, as tools/bench_step_torch.py
        model.tok_embeddings.weight.normal_(0.0, 0.02)
        model.pos_embeddings.weight.normal_(0.0, 0.02)
    model.train()
    g = torch.Generator().manual_seed(o["seed"] + 1)
    seq = torch.randint(0, o["vocab"], (o["batch"], o["seq"] + 1), generator=g)
    return model, parallelize, src, seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def time_steps(o, model, x, y, count=False):
    import time
    import torch
    import torch.nn.functional as F
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=o["weight_decay"])

    def step():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, o["vocab"]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for i in range(o["warmup"] + o["steps"]):
        t0 = time.perf_counter()
        loss = step()
        losses.append(loss.item())
        dt = (time.perf_counter() - t0) * 1e3
        if i >= o["warmup"]:
            times.append(dt)
    ncoll, kinds = 0, ""
    if count:
        from torch.distributed.tensor.debug import CommDebugMode
        mode = CommDebugMode()
        with mode:
            step()
        ncoll = mode.get_total_counts()
        kinds = " ".join("%s=%d" % (getattr(k, "__name__", str(k)).split(".")[-1], v)
                         for k, v in sorted(mode.get_comm_counts().items(), key=lambda kv: str(kv[0])))
    times.sort()
    n = len(times)
    med = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
    return dict(median=med, min=times[0], max=times[-1], coll=ncoll, kinds=kinds or "none", loss0=losses[0],
                lossN=losses[-1])


def line(name, r, threads):
    return ("torch_%s_ms median=%.3f min=%.3f max=%.3f collectives=%d threads=%d loss0=%.4f lossN=%.4f (%s)" % (
        name, r["median"], r["min"], r["max"], r["coll"], threads, r["loss0"], r["lossN"], r["kinds"]))


def worker(rank, o, port, world):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for name, sp in (("tp", False), ("tpsp", True)):
        model, parallelize, _, x, y = build(o)
        parallelize(model, mesh, sp, o["local_attn"] != 0)
        dist.barrier()
        r = time_steps(o, model, x, y, count=True)
        if rank == 0:
            print(line(name, r, torch.get_num_threads()), flush=True)
        del model
        dist.barrier()
    dist.destroy_process_group()


def main():
    o = parse(sys.argv[1:])
    if o["local_attn"] == 0:
        sys.exit("bench_tp_torch: --local_attn=0 is not runnable on CPU (no DTensor strategy for CPU SDPA)")
    import torch
    import torch.multiprocessing as mp
    torch.set_num_threads(o["single_threads"])
    model, _, src, x, y = build(o)
    blas = "MKL" if torch.backends.mkl.is_available() else "non-MKL BLAS"
    print("torch %s, model: %s, %s, %d params, local_output_for_attn=True" % (
        torch.__version__, src, blas, sum(p.numel() for p in model.parameters())), flush=True)
    r = time_steps(o, model, x, y)
    print(line("single", r, torch.get_num_threads()), flush=True)
    del model
    with socket.socket() as s:  # a free port for gloo's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(o, port, 2), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
