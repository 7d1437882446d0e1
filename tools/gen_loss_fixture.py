#!/usr/bin/env python3
"""PyTorch reference values for the other losses and activations of torch.nn.functional
(engine.ops.loss), written as a Lua table to spec/fixtures/losses.lua (committed).

    tools/.venv/bin/python tools/gen_loss_fixture.py      # torch 2.x (tools/install-torch.sh)
    /usr/bin/python3 tools/gen_loss_fixture.py            # or Debian's torch 1.13

Every case holds its inputs (float64 values, written with 17 significant digits, so the
engine reads exactly the same numbers), PyTorch's output and the gradient of
sum(output * r) with respect to the first input (r: 0.1 * (1 + k % 7) for the k-th output
element), all in float64.  spec/loss_ext_spec.lua replays them.
"""
import os
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D = torch.float64


def lua(v):
    if isinstance(v, torch.Tensor):
        if v.dim() == 0:
            return lua(v.item())
        return "{" + ", ".join(lua(x) for x in v) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "0/0"
        if v in (float("inf"), float("-inf")):
            return "math.huge" if v > 0 else "-math.huge"
        return repr(float("%.17g" % v))
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, dict):
        return "{" + ", ".join("%s = %s" % (k, lua(x)) for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "{" + ", ".join(lua(x) for x in v) + "}"
    raise TypeError(type(v))


cases = []


def case(name, fn, x, others, opts, lua_opts=None):
    x = x.clone().to(D).requires_grad_(True)
    out = fn(x, *others, **opts)
    r = (0.1 * (1 + torch.arange(out.numel(), dtype=D) % 7)).reshape(out.shape)
    (out * r).sum().backward()
    enc_others = []
    for o in others:
        enc_others.append({"shape": list(o.shape), "dtype": "i64" if not o.is_floating_point() else "f64",
                           "values": o.reshape(-1)})
    lo = dict(lua_opts if lua_opts is not None else {})
    cases.append({"name": name, "x_shape": list(x.shape), "x": x.detach().reshape(-1), "others": enc_others,
                  "opts": lo, "out_shape": list(out.shape), "out": out.detach().reshape(-1),
                  "grad": x.grad.reshape(-1)})


logits = torch.randn(5, 4, dtype=D)
logp = F.log_softmax(logits, 1)
tgt = torch.tensor([0, 3, -100, 2, 1])
w = torch.tensor([0.5, 1.0, 2.0, 0.25], dtype=D)
for red in ("mean", "sum", "none"):
    case("nll_loss " + red, lambda x, t, **o: F.nll_loss(x, t, **o), logp, [tgt], {"reduction": red},
         {"reduction": red})
    case("nll_loss weight " + red, lambda x, t, ww, **o: F.nll_loss(x, t, weight=ww, **o), logp, [tgt, w],
         {"reduction": red}, {"reduction": red, "weight": 2})
    case("cross_entropy weight smoothing " + red,
         lambda x, t, ww, **o: F.cross_entropy(x, t, weight=ww, label_smoothing=0.2, **o), logits, [tgt, w],
         {"reduction": red}, {"reduction": red, "weight": 2, "label_smoothing": 0.2})
    case("cross_entropy smoothing " + red, lambda x, t, **o: F.cross_entropy(x, t, label_smoothing=0.1, **o),
         logits, [tgt], {"reduction": red}, {"reduction": red, "label_smoothing": 0.1})
lg3 = torch.randn(2, 3, 4, dtype=D)
t3 = torch.tensor([[0, 2, 1, 1], [2, 2, 0, -100]])
case("nll_loss 3d weight", lambda x, t, ww: F.nll_loss(F.log_softmax(x, 1), t, weight=ww), lg3,
     [t3, w[:3].clone()], {}, {"log_softmax": 2, "weight": 2})
case("cross_entropy 3d weight ignore 1", lambda x, t, ww: F.cross_entropy(x, t, weight=ww, ignore_index=1),
     lg3, [t3.clamp(min=0), w[:3].clone()], {}, {"weight": 2, "ignore_index": 1})
probs = F.softmax(torch.randn(5, 4, dtype=D), 1)
case("cross_entropy probabilities weight smoothing",
     lambda x, t, ww: F.cross_entropy(x, t, weight=ww, label_smoothing=0.3), logits, [probs, w], {},
     {"weight": 2, "label_smoothing": 0.3})
p = torch.rand(3, 4, dtype=D) * 0.9 + 0.05
y = (torch.rand(3, 4, dtype=D) > 0.5).to(D)
bw = torch.rand(3, 4, dtype=D)
for red in ("mean", "sum", "none"):
    case("binary_cross_entropy " + red, lambda x, t, **o: F.binary_cross_entropy(x, t, **o), p, [y],
         {"reduction": red}, {"reduction": red})
case("binary_cross_entropy weight", lambda x, t, ww: F.binary_cross_entropy(x, t, weight=ww), p, [y, bw], {},
     {"weight": 2})
z = torch.randn(3, 4, dtype=D) * 3
pw = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=D)
case("bce_with_logits", lambda x, t: F.binary_cross_entropy_with_logits(x, t), z, [y], {}, {})
case("bce_with_logits weight pos_weight sum",
     lambda x, t, ww, pp: F.binary_cross_entropy_with_logits(x, t, weight=ww, pos_weight=pp, reduction="sum"),
     z, [y, bw, pw], {}, {"weight": 2, "pos_weight": 3, "reduction": "sum"})
inp = F.log_softmax(torch.randn(3, 4, dtype=D), 1)
tp = F.softmax(torch.randn(3, 4, dtype=D), 1)
tp[0, 1] = 0.0
for red in ("mean", "batchmean", "sum", "none"):
    case("kl_div " + red, lambda x, t, **o: F.kl_div(x, t, **o), inp, [tp], {"reduction": red}, {"reduction": red})
case("kl_div log_target", lambda x, t: F.kl_div(x, t, reduction="batchmean", log_target=True), inp,
     [F.log_softmax(torch.randn(3, 4, dtype=D), 1)], {}, {"reduction": "batchmean", "log_target": True})
a = torch.randn(3, 5, dtype=D) * 2
b = torch.randn(3, 5, dtype=D)
case("smooth_l1_loss", lambda x, t: F.smooth_l1_loss(x, t), a, [b], {}, {})
case("smooth_l1_loss beta 0.5 none", lambda x, t: F.smooth_l1_loss(x, t, beta=0.5, reduction="none"), a, [b], {},
     {"beta": 0.5, "reduction": "none"})
case("huber_loss delta 0.7 sum", lambda x, t: F.huber_loss(x, t, delta=0.7, reduction="sum"), a, [b], {},
     {"delta": 0.7, "reduction": "sum"})
act = torch.randn(4, 6, dtype=D) * 3
case("softplus", lambda x: F.softplus(x), act, [], {}, {})
case("softplus beta 2 threshold 3", lambda x: F.softplus(x, beta=2, threshold=3), act, [], {},
     {"beta": 2, "threshold": 3})
case("leaky_relu 0.1", lambda x: F.leaky_relu(x, 0.1), act, [], {}, {"negative_slope": 0.1})
case("elu 0.5", lambda x: F.elu(x, 0.5), act, [], {}, {"alpha": 0.5})
case("hardtanh -0.5 0.8", lambda x: F.hardtanh(x, -0.5, 0.8), act, [], {}, {"min_val": -0.5, "max_val": 0.8})
case("glu", lambda x: F.glu(x), act, [], {}, {})
case("glu dim 1", lambda x: F.glu(x, 0), act, [], {}, {"dim": 1})

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec", "fixtures", "losses.lua")
with open(path, "w") as f:
    f.write("-- generated by tools/gen_loss_fixture.py (torch %s): PyTorch reference values for\n"
            "-- spec/loss_ext_spec.lua; do not edit.\nreturn {\n" % torch.__version__)
    for c in cases:
        f.write("  " + lua(c) + ",\n")
    f.write("}\n")
print("wrote", path, len(cases), "cases")
