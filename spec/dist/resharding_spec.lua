-- A8: resharding math of a distributed checkpoint (pytorch-semantics 3, A8): does a saved
-- chunk overlap the shard this rank holds now, and which region of each.  Pure math (no
-- communication), checked on the reference's examples and against a brute-force copy
-- that loads every saved chunk of one layout into every shard of another.
local engine = require("engine")
local dist = engine.distributed
local util = require("spec.dist.helpers.util")
local diff, errmsg = util.diff, util.errmsg

local function box(off, size) return { offsets = off, sizes = size } end

describe("A8: checkpoint resharding overlap", function()
  it("saved [2,0]/[2,4] vs current [0,0]/[3,4]: overlap, regions (1,0,2,1) (2,0,0,4)", function()
    local saved, cur = box({ 2, 0 }, { 2, 4 }), box({ 0, 0 }, { 3, 4 })
    assert.is_true(dist.check_shard_metadata_pair_overlap(saved, cur))
    assert.is_true(dist.check_shard_metadata_pair_overlap(cur, saved))
    -- PyTorch's [(0, 0, 2, 1), (1, 0, 0, 4)] with 1-based dims
    assert.same({ { 1, 0, 2, 1 }, { 2, 0, 0, 4 } }, dist.shards_get_overlap_region_wrt_saved_tensor(saved, cur))
  end)

  it("saved [4,0]/[2,4] vs current [0,0]/[3,4]: no overlap; asking for the region is an error", function()
    local saved, cur = box({ 4, 0 }, { 2, 4 }), box({ 0, 0 }, { 3, 4 })
    assert.is_false(dist.check_shard_metadata_pair_overlap(saved, cur))
    local e = errmsg(dist.shards_get_overlap_region_wrt_saved_tensor, saved, cur)
    assert.is_truthy(e and e:find("do not overlap", 1, true), e)
  end)

  it("touching boxes and empty boxes do not overlap", function()
    assert.is_false(dist.check_shard_metadata_pair_overlap(box({ 0, 0 }, { 3, 4 }), box({ 3, 0 }, { 3, 4 })))
    assert.is_false(dist.check_shard_metadata_pair_overlap(box({ 0, 0 }, { 3, 4 }), box({ 1, 1 }, { 0, 2 })))
    assert.is_true(dist.check_shard_metadata_pair_overlap(box({ 0, 0 }, { 3, 4 }), box({ 2, 3 }, { 5, 5 })))
  end)

  it("bad boxes are errors naming the operation", function()
    local e1 = errmsg(dist.check_shard_metadata_pair_overlap, box({ 0, -1 }, { 3, 4 }), box({ 0, 0 }, { 1, 1 }))
    assert.is_truthy(e1 and e1:find("check_shard_metadata_pair_overlap", 1, true) and e1:find(">= 0", 1, true), e1)
    local e2 = errmsg(dist.check_shard_metadata_pair_overlap, box({ 0 }, { 3, 4 }), box({ 0, 0 }, { 1, 1 }))
    assert.is_truthy(e2 and e2:find("1 offsets and 2 sizes", 1, true), e2)
    local e3 = errmsg(dist.shards_get_overlap_region_wrt_saved_tensor, box({ 0, 0 }, { 3, 4 }), box({ 0 }, { 1 }))
    assert.is_truthy(e3 and e3:find("boxes of 2 and 1 dims", 1, true), e3)
    local e4 = errmsg(dist.check_shard_metadata_pair_overlap, { 1, 2 }, box({ 0 }, { 1 }))
    assert.is_truthy(e4 and e4:find("{offsets = {...}, sizes = {...}}", 1, true), e4)
  end)

  it("loading every chunk of a 2x3 layout into every shard of a 4x2 layout rebuilds the tensor", function()
    engine.manual_seed(5)
    local full = engine.randn(10, 7)
    local function layout(kr, kc)
      local boxes = {}
      for i = 0, kr - 1 do
        for j = 0, kc - 1 do
          local rs, ro = dist.local_shard_size_and_offset(10, kr, i)
          local cs, co = dist.local_shard_size_and_offset(7, kc, j)
          boxes[#boxes + 1] = box({ ro, co }, { rs, cs })
        end
      end
      return boxes
    end
    local function slice(t, b)
      return t:narrow(1, b.offsets[1] + 1, b.sizes[1]):narrow(2, b.offsets[2] + 1, b.sizes[2])
    end
    local saved = layout(2, 3)
    local rebuilt = engine.zeros(10, 7)
    local copies = 0
    for _, cur in ipairs(layout(4, 2)) do
      if cur.sizes[1] > 0 and cur.sizes[2] > 0 then
        local shard = engine.zeros(cur.sizes[1], cur.sizes[2])
        for _, sv in ipairs(saved) do
          if dist.check_shard_metadata_pair_overlap(sv, cur) then
            local chunk = slice(full, sv)
            local src, dst = chunk, shard
            for _, r in ipairs(dist.shards_get_overlap_region_wrt_saved_tensor(sv, cur)) do
              src = src:narrow(r[1], r[2] + 1, r[4])
              dst = dst:narrow(r[1], r[3] + 1, r[4])
            end
            dst:copy_(src)
            copies = copies + 1
          end
        end
        slice(rebuilt, cur):copy_(shard)
      end
    end
    assert.equal(0, diff(rebuilt, full))
    assert.is_true(copies > 8)
  end)
end)
