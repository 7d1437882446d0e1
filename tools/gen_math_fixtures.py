"""PyTorch reference values for the tricky cases of the math/reduction/sort ops
(torch's pointwise math, reductions, scans and sorts): round half to even, fmod/remainder/floor_divide signs,
var/std correction, sort/argsort/topk/kthvalue ties and NaN, logsumexp with
infinities, norms, scans, and gradients of prod/cumprod with zeros, amax ties,
norm at zero.  Writes spec/fixtures/math_ops.lua (a Lua table) read by
spec/math_ops_spec.lua.

    tools/.venv/bin/python tools/gen_math_fixtures.py
"""
import math
import os
import torch

torch.set_default_dtype(torch.float64)
NAN, INF = float("nan"), float("inf")


def lua(v):
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "0/0"
        if math.isinf(v):
            return "1/0" if v > 0 else "-1/0"
        return repr(v)
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, (list, tuple)):
        return "{" + ", ".join(lua(x) for x in v) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {lua(x)}" for k, x in v.items()) + "}"
    if v is None:
        return "nil"
    raise TypeError(type(v))


cases = []


def add(**kw):
    cases.append(kw)


# --- pointwise
r = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -0.0, 0.49999999999999994, NAN, INF, -INF])
add(op="round", x=r, out=torch.round(r))
r2 = torch.tensor([0.125, 0.375, 1.005, -2.675, 1234.5, 1250.0, 1350.0])
add(op="round", x=r2, decimals=2, out=torch.round(r2, decimals=2))
add(op="round", x=r2, decimals=-2, out=torch.round(r2, decimals=-2))
s = torch.tensor([-2.0, -0.0, 0.0, 3.0, NAN, INF, -INF])
add(op="sign", x=s, out=torch.sign(s))
for f in ["sin", "cos", "floor", "ceil", "trunc", "erf", "log1p", "expm1", "reciprocal", "square"]:
    x = torch.tensor([-3.7, -1.0, -0.5, -0.0, 0.0, 0.3, 1.0, 2.5, 10.0, NAN, INF, -INF])
    add(op=f, x=x, out=getattr(torch, f)(x))
x = torch.tensor([1.0, NAN, INF, -INF, -0.0])
add(op="nan_to_num", x=x, out=torch.nan_to_num(x))
add(op="nan_to_num", x=x, nan=2.0, posinf=3.0, neginf=-4.0, out=torch.nan_to_num(x, 2.0, 3.0, -4.0))
add(op="nan_to_num_f32", x=x, out=torch.nan_to_num(x.float()).double())
la = torch.tensor([0.1, -3.3, 7.7, 1e-3, 123.456], dtype=torch.float32)
lb = torch.tensor([2.9, 4.1, -0.3, 5e3, 0.001], dtype=torch.float32)
for w in [0.3, 0.75, 0.5, -0.6, 1.7]:
    add(op="lerp_f32", a=la.double(), b=lb.double(), w=w, out=torch.lerp(la, lb, w).double())
a = torch.tensor([5.0, -5.0, 5.0, -5.0, 5.5, -5.5, 0.0, -0.0, 1.0, -1.0, 1.0, INF, 3.0])
b = torch.tensor([3.0, 3.0, -3.0, -3.0, 2.0, 2.0, -2.0, 2.0, 0.0, 0.0, 0.0, 2.0, INF])
for f in ["fmod", "remainder", "floor_divide"]:
    add(op=f, a=a, b=b, out=getattr(torch, f)(a, b))
ai = torch.tensor([7, -7, 7, -7, 0, 6, -6], dtype=torch.int64)
bi = torch.tensor([2, 2, -2, -2, 3, 4, 4], dtype=torch.int64)
for f in ["fmod", "remainder", "floor_divide"]:
    add(op=f + "_int", a=ai, b=bi, out=getattr(torch, f)(ai, bi))

# --- reductions
v = torch.tensor([[1.0, 2.0, 4.0, 7.0], [0.5, -1.5, 3.0, 2.0], [9.0, 9.0, 9.0, 9.0]])
for corr in [0, 1, 2]:
    add(op="var", x=v, dim=2, correction=corr, out=torch.var(v, dim=1, correction=corr))
    add(op="std", x=v, dim=2, correction=corr, out=torch.std(v, dim=1, correction=corr))
add(op="var", x=v, correction=1, out=torch.var(v))
add(op="var", x=v, dim=2, correction=4, out=torch.var(v, dim=1, correction=4))
add(op="var", x=v, dim=2, correction=5, out=torch.var(v, dim=1, correction=5))
l = torch.tensor([[1.0, 2.0, 3.0], [-INF, -INF, -INF], [INF, 1.0, 2.0], [-INF, 0.0, 1.0], [1000.0, 1000.0, -1000.0]])
add(op="logsumexp", x=l, dim=2, out=torch.logsumexp(l, dim=1))
nv = torch.tensor([[3.0, -4.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 2.0, 1.0, -1.0]])
for o in [1, 2, INF, -INF, 0, 3, 0.5]:
    add(op="norm", x=nv, ord=o, dim=2, out=torch.linalg.vector_norm(nv, ord=o, dim=1))
pv = torch.tensor([[1.0, 2.0, 0.0, 4.0], [1.0, 0.0, 0.0, 3.0], [2.0, -1.0, 0.5, 3.0]])
add(op="prod", x=pv, dim=2, out=torch.prod(pv, dim=1))
add(op="cumsum", x=pv, dim=2, out=torch.cumsum(pv, dim=1))
add(op="cumprod", x=pv, dim=2, out=torch.cumprod(pv, dim=1))
am = torch.tensor([[1.0, 3.0, 3.0, 2.0], [NAN, 1.0, 5.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
add(op="amax", x=am, dim=2, out=torch.amax(am, dim=1))
add(op="amin", x=am, dim=2, out=torch.amin(am, dim=1))

# --- gradients (sum of out * weights)
def grad_case(op, x, fn, **kw):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    w = torch.arange(1, y.numel() + 1, dtype=torch.float64).reshape(y.shape)
    (y * w).sum().backward()
    add(op=op + "_grad", x=x.detach(), grad=x.grad, **kw)

grad_case("prod", pv, lambda x: torch.prod(x, dim=1), dim=2)
grad_case("cumprod", pv, lambda x: torch.cumprod(x, dim=1), dim=2)
grad_case("cumsum", pv, lambda x: torch.cumsum(x, dim=1), dim=2)
am2 = torch.tensor([[1.0, 3.0, 3.0, 2.0], [4.0, 1.0, 5.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
grad_case("amax", am2, lambda x: torch.amax(x, dim=1), dim=2)
grad_case("amin", am2, lambda x: torch.amin(x, dim=1), dim=2)
for o in [1, 2, INF, 3]:
    grad_case("norm", nv, lambda x: torch.linalg.vector_norm(x, ord=o, dim=1), dim=2, ord=o)
so = torch.tensor([[2.0, 1.0, 2.0, 0.5, 1.0], [3.0, 3.0, 3.0, -1.0, 0.0]])
grad_case("sort", so, lambda x: torch.sort(x, dim=1).values, dim=2)
grad_case("topk", so, lambda x: torch.topk(x, 3, dim=1).values, dim=2, k=3)
grad_case("kthvalue", so, lambda x: torch.kthvalue(x, 2, dim=1).values, dim=2, k=2)
grad_case("fmod", torch.tensor([5.5, -5.5, 7.25]), lambda x: torch.fmod(torch.tensor([9.0, 9.0, -9.0]), x))
grad_case("remainder", torch.tensor([5.5, -5.5, 7.25]), lambda x: torch.remainder(torch.tensor([9.0, 9.0, -9.0]), x))

# --- sorting: ties and NaN
st = torch.tensor([[3.0, 1.0, NAN, 1.0, 2.0, NAN, 3.0, -INF, 1.0],
                   [0.0, -0.0, 0.0, 5.0, 5.0, INF, NAN, 5.0, -1.0]])
for desc in [False, True]:
    o = torch.sort(st, dim=1, descending=desc, stable=True)
    add(op="sort", x=st, descending=desc, out=o.values, idx=o.indices)
    o2 = torch.sort(st, dim=1, descending=desc)
    add(op="sort_default", x=st, descending=desc, out=o2.values, idx=o2.indices)
    add(op="argsort", x=st, descending=desc, idx=torch.argsort(st, dim=1, descending=desc, stable=True))
for largest in [True, False]:
    for k in [1, 3, 5]:
        o = torch.topk(st, k, dim=1, largest=largest)
        add(op="topk", x=st, k=k, largest=largest, out=o.values, idx=o.indices)
        o = torch.topk(st, k, dim=1, largest=largest, sorted=False)
        add(op="topk_unsorted", x=st, k=k, largest=largest, out=o.values, idx=o.indices)
for k in [1, 2, 4, 7, 9]:
    o = torch.kthvalue(st, k, dim=1)
    add(op="kthvalue", x=st, k=k, out=o.values, idx=o.indices)
ti = torch.tensor([[4, 1, 4, 2, 1, 4], [0, 0, -3, 7, 7, 0]], dtype=torch.int64)
o = torch.sort(ti, dim=1, descending=True, stable=True)
add(op="sort_int", x=ti, descending=True, out=o.values, idx=o.indices)
o = torch.topk(ti, 4, dim=1)
add(op="topk_int", x=ti, k=4, largest=True, out=o.values, idx=o.indices)
o = torch.kthvalue(ti, 3, dim=1)
add(op="kthvalue_int", x=ti, k=3, out=o.values, idx=o.indices)

here = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(here, "..", "spec", "fixtures", "math_ops.lua")
with open(path, "w") as f:
    f.write("-- generated by tools/gen_math_fixtures.py from PyTorch " + torch.__version__ + "; do not edit\n")
    f.write("return {\n")
    for c in cases:
        f.write("  " + lua(c) + ",\n")
    f.write("}\n")
print(f"wrote {len(cases)} cases to {os.path.normpath(path)}")
