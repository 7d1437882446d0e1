#!/usr/bin/env python3
"""PyTorch counterpart of recipes/bench/gpt_2d_step.lua: median ms per training step (forward + cross entropy +
backward + AdamW step + zero_grad) of the reference GPT (PyTorch's test Transformer from
torch/testing/_internal/distributed/_tensor/common_dtensor.py, or tools/gen_fixtures.py's copy with the same plan:
4 layers, dim 256, 4 heads, seq 128, vocab 256, fp32, dropout 0, tied output weights), global batch 8, one fixed
random batch, on 4 processes over gloo (CPU, torch.set_num_threads(--threads) each):
  2d:   2-D parallelism as PyTorch documents it: init_device_mesh("cpu", (2, 2), ("dp", "tp")),
        Transformer.parallelize(model, mesh["tp"], use_seq_parallel=--sp, local_output_for_attn=True), then
        torch.distributed.fsdp.fully_shard on each block and the root with mesh=mesh["dp"]; each dp row on its
        batch / 2 rows (the tp ranks of a row the same rows);
  fsdp: FSDP2 (fully_shard on each block and the root) on a 1-D mesh of the 4 processes, each on batch / 4 rows;
  tp:   Transformer.parallelize on a 1-D mesh of the 4 processes, every process on the whole batch.
local_output_for_attn is always True (on CPU PyTorch's DTensor has no sharding strategy for
aten._scaled_dot_product_flash_attention_for_cpu); --local_attn is accepted for symmetry and only 1 is valid.
--runs runs, each timing every part (interleaved) for --warmup + --steps steps; a part's figure is the median over
runs of its median ms/step.  Collectives per step are counted with CommDebugMode on one extra step of the first
run (kept out of the timings).  cpu: the CPU time of a timed step (time.process_time: all threads of a process)
summed over the 4 processes, the counterpart of the engine bench's figure.

    tools/.venv/bin/python tools/bench_2d_torch.py [--runs=3] [--steps=20] [--warmup=3] [--parts=2d,fsdp,tp]
        [--sp=0] [--reshard_after_forward=1] [--threads=1] [--n_layers=4] [--dim=256] [--n_heads=4] [--seq=128]
        [--batch=8] [--vocab=256]

Needs PyTorch 2.x with torch.distributed.fsdp.fully_shard (tools/install-torch.sh puts it in tools/.venv).
Machine-readable lines: "torch_<2d|fsdp|tp>_ms run=<r> median=<ms> ..." per run and
"torch_<2d|fsdp|tp>_ms runs_median=<ms> cpu_runs_median=<ms> runs=<n>" at the end.
"""
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tp_torch import model_classes  # noqa: E402  (the same model and plan as the TP benchmark)

WORLD, DP, TP = 4, 2, 2


def parse(argv):
    o = dict(runs=3, steps=20, warmup=3, parts="2d,fsdp,tp", local_attn=1, sp=0, reshard_after_forward=1, threads=1,
             n_layers=4, dim=256, n_heads=4, seq=128, batch=8, vocab=256, lr=3e-4, weight_decay=0.1, seed=0)
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            sys.exit("bench_2d_torch: bad argument %r (expected --key=value)" % a)
        k, v = a[2:].split("=", 1)
        if k not in o:
            sys.exit("bench_2d_torch: unknown option --%s" % k)
        o[k] = type(o[k])(v)
    if o["local_attn"] == 0:
        sys.exit("bench_2d_torch: --local_attn=0 is not runnable on CPU (no DTensor strategy for CPU SDPA)")
    if o["batch"] % WORLD != 0:
        sys.exit("bench_2d_torch: --batch=%d must be divisible by %d" % (o["batch"], WORLD))
    for p in o["parts"].split(","):
        if p not in ("2d", "fsdp", "tp"):
            sys.exit("bench_2d_torch: --parts: unknown part %r (2d, fsdp, tp)" % p)
    return o


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
    cpu0 = 0.0
    for i in range(o["warmup"] + o["steps"]):
        if i == o["warmup"]:
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        loss = step()
        losses.append(loss.item())
        dt = (time.perf_counter() - t0) * 1e3
        if i >= o["warmup"]:
            times.append(dt)
    cpu = (time.process_time() - cpu0) * 1e3 / o["steps"]
    ncoll, kinds = -1, "not counted"
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
    return dict(median=med, min=times[0], max=times[-1], cpu=cpu, coll=ncoll, kinds=kinds or "none", loss0=losses[0],
                lossN=losses[-1])


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def worker(rank, o, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import warnings
    # FSDP2's note that the root returns a view (the test model's float() of f32 logits): no in-place op follows
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(o["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh2 = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    mesh1 = init_device_mesh("cpu", (WORLD,))
    raf = bool(o["reshard_after_forward"])
    sp = bool(o["sp"])

    def setup(part):
        model, parallelize, _, x, y = build(o)
        if part == "2d":
            parallelize(model, mesh2["tp"], sp, True)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh2["dp"], reshard_after_forward=raf)
            fully_shard(model, mesh=mesh2["dp"], reshard_after_forward=raf)
            b, r = o["batch"] // DP, mesh2.get_local_rank("dp")
        elif part == "fsdp":
            for layer in model.layers:
                fully_shard(layer, mesh=mesh1, reshard_after_forward=raf)
            fully_shard(model, mesh=mesh1, reshard_after_forward=raf)
            b, r = o["batch"] // WORLD, rank
        else:
            parallelize(model, mesh1, sp, True)
            b, r = o["batch"], 0
        return model, x[r * b:(r + 1) * b].contiguous(), y[r * b:(r + 1) * b].contiguous()

    parts = o["parts"].split(",")
    per = {p: [] for p in parts}
    per_cpu = {p: [] for p in parts}
    for run in range(1, o["runs"] + 1):
        for p in parts:
            model, x, y = setup(p)
            dist.barrier()
            r = time_steps(o, model, x, y, count=(run == 1))
            per[p].append(r["median"])
            cpu = torch.tensor([r["cpu"]], dtype=torch.float64)  # CPU ms per step summed over the processes
            dist.all_reduce(cpu)
            per_cpu[p].append(cpu.item())
            if rank == 0:
                print("torch_%s_ms run=%d median=%.3f min=%.3f max=%.3f cpu=%.3f collectives=%d threads=%d loss0=%.4f "
                      "lossN=%.4f (%s)" % (p, run, r["median"], r["min"], r["max"], cpu.item(), r["coll"],
                                          torch.get_num_threads(), r["loss0"], r["lossN"], r["kinds"]), flush=True)
            del model
            dist.barrier()
    if rank == 0:
        for p in parts:
            print("torch_%s_ms runs_median=%.3f cpu_runs_median=%.3f runs=%d" % (p, median(per[p]), median(per_cpu[p]),
                                                                                len(per[p])), flush=True)
    dist.destroy_process_group()


def main():
    o = parse(sys.argv[1:])
    import torch
    import torch.multiprocessing as mp
    model, _, src, _, _ = build(o)
    blas = "MKL" if torch.backends.mkl.is_available() else "non-MKL BLAS"
    print("torch %s, model: %s, %s, %d params, %d processes (2-D mesh (%d, %d)), global batch %d, "
          "reshard_after_forward=%s, sp=%s, local_output_for_attn=True" % (
              torch.__version__, src, blas, sum(p.numel() for p in model.parameters()), WORLD, DP, TP, o["batch"],
              bool(o["reshard_after_forward"]), bool(o["sp"])), flush=True)
    del model
    with socket.socket() as s:  # a free port for gloo's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(o, port), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
