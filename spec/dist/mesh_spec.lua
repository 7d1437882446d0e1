-- DeviceMesh (pytorch-semantics.md section 1.1, acceptance cases B1-B6), run
-- under mpirun with 1, 2 and 4 ranks; the 2x2 cases need 4 ranks.
local engine = require("engine")
local dist = engine.distributed

local R, W = dist.rank(), dist.world_size()

local function flat(t) return (t:tolist_flat()) end
local function range(n) local r = {} for i = 1, n do r[i] = i - 1 end return r end
local function needs(n) if W ~= n then pending("needs " .. n .. " ranks, running on " .. W) end end
local function needs_at_least(n) if W < n then pending("needs " .. n .. "+ ranks, running on " .. W) end end

describe("DeviceMesh, 1-d over the world", function()
  it("init_device_mesh('cpu', {W}) covers every rank", function()
    local mesh = dist.init_device_mesh("cpu", { W }, { "dp" })
    assert.equal(1, mesh:ndim())
    assert.equal(W, mesh:size())
    assert.equal(W, mesh:size(1))
    assert.equal(W, mesh:size("dp"))
    assert.same({ W }, mesh:shape())
    assert.same({ R }, mesh:get_coordinate())
    assert.equal(R, mesh:get_local_rank())
    assert.equal(R, mesh:get_local_rank("dp"))
    assert.equal(R, mesh:get_rank())
    assert.same({ "dp" }, mesh.mesh_dim_names)
    assert.equal("cpu", mesh.device_type)
    assert.same(range(W), mesh:ranks())
    assert.same(range(W), flat(mesh.mesh))
    assert.equal("i64", mesh.mesh.dtype)
    local g = mesh:get_group()
    assert.same(range(W), g:ranks())
    assert.equal(g, mesh:get_group("dp"))
    assert.equal(g, mesh:get_group(1))
    assert.equal(g, mesh:get_group(-1))
    assert.same({ g }, mesh:get_all_groups())
    -- B4: slicing a 1-d mesh by its only name gives an equal mesh
    assert.equal(mesh, mesh["dp"])
    assert.is_true(mesh["dp"] == mesh)
    local want = "DeviceMesh('cpu', [" .. table.concat(range(W), ", ") .. "], mesh_dim_names=('dp',))"
    assert.equal(want, tostring(mesh))
  end)

  it("a mesh without names; its group reduces over the world", function()
    local mesh = dist.init_device_mesh("cpu", W)
    assert.is_nil(mesh.mesh_dim_names)
    assert.equal("DeviceMesh('cpu', [" .. table.concat(range(W), ", ") .. "])", tostring(mesh))
    local t = engine.full({ 2 }, R + 1)
    dist.all_reduce(t, "sum", { group = mesh:get_group() })
    assert.same({ W * (W + 1) / 2, W * (W + 1) / 2 }, flat(t))
    -- a DeviceMesh as the group option (mesh_dim optional on 1-d)
    dist.all_reduce(t, "max", { group = mesh })
    assert.same({ W * (W + 1) / 2, W * (W + 1) / 2 }, flat(t))
  end)

  it("DeviceMesh from a rank table or a tensor equals init_device_mesh", function()
    local a = dist.init_device_mesh("cpu", { W }, { "x" })
    local b = dist.DeviceMesh("cpu", range(W), { "x" })
    local c = dist.DeviceMesh("cpu", engine.arange(W), { "x" })
    assert.equal(a, b)
    assert.equal(a, c)
    local d = dist.DeviceMesh("cpu", range(W), { "y" })
    assert.not_equal(a, d)
  end)

  it("creation errors", function()
    assert.has_error(function() dist.init_device_mesh("cpu", { W + 1 }) end,
      string.format("init_device_mesh: mesh shape [%d] holds %d ranks but the world size is %d (the product of the " ..
        "mesh shape must equal the world size, or pass an explicit rank list)", W + 1, W + 1, W))
    assert.has_error(function() dist.init_device_mesh("cpu", { W, 1 }, { "a", "a" }) end,
      "init_device_mesh: Each mesh_dim_name must be unique. Found repeated mesh_dim_name 'a'")
    assert.has_error(function() dist.init_device_mesh("cpu", { W, 1 }, { "a" }) end,
      "init_device_mesh: mesh_shape and mesh_dim_names should have same length! (2 dims, 1 names)")
    assert.has_error(function() dist.init_device_mesh("cpu", { W }, { "" }) end,
      "init_device_mesh: mesh_dim_names[1] is empty")
    assert.has_error(function() dist.init_device_mesh("cpu", { W }, { 3 }) end,
      "init_device_mesh: mesh_dim_names[1] must be a string, got number")
    assert.has_error(function() dist.init_device_mesh("cpu", { W }, { "size" }) end,
      "init_device_mesh: mesh_dim_name 'size' clashes with a DeviceMesh method or field; choose another name")
    assert.has_error(function() dist.init_device_mesh("tpu", { W }) end,
      "init_device_mesh: device_type must be \"cpu\" or \"cuda\", got tpu")
    assert.has_error(function() dist.init_device_mesh("cpu", {}) end,
      "init_device_mesh: mesh_shape must be a non-empty list of sizes")
    assert.has_error(function() dist.init_device_mesh("cpu", { 0 }) end)
    assert.has_error(function() dist.init_device_mesh("cpu", { 1.5 }) end,
      "init_device_mesh: mesh_shape entry 1 must be an integer, got 1.5")
    assert.has_error(function() dist.init_device_mesh("cpu", { 1 }, nil, { ranks = { W } }) end,
      string.format("init_device_mesh: rank %d in the mesh is out of range for world size %d (ranks are 0-based)", W, W))
    assert.has_error(function() dist.init_device_mesh("cpu", { 2 }, nil, { ranks = { 0, 0 } }) end,
      "init_device_mesh: rank 0 appears twice in the mesh")
    assert.has_error(function() dist.init_device_mesh("cpu", { 2 }, nil, { ranks = { 0 } }) end,
      "init_device_mesh: the rank list has 1 entries but the mesh shape {2} holds 2")
    assert.has_error(function() dist.DeviceMesh("cpu", { { 0, 1 }, { 2 } }) end)
    -- a mesh still works after the failed attempts
    local m = dist.init_device_mesh("cpu", { W })
    assert.equal(W, m:size())
  end)

  it("'cuda' without a usable GPU says so", function()
    if engine.C.eng_comm_cuda_device_count() > 0 then pending("a GPU is present") end
    local ok, err = pcall(dist.init_device_mesh, "cuda", { W })
    assert.is_false(ok)
    assert.matches("init_device_mesh: device 'cuda' requested but no CUDA GPU is usable on this machine", err)
  end)

  it("dim and slicing errors", function()
    local mesh = dist.init_device_mesh("cpu", { W }, { "dp" })
    assert.has_error(function() mesh:size(0) end,
      "DeviceMesh.size: mesh dim 0 is invalid: mesh dims are 1-based in Lua (1 is the first, -1 the last)")
    assert.has_error(function() mesh:size(2) end,
      "DeviceMesh.size: mesh dim 2 out of range for a 1-d mesh (valid: 1..1 or -1..-1)")
    assert.has_error(function() mesh:get_group("tp") end,
      "DeviceMesh.get_group: Invalid mesh_dim_name 'tp' specified. Valid mesh_dim_names are ('dp',)")
    assert.has_error(function() return mesh["tp"] end,
      "DeviceMesh slice: Invalid mesh_dim_name 'tp' specified. Valid mesh_dim_names are ('dp',)")
    local unnamed = dist.init_device_mesh("cpu", { W })
    assert.has_error(function() return unnamed["dp"] end, "DeviceMesh slice: No `mesh_dim_names` found.")
    assert.has_error(function() unnamed:get_local_rank("dp") end,
      "DeviceMesh.get_local_rank: No `mesh_dim_names` found.")
    assert.has_error(function() mesh.size = 3 end, "DeviceMesh: 'size' is read-only")
    assert.has_error(function() mesh:slice({}) end, "DeviceMesh slice: no mesh dims given")
  end)

  it("flatten of a 1-d mesh", function()
    local mesh = dist.init_device_mesh("cpu", { W }, { "dp" })
    local f = mesh:flatten()
    assert.same({ "dp" }, f.mesh_dim_names)
    assert.same(range(W), f:ranks())
    assert.equal(f, mesh:flatten()) -- cached
    local t = engine.ones(1)
    dist.all_reduce(t, "sum", { group = f:get_group() })
    assert.same({ W }, flat(t))
  end)
end)

describe("DeviceMesh over a subset of ranks", function()
  it("non-members have no coordinate and skip communication", function()
    needs_at_least(2)
    local members = { 0, W - 1 }
    local mesh = dist.DeviceMesh("cpu", members, { "x" })
    local g = mesh:get_group("x")
    local t = engine.full({ 1 }, R + 1)
    dist.reset_comm_counts()
    dist.all_reduce(t, "sum", { group = mesh, mesh_dim = "x" })
    local counts = dist.comm_counts()
    if R == 0 or R == W - 1 then
      assert.same({ R == 0 and 0 or 1 }, mesh:get_coordinate())
      assert.equal(R == 0 and 0 or 1, mesh:get_local_rank())
      assert.is_true(mesh:is_member())
      assert.same({ 1 + W }, flat(t))
      assert.same(members, g:ranks())
      assert.same({ all_reduce = 1 }, counts)
    else
      assert.is_nil(mesh:get_coordinate())
      assert.is_nil(mesh:get_local_rank())
      assert.is_false(mesh:is_member())
      assert.is_false(g:is_member())
      assert.same({ R + 1 }, flat(t))
      assert.same({}, counts)
    end
    assert.equal(2, mesh:size())
    assert.same(members, mesh:ranks())
    assert.equal("DeviceMesh('cpu', [0, " .. (W - 1) .. "], mesh_dim_names=('x',))", tostring(mesh))
  end)

  it("ranks calling it with different meshes all fail", function()
    needs_at_least(2)
    local shape = R == 0 and { W } or { W, 1 }
    local ok, err = pcall(dist.init_device_mesh, "cpu", shape)
    assert.is_false(ok)
    assert.matches("init_device_mesh: the ranks called it with different mesh shapes, rank lists or dim names", err)
    -- a rank with bad arguments while the others are fine: all fail
    ok, err = pcall(dist.init_device_mesh, "cpu", { W }, R == 1 and { "a", "b" } or { "a" })
    assert.is_false(ok)
    if R == 1 then assert.matches("should have same length", err) else assert.matches("different", err) end
  end)
end)

describe("DeviceMesh 2x2 (4 ranks)", function()
  local function mesh2d() return dist.init_device_mesh("cpu", { 2, 2 }, { "dp", "tp" }) end

  it("B1: dim-1 groups are [r%2, r%2+2]; dim-2 groups [2(r//2), 2(r//2)+1]", function()
    needs(4)
    local mesh = mesh2d()
    local i, j = math.floor(R / 2), R % 2
    assert.same({ i, j }, mesh:get_coordinate())
    assert.same({ R % 2, R % 2 + 2 }, mesh:get_group("dp"):ranks())
    assert.same({ 2 * i, 2 * i + 1 }, mesh:get_group("tp"):ranks())
    assert.same({ R % 2, R % 2 + 2 }, mesh:get_group(1):ranks())
    assert.equal(i, mesh:get_local_rank("dp"))
    assert.equal(j, mesh:get_local_rank("tp"))
    assert.equal(j, mesh:get_local_rank(2))
    assert.equal(j, mesh:get_local_rank(-1))
    assert.equal(i, mesh:get_group("dp"):rank())
    assert.same({ { 0, 1 }, { 2, 3 } }, mesh:ranks())
    assert.same({ 2, 2 }, mesh.mesh:shape())
    assert.equal(4, mesh:size())
    assert.equal(2, mesh:size("tp"))
    assert.equal("DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))", tostring(mesh))
    assert.matches("^ProcessGroup%(tp:group%[" .. 2 * i .. "," .. 2 * i + 1 .. "%], size=2", tostring(mesh:get_group("tp")))
  end)

  it("B4: slicing, errors, cached slices reuse the parent's groups", function()
    needs(4)
    local mesh = mesh2d()
    local tp, dp = mesh["tp"], mesh["dp"]
    assert.equal(1, tp:ndim())
    assert.same({ 2 * math.floor(R / 2), 2 * math.floor(R / 2) + 1 }, tp:ranks())
    assert.same({ R % 2, R % 2 + 2 }, dp:ranks())
    assert.same({ "tp" }, tp.mesh_dim_names)
    assert.equal(mesh:get_group("tp"):id(), tp:get_group():id()) -- no new group
    assert.equal(mesh:get_group("dp"):id(), dp:get_group():id())
    assert.is_true(rawequal(tp, mesh["tp"])) -- cached
    assert.equal(mesh:get_local_rank("dp"), mesh:get_local_rank(1))
    assert.equal(mesh:get_local_rank("dp"), dp:get_local_rank())
    assert.equal(mesh, mesh{ "dp", "tp" })
    assert.equal(mesh, mesh:slice("dp", "tp"))
    assert.equal(mesh, mesh:slice(1, 2))
    assert.equal(tp, mesh:slice(2))
    assert.equal(tp, mesh("tp"))
    assert.has_error(function() return mesh{ "tp", "dp" } end,
      "DeviceMesh slice: Invalid mesh_dim_names ('tp', 'dp') specified. Valid mesh_dim_names should be a " ..
      "subsequence of ('dp', 'tp')")
    assert.has_error(function() mesh:slice(2, 1) end,
      "DeviceMesh slice: the dims must be in increasing order (a subsequence of the mesh dims)")
    assert.has_error(function() return mesh["pp"] end,
      "DeviceMesh slice: Invalid mesh_dim_name 'pp' specified. Valid mesh_dim_names are ('dp', 'tp')")
    assert.has_error(function() mesh:get_local_rank() end,
      "DeviceMesh.get_local_rank: Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.")
    assert.has_error(function() mesh:get_group() end,
      "DeviceMesh.get_group: Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.")
    assert.has_error(function() dist.all_reduce(engine.ones(1), "sum", { group = mesh }) end,
      "all_reduce: DeviceMesh.get_group: Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.")
    local unnamed = dist.init_device_mesh("cpu", { 2, 2 })
    assert.has_error(function() return unnamed["dp"] end, "DeviceMesh slice: No `mesh_dim_names` found.")
    assert.same({ R % 2, R % 2 + 2 }, unnamed:slice(1):ranks()) -- by index works without names
  end)

  it("collectives along mesh dims (B6: broadcast and scatter per dim)", function()
    needs(4)
    local mesh = mesh2d()
    for d = 1, 2 do
      local g = mesh:get_group(d)
      local t = engine.ones(3, 3) * R
      dist.broadcast(t, { group = g, group_src = 0 })
      local first = g:ranks()[1]
      for _, v in ipairs(flat(t)) do assert.equal(first, v) end
      -- scatter from the first rank of each group: the k-th member gets ones*its rank
      local input
      if g:rank() == 0 then
        local l = {}
        for _, r in ipairs(g:ranks()) do for _ = 1, 3 do l[#l + 1] = r end end
        input = engine.tensor(l, "f32"):view(6)
      end
      local out = engine.zeros(3)
      dist.scatter(out, input, first, { group = g })
      assert.same({ R, R, R }, flat(out))
    end
    -- all_reduce along tp sums rows, along dp columns
    local a = engine.full({ 1 }, R)
    dist.all_reduce(a, "sum", { group = mesh, mesh_dim = "tp" })
    local i = math.floor(R / 2)
    assert.same({ 4 * i + 1 }, flat(a))
    local b = engine.full({ 1 }, R)
    dist.all_reduce(b, "sum", { group = mesh["dp"] })
    assert.same({ 2 * (R % 2) + 2 }, flat(b))
    -- all_gather along dp
    local g = dist.all_gather(engine.full({ 1 }, R), { group = mesh, mesh_dim = 1 })
    assert.same({ R % 2, R % 2 + 2 }, flat(g))
  end)

  it("an explicit rank array: coordinates follow it", function()
    needs(4)
    local mesh = dist.DeviceMesh("cpu", { { 3, 2 }, { 1, 0 } }, { "a", "b" })
    local pos = 3 - R
    assert.same({ math.floor(pos / 2), pos % 2 }, mesh:get_coordinate())
    local row = mesh:get_group("b"):ranks()
    if R >= 2 then assert.same({ 3, 2 }, row) else assert.same({ 1, 0 }, row) end
    assert.equal("DeviceMesh('cpu', [[3, 2], [1, 0]], mesh_dim_names=('a', 'b'))", tostring(mesh))
    local m2 = dist.init_device_mesh("cpu", { 2, 2 }, { "a", "b" }, { ranks = { 3, 2, 1, 0 } })
    assert.equal(mesh, m2)
  end)

  it("a 2x2 mesh over ranks {0, 2} x ... : a 2-d mesh over a subset (2x1)", function()
    needs(4)
    local mesh = dist.DeviceMesh("cpu", { { 0 }, { 2 } }, { "dp", "tp" })
    local t = engine.full({ 1 }, R + 1)
    dist.all_reduce(t, "sum", { group = mesh, mesh_dim = "dp" })
    if R % 2 == 0 then
      assert.same({ R / 2, 0 }, mesh:get_coordinate())
      assert.same({ 4 }, flat(t))
      assert.equal(1, mesh:get_group("tp"):size())
    else
      assert.is_nil(mesh:get_coordinate())
      assert.same({ R + 1 }, flat(t))
      -- slicing on a non-member gives a mesh it is not part of
      assert.is_nil(mesh["dp"]:get_coordinate())
      assert.same({ 0, 2 }, mesh["dp"]:ranks())
    end
  end)

  it("flatten merges dims into one group (B3: flatten of a slice)", function()
    needs(4)
    local mesh = mesh2d()
    local f = mesh:flatten()
    assert.same({ "dp_tp" }, f.mesh_dim_names)
    assert.same({ 0, 1, 2, 3 }, f:ranks())
    assert.same({ R }, f:get_coordinate())
    local t = engine.ones(1)
    dist.all_reduce(t, "sum", { group = f })
    assert.same({ 4 }, flat(t))
    local ft = mesh["tp"]:flatten("tp_flat")
    assert.same(mesh["tp"]:ranks(), ft:ranks())
    assert.same({ "tp_flat" }, ft.mesh_dim_names)
    local g = dist.all_gather(engine.full({ 1 }, R), { group = ft })
    assert.same(mesh["tp"]:ranks(), flat(g))
  end)

  it("B2/B3-style 3-d mesh 2x1x2: slices and sub-meshes", function()
    needs(4)
    local mesh = dist.init_device_mesh("cpu", { 2, 1, 2 }, { "dp", "pp", "cp" })
    assert.same({ math.floor(R / 2), 0, R % 2 }, mesh:get_coordinate())
    assert.same({ 2 * math.floor(R / 2), 2 * math.floor(R / 2) + 1 }, mesh["cp"]:ranks())
    assert.same({ R }, mesh["pp"]:ranks())
    local dc = mesh{ "dp", "cp" }
    assert.same({ { 0, 1 }, { 2, 3 } }, dc:ranks())
    assert.equal(mesh:get_group("cp"):id(), dc:get_group("cp"):id())
    assert.has_error(function() return mesh{ "cp", "dp" } end,
      "DeviceMesh slice: Invalid mesh_dim_names ('cp', 'dp') specified. Valid mesh_dim_names should be a " ..
      "subsequence of ('dp', 'pp', 'cp')")
    local dp_pp = mesh{ "dp", "pp" }
    assert.same({ { R % 2 }, { R % 2 + 2 } }, dp_pp:ranks())
    assert.same({ R % 2, R % 2 + 2 }, dp_pp:flatten():ranks())
  end)
end)

describe("DeviceMesh 2x2x2 (8 ranks; run with mpirun -np 8)", function()
  it("B2: groups of each dim and a 2-d slice", function()
    needs(8)
    local mesh = dist.init_device_mesh("cpu", { 2, 2, 2 }, { "Replicate", "Shard", "TP" })
    local tp = { { 0, 1 }, { 2, 3 }, { 4, 5 }, { 6, 7 } }
    local sh = { { 0, 2 }, { 1, 3 }, { 4, 6 }, { 5, 7 } }
    local rep = { { 0, 4 }, { 1, 5 }, { 2, 6 }, { 3, 7 } }
    local function row_of(groups)
      for _, g in ipairs(groups) do if g[1] == R or g[2] == R then return g end end
    end
    assert.same(row_of(tp), mesh["TP"]:ranks())
    assert.same(row_of(sh), mesh["Shard"]:ranks())
    assert.same(row_of(rep), mesh["Replicate"]:ranks())
    assert.same(row_of(tp), mesh:get_group("TP"):ranks())
    local rs = { { { 0, 2 }, { 4, 6 } }, { { 1, 3 }, { 5, 7 } } }
    assert.same(rs[R % 2 + 1], mesh{ "Replicate", "Shard" }:ranks())
  end)

  it("B3: in-order sub-meshes, the order error, flatten of a slice", function()
    needs(8)
    local mesh = dist.init_device_mesh("cpu", { 2, 2, 2 }, { "dp", "pp", "cp" })
    local dc = mesh{ "dp", "cp" }
    local in_first = R == 0 or R == 1 or R == 4 or R == 5
    assert.same(in_first and { { 0, 1 }, { 4, 5 } } or { { 2, 3 }, { 6, 7 } }, dc:ranks())
    assert.has_error(function() return mesh{ "cp", "dp" } end,
      "DeviceMesh slice: Invalid mesh_dim_names ('cp', 'dp') specified. Valid mesh_dim_names should be a " ..
      "subsequence of ('dp', 'pp', 'cp')")
    assert.same(dc:flat_ranks(), dc:flatten():ranks())
    local t = engine.ones(1)
    dist.all_reduce(t, "sum", { group = dc:flatten() })
    assert.same({ 4 }, flat(t))
  end)

  it("B6: broadcast along every dim gives the group's first rank; scatter per dim", function()
    needs(8)
    local mesh = dist.init_device_mesh("cpu", { 2, 2, 2 })
    for d = 1, 3 do
      local g = mesh:get_group(d)
      local t = engine.ones(3, 3) * R
      dist.broadcast(t, { group = g, group_src = 0 })
      assert.same({ g:ranks()[1] }, { t:get(2, 2) })
      local input
      if g:rank() == 0 then input = engine.tensor({ g:ranks()[1], g:ranks()[2] }, "f32") end
      local out = engine.zeros(1)
      dist.scatter(out, input, nil, { group = g, group_src = 0 })
      assert.same({ R }, flat(out))
    end
  end)
end)

describe("DeviceMesh 1x2 / 2x1 (2 ranks)", function()
  it("row and column groups", function()
    needs(2)
    local m = dist.init_device_mesh("cpu", { 1, 2 }, { "a", "b" })
    assert.same({ 0, R }, m:get_coordinate())
    assert.same({ R }, m:get_group("a"):ranks())
    assert.same({ 0, 1 }, m:get_group("b"):ranks())
    local n = dist.init_device_mesh("cpu", { 2, 1 }, { "a", "b" })
    assert.same({ R, 0 }, n:get_coordinate())
    assert.same({ 0, 1 }, n:get_group("a"):ranks())
    local t = engine.full({ 1 }, R + 1)
    dist.all_reduce(t, "sum", { group = m, mesh_dim = "a" }) -- a group of one
    assert.same({ R + 1 }, flat(t))
    dist.all_reduce(t, "sum", { group = n, mesh_dim = "a" })
    assert.same({ 3 }, flat(t))
  end)
end)
