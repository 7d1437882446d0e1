-- PyTorch's tensor/parallel/fsdp.py functions as engine API ( lua/engine/distributed/fsdp_tp.lua and
-- sharded_tensor_convert.lua): boxes and ShardedTensor metadata of DTensors (even and uneven sizes),
-- chunk_tensor (plain and nested over a TP DTensor), chunk_dtensor onto the parent mesh, pre_load_state_dict,
-- all_gather_dtensor, the flatten / unflatten pair and DTensorExtensions; round trips DTensor -> ShardedTensor ->
-- DTensor; errors on every
-- rank.  Meshes: (2, 2) at 4 ranks, (W, 1) below.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg
local Shard, Replicate = dist.Shard, dist.Replicate

local W, R = dist.world_size(), dist.rank()
local TPN = W == 4 and 2 or 1
local DPN = W / TPN
local world = dist.init_device_mesh("cpu", { W }, { "w" })
local mesh = dist.init_device_mesh("cpu", { DPN, TPN }, { "dp", "tp" })
local dp, tp = mesh["dp"], mesh["tp"]

local function ref(shape, seed)
  engine.manual_seed(seed or 5)
  return engine.randn(shape)
end

local function pl_str(t)
  local s = {}
  for i, p in ipairs(t.placements) do s[i] = tostring(p) end
  return table.concat(s, ",")
end

local function chunk(n, k, i)
  local c = math.ceil(n / k)
  local off = math.min(i * c, n)
  return off, math.max(0, math.min(c, n - off))
end

describe("tensor/parallel/fsdp.py: boxes and metadata of a DTensor (1-D mesh)", function()
  for _, n in ipairs({ 4 * W, 2 * W + 1, 3 }) do
    it(string.format("Shard(1) of %d rows: get_box, get_box_for every index, get_local_box", n), function()
      local full = ref({ n, 2 })
      local d = dist.distribute_tensor(full, world, { Shard(1) })
      local off, sz = dist.get_box(d)
      assert.are.same({ math.ceil(n / W), 0 }, off)
      assert.are.same(d:to_local():shape(), sz)
      for i = 0, W - 1 do
        local o, s = dist.get_box_for(d, i)
        local co, cs = chunk(n, W, i)
        assert.are.same({ co, 0 }, o)
        assert.are.same({ cs, 2 }, s)
        local ls, goff = dist.compute_local_shape_and_global_offset({ n, 2 }, world, { Shard(1) }, { i })
        assert.are.same(ls, s)
        if cs > 0 then assert.are.same(goff, o) end
      end
      local lo, ls = dist.get_local_box(d)
      assert.are.same(d:to_local():shape(), ls)
      if ls[1] > 0 then assert.are.equal(0, diff(full:narrow(1, lo[1] + 1, ls[1]), d:to_local())) end
    end)
  end

  it("Shard(2) and Replicate boxes", function()
    local d = dist.distribute_tensor(ref({ 2, 2 * W + 1 }), world, { Shard(2) })
    local o, s = dist.get_box_for(d, W - 1)
    local co, cs = chunk(2 * W + 1, W, W - 1)
    assert.are.same({ 0, co }, o); assert.are.same({ 2, cs }, s)
    local r = dist.distribute_tensor(ref({ 3, 2 }), world, { Replicate() })
    o, s = dist.get_box(r)
    assert.are.same({ 0, 0 }, o); assert.are.same({ 3, 2 }, s)
    o, s = dist.get_box_for(r, W - 1)
    assert.are.same({ 0, 0 }, o); assert.are.same({ 3, 2 }, s)
  end)

  it("create_shard_md_from_dt and create_sharded_tensor_md_from_dt (uneven): exact cover, shard i on group rank i", function()
    local n = 2 * W + 1
    local d = dist.distribute_tensor(ref({ n, 3 }), world, { Shard(1) })
    local md = dist.create_shard_md_from_dt(d, R)
    local lo, ls = dist.get_local_box(d)
    assert.are.same(lo, md.shard_offsets); assert.are.same(ls, md.shard_sizes)
    assert.are.equal(string.format("rank:%d/cpu", R), tostring(md.placement))
    local smd = dist.create_sharded_tensor_md_from_dt(d)
    assert.are.same({ n, 3 }, smd.size)
    assert.are.equal(W, #smd.shards_metadata)
    local rows = 0
    for i, s in ipairs(smd.shards_metadata) do
      assert.are.equal(i - 1, s.placement.rank)
      local co, cs = chunk(n, W, i - 1)
      assert.are.same({ cs, 3 }, s.shard_sizes)
      if cs > 0 then assert.are.equal(co, s.shard_offsets[1]) end
      rows = rows + cs
    end
    assert.are.equal(n, rows)
    assert.are.equal("f32", smd.tensor_properties.dtype)
    -- the boxes are a valid EnumerableShardingSpec of the size (bounds, no overlaps, exact cover)
    dist.EnumerableShardingSpec(smd.shards_metadata):build_metadata({ n, 3 })
    -- Replicate: one box, on this rank
    local r = dist.distribute_tensor(ref({ 2, 3 }), world, { Replicate() })
    local rmd = dist.create_sharded_tensor_md_from_dt(r)
    assert.are.equal(1, #rmd.shards_metadata)
    assert.are.equal(R, rmd.shards_metadata[1].placement.rank)
    assert.are.same({ 2, 3 }, rmd.shards_metadata[1].shard_sizes)
  end)

  it("2-D meshes and bad indices are clear errors (the seed asserts a 1-D mesh)", function()
    local d = dist.distribute_tensor(ref({ 4, 4 }), mesh, { Shard(1), Replicate() })
    for _, fn in ipairs({ dist.get_box, dist.get_local_box, dist.create_sharded_tensor_md_from_dt }) do
      assert.is_truthy(errmsg(fn, d):find("only DTensors on a 1-D DeviceMesh are handled", 1, true))
    end
    local w = dist.distribute_tensor(ref({ 4, 4 }), world, { Shard(1) })
    assert.is_truthy(errmsg(dist.get_box_for, w, W):find("get_box_for: idx must be a 0-based shard index in 0..", 1, true))
    assert.is_truthy(errmsg(dist.get_box, ref({ 2 })):find("get_box: expected a DTensor, got a plain tensor", 1, true))
  end)
end)

describe("tensor/parallel/fsdp.py: chunk_tensor", function()
  local dpg = mesh:get_group("dp")
  it("a plain tensor chunked along dim 1 over a group (uneven): this rank's chunk, torch.chunk metadata", function()
    local n = 2 * DPN + 1
    local full = ref({ n, 3 })
    local st = dist.chunk_tensor(full, dpg:rank(), dpg:size(), 1, dpg)
    assert.is_true(dist.is_sharded_tensor(st))
    assert.are.same({ n, 3 }, st:size())
    local md = st:metadata()
    assert.are.equal(DPN, #md.shards_metadata)
    local shards = st:local_shards()
    assert.are.equal(1, #shards)
    local co, cs = chunk(n, DPN, dpg:rank())
    assert.are.same({ cs, 3 }, shards[1].metadata.shard_sizes)
    assert.are.equal(0, diff(shards[1].tensor, full:narrow(1, co + 1, cs)))
    -- a copy: writing the original does not change the shard
    local before = shards[1].tensor:clone()
    full:fill_(7)
    assert.are.equal(0, diff(shards[1].tensor, before))
    -- over the world, gather() rebuilds it
    local wfull = ref({ n, 3 }, 9)
    local wst = dist.chunk_tensor(wfull, R, W, 1, nil)
    local g = wst:gather(0)
    if R == 0 then assert.are.equal(0, diff(g, wfull)) end
  end)

  for _, cfg in ipairs({ { Shard(1), 4 * TPN, 2 }, { Shard(2), 3, 2 * TPN + 1 }, { Replicate(), 2 * DPN + 1, 2 } }) do
    local tpl, rows, cols = cfg[1], cfg[2], cfg[3]
    it(string.format("a TP DTensor (%s of [%d,%d]) is a nested ShardedTensor: over tp one shard, holding the dp chunks",
      tostring(tpl), rows, cols), function()
      local full = ref({ rows, cols })
      local d = dist.distribute_tensor(full, tp, { tpl })
      local st = dist.chunk_tensor(d, dpg:rank(), dpg:size(), 1, dpg)
      assert.are.same({ rows, cols }, st:size())
      assert.is_true(st:process_group() == tp:get_group(1))
      local outer = st:local_shards()
      assert.are.equal(1, #outer)
      local lo, ls = dist.get_local_box(d)
      assert.are.same(lo, outer[1].metadata.shard_offsets)
      assert.are.same(ls, outer[1].metadata.shard_sizes)
      assert.is_true(dist.is_sharded_tensor(outer[1].tensor))
      assert.are.equal(tpl:is_shard() and TPN or 1, #st:metadata().shards_metadata)
      -- pre_load_state_dict unwraps it
      local inner, shards = dist.pre_load_state_dict(st)
      assert.are.equal(outer[1].tensor, inner)
      assert.is_true(inner:process_group() == dpg)
      assert.are.equal(1, #shards)
      local tl = d:to_local()
      local co, cs = chunk(tl:shape()[1], DPN, dpg:rank())
      assert.are.equal(0, diff(shards[1].tensor, tl:narrow(1, co + 1, cs)))
      -- the composed box of this rank's inner shard is its box of the global tensor
      local box = dist._st_boxes(st)[1]
      local want = full
      for k = 1, 2 do want = want:narrow(k, box.offsets[k] + 1, box.sizes[k]) end
      assert.are.equal(0, diff(box.tensor, want))
      -- the same as the ShardedTensor form of its 2-D DTensor (no communication there)
      local fpl = tpl == Shard(1) and dist._StridedShard(1, TPN) or Shard(1)
      local d2 = dist.distribute_tensor(full, mesh, { fpl, tpl })
      local st2 = dist.as_sharded_tensor(d2)
      local _, s2 = dist.pre_load_state_dict(st2)
      assert.are.same(shards[1].metadata.shard_offsets, s2[1].metadata.shard_offsets)
      assert.are.same(shards[1].metadata.shard_sizes, s2[1].metadata.shard_sizes)
      assert.are.equal(0, diff(shards[1].tensor, s2[1].tensor))
      -- full tensor of the nested ShardedTensor on every rank
      assert.are.equal(0, diff(dist._st_full(st), full))
    end)
  end

  it("wrong rank / world_size and 2-D DTensors are errors", function()
    assert.is_truthy(errmsg(dist.chunk_tensor, ref({ 4 }), R, W + 1, 1, nil):find("world_size", 1, true))
    assert.is_truthy(errmsg(dist.chunk_tensor, ref({ 4 }), (R + 1) % (W + 1), W, 1, nil):find("is not this process's rank", 1, true))
    local d = dist.distribute_tensor(ref({ 4, 4 }), mesh, { Shard(1), Replicate() })
    assert.is_truthy(errmsg(dist.chunk_tensor, d, R, W, 1, nil):find("only DTensors on a 1-D (tensor-parallel) DeviceMesh", 1, true))
  end)
end)

describe("tensor/parallel/fsdp.py: chunk_dtensor, all_gather_dtensor", function()
  it("a plain tensor onto the parent mesh as [Shard(1), Replicate]", function()
    local full = ref({ 2 * DPN + 1, 3 })
    local d = dist.chunk_dtensor(full, R, dp)
    assert.are.equal("Shard(1),Replicate()", pl_str(d))
    assert.is_true(d.device_mesh == mesh)
    assert.are.equal(0, diff(d:full_tensor(), full))
  end)

  for _, tpl in ipairs({ Shard(1), Shard(2), Replicate() }) do
    it("a TP DTensor " .. tostring(tpl) .. " onto the parent mesh as [Shard(1), tp]; all_gather_dtensor gives the TP local back", function()
      local full = ref({ 4 * TPN * DPN, 2 * TPN })
      local d = dist.distribute_tensor(full, tp, { tpl })
      local d2 = dist.chunk_dtensor(d, R, dp)
      assert.are.equal("Shard(1)," .. tostring(tpl), pl_str(d2))
      assert.are.equal(0, diff(d2:full_tensor(), full))
      local tl = dist.all_gather_dtensor(d2, mesh)
      assert.are.equal(0, diff(tl, d:to_local()))
      assert.is_truthy(errmsg(dist.all_gather_dtensor, d2, tp):find("is not the mesh of", 1, true))
    end)
  end

  it("no parent mesh, or a parent of one dim, is the seed's error on every rank", function()
    assert.is_truthy(errmsg(dist.chunk_dtensor, ref({ 4 }), R, world):find("No parent device_mesh is found for FSDP device_mesh", 1, true))
    assert.is_truthy(errmsg(dist.chunk_dtensor, ref({ 4 }), R, world["w"]):find("Found parent device_mesh of ndim=1, but meshes must be at least 2D.", 1, true))
    local d = dist.distribute_tensor(ref({ 4, 4 }), world, { Shard(1) })
    if W > 1 or TPN ~= W then
      assert.is_truthy(errmsg(dist.chunk_dtensor, d, R, dp):find("chunk_dtensor", 1, true))
    end
  end)
end)

describe("tensor/parallel/fsdp.py: flatten / unflatten and round trips", function()
  local layouts = {
    { "1-D Shard(1)", function(f) return dist.distribute_tensor(f, world, { Shard(1) }) end },
    { "2-D [Shard(1), Shard(2)]", function(f) return dist.distribute_tensor(f, mesh, { Shard(1), Shard(2) }) end },
    { "2-D [_StridedShard(1), Shard(1)] (FSDP over colwise TP)", function(f)
      return dist.distribute_tensor(f, mesh, { dist._StridedShard(1, TPN), Shard(1) }) end },
  }
  for _, L in ipairs(layouts) do
    it(L[1] .. ": flatten -> unflatten keeps values and layout, DTensor -> ShardedTensor -> DTensor too", function()
      local full = ref({ 4 * W + (L[1]:find("Strided") and 0 or 1), 3 })
      local d = L[2](full)
      local loc, ext = dist.pre_flatten_transform(d)
      assert.is_false(dist.is_dtensor(loc))
      local back = dist.post_unflatten_transform(loc, ext)
      assert.are.equal(pl_str(d), pl_str(back))
      assert.are.same(d:shape(), back:shape())
      assert.is_true(back.device_mesh == d.device_mesh)
      assert.are.equal(0, diff(back:full_tensor(), full))
      -- the extension object does the same
      local e = dist.DTensorExtensions()
      local l2, x2 = e:pre_flatten_transform(d)
      assert.are.equal(0, diff(e:post_unflatten_transform(l2, x2):full_tensor(), full))
      -- DTensor -> ShardedTensor -> DTensor (the local shard, rebuilt on the same layout)
      local st = dist.as_sharded_tensor(d)
      assert.are.equal(0, diff(dist._st_full(st), full))
      local _, shards = dist.pre_load_state_dict(st)
      local rebuilt = dist.DTensor.from_local(shards[1].tensor, d.device_mesh, d.placements,
        { shape = d:shape(), stride = d:stride() })
      assert.are.equal(0, diff(rebuilt:full_tensor(), full))
      assert.are.equal(pl_str(d), pl_str(rebuilt))
    end)
  end

  it("HSDP + TP layout [Replicate, Shard(1), Shard(2)] on a 3-D mesh: nested ShardedTensor over the last two dims", function()
    local m3 = dist.init_device_mesh("cpu", { 1, DPN, TPN }, { "r", "s", "t" })
    local full = ref({ 2 * DPN + 1, 2 * TPN + 1 })
    local d = dist.distribute_tensor(full, m3, { Replicate(), Shard(1), Shard(2) })
    local st = dist.as_sharded_tensor(d)
    assert.is_true(st:process_group() == m3:get_group(3))
    local inner, shards = dist.pre_load_state_dict(st)
    assert.is_true(inner:process_group() == m3:get_group(2))
    assert.are.equal(0, diff(shards[1].tensor, d:to_local()))
    assert.are.equal(0, diff(dist._st_full(st), full))
    -- the same dim sharded by both without a split factor has no nested form
    local bad = dist.distribute_tensor(ref({ 4 * W, 2 }), mesh, { Shard(1), Shard(1) })
    if TPN > 1 then
      assert.is_truthy(errmsg(dist.as_sharded_tensor, bad):find("has no nested ShardedTensor form", 1, true))
    end
  end)

  it("a plain tensor passes through; a wrong local shape is an error", function()
    local t = ref({ 3 })
    local l, x = dist.pre_flatten_transform(t)
    assert.are.equal(t, l); assert.is_nil(x)
    assert.are.equal(t, dist.post_unflatten_transform(t, nil))
    local d = dist.distribute_tensor(ref({ 4 * W, 2 }), world, { Shard(1) })
    local _, ext = dist.pre_flatten_transform(d)
    assert.is_truthy(errmsg(dist.post_unflatten_transform, ref({ 5, 2 }), ext):find("needs [4,2] on this rank", 1, true))
    assert.is_truthy(errmsg(dist.post_unflatten_transform, ref({ 4, 2 }), { 1 }):find("must be what pre_flatten_transform returned", 1, true))
  end)

  it("DTensorExtensions has the seed's method names", function()
    local e = dist.DTensorExtensions()
    for _, k in ipairs({ "pre_flatten_transform", "post_unflatten_transform", "chunk_tensor", "chunk_dtensor",
      "pre_load_state_dict_transform", "all_gather_dtensor" }) do
      assert.are.equal("function", type(e[k]), k)
    end
    local full = ref({ 2 * DPN, 2 })
    local d = e:chunk_dtensor(full, R, dp)
    assert.are.equal(0, diff(e:all_gather_dtensor(d, mesh), full))
    local st = e:chunk_tensor(full, R, W, 1, nil)
    local t, shards = e:pre_load_state_dict_transform(st)
    assert.are.equal(st, t)
    assert.are.equal(1, #shards)
  end)
end)
