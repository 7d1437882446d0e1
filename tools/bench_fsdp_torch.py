#!/usr/bin/env python3
"""PyTorch counterpart of recipes/bench/fsdp_step.lua: median ms per training step (forward + cross entropy +
backward + AdamW step + zero_grad) of the reference GPT (PyTorch's test Transformer from
torch/testing/_internal/distributed/_tensor/common_dtensor.py, or tools/gen_fixtures.py's copy of it: 4 layers,
dim 256, 4 heads, seq 128, vocab 256, fp32, dropout 0, tied output weights), global batch 8, one fixed random
batch:
  1. single process on the whole batch, torch.set_num_threads(--single_threads);
  2. FSDP2 (torch.distributed.fsdp.fully_shard on each block, then the root) on 2 processes over gloo (CPU,
     torch.set_num_threads(1) each), each process on its rows of the global batch (batch / 2);
  3. DDP (torch.nn.parallel.DistributedDataParallel) on the same 2 processes, for reference.
Collectives per step are counted with CommDebugMode on one extra FSDP step after the timed ones.

    tools/.venv/bin/python tools/bench_fsdp_torch.py [--steps=20] [--warmup=3] [--single_threads=2]
        [--reshard_after_forward=1] [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128] [--batch=8] [--vocab=256]

Needs PyTorch 2.x with torch.distributed.fsdp.fully_shard (tools/install-torch.sh puts it in tools/.venv).
Machine-readable lines: "torch_<single|fsdp|ddp>_ms median=<ms> min=<ms> max=<ms> collectives=<n> ...".
"""
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tp_torch import model_classes  # noqa: E402  (the same model as the TP benchmark)


def parse(argv):
    o = dict(steps=20, warmup=3, single_threads=2, reshard_after_forward=1, n_layers=4, dim=256, n_heads=4,
             seq=128, batch=8, vocab=256, lr=3e-4, weight_decay=0.1, seed=0, world=2)
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            sys.exit("bench_fsdp_torch: bad argument %r (expected --key=value)" % a)
        k, v = a[2:].split("=", 1)
        if k not in o:
            sys.exit("bench_fsdp_torch: unknown option --%s" % k)
        o[k] = type(o[k])(v)
    if o["batch"] % o["world"] != 0:
        sys.exit("bench_fsdp_torch: --batch=%d must be divisible by the %d processes" % (o["batch"], o["world"]))
    return o


def build(o):
    import torch
    ModelArgs, Transformer, _, src = model_classes()
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
    return model, src, seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


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
    return dict(median=med, min=times[0], max=times[-1], coll=ncoll, kinds=kinds or "n/a", loss0=losses[0],
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
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    b = o["batch"] // world
    raf = bool(o["reshard_after_forward"])
    # FSDP2: each block, then the root (the tied embedding/output weight is in the root's group)
    model, _, x, y = build(o)
    x, y = x[rank * b:(rank + 1) * b].contiguous(), y[rank * b:(rank + 1) * b].contiguous()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    dist.barrier()
    r = time_steps(o, model, x, y, count=True)
    if rank == 0:
        print(line("fsdp", r, torch.get_num_threads()), flush=True)
    del model
    dist.barrier()
    # DDP on the same rows, for reference
    model, _, _, _ = build(o)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    dist.barrier()
    r = time_steps(o, ddp, x, y)
    if rank == 0:
        print(line("ddp", r, torch.get_num_threads()), flush=True)
    del ddp, model
    dist.barrier()
    dist.destroy_process_group()


def main():
    o = parse(sys.argv[1:])
    import torch
    import torch.multiprocessing as mp
    torch.set_num_threads(o["single_threads"])
    model, src, x, y = build(o)
    blas = "MKL" if torch.backends.mkl.is_available() else "non-MKL BLAS"
    print("torch %s, model: %s, %s, %d params, global batch %d (%d per process), reshard_after_forward=%s" % (
        torch.__version__, src, blas, sum(p.numel() for p in model.parameters()), o["batch"],
        o["batch"] // o["world"], bool(o["reshard_after_forward"])), flush=True)
    r = time_steps(o, model, x, y)
    print(line("single", r, torch.get_num_threads()), flush=True)
    del model
    with socket.socket() as s:  # a free port for gloo's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(o, port, o["world"]), nprocs=o["world"], join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
