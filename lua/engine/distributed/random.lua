-- engine.distributed.random: seeding the random numbers of DTensors (PyTorch's
-- torch.distributed.tensor._random.manual_seed).
--
--   dist.manual_seed(seed, mesh)
--
-- DTensor random ops (dist.rand/randn, uniform_/normal_/nn.init on DTensors, dropout) draw from the
-- engine's offset-based generator (seed, offset): every rank of a mesh holds the same state, a shard
-- takes its box of the global random tensor and every rank advances by the global count (PyTorch's
-- OffsetBasedRNGTracker).  manual_seed sets that seed on the calling rank, without communication, as
-- PyTorch does; like PyTorch it requires the calling rank to be part of the mesh (the state of ranks
-- outside it would be undefined), and the seed must be the same on every rank of the mesh.
local core = require("engine.core")
local engine = require("engine")

local M = {}

function M.manual_seed(seed, mesh)
  local dist = require("engine.distributed")
  if type(seed) ~= "number" or not (seed >= 0 and seed < 2 ^ 64) or seed % 1 ~= 0 then
    core.fail("manual_seed: seed must be an integer in [0, 2^64), got " .. tostring(seed))
  end
  if not dist.is_mesh(mesh) then
    core.fail("manual_seed: expected a DeviceMesh as the second argument (the mesh the DTensor random ops run on), got "
      .. type(mesh))
  end
  if mesh:get_coordinate() == nil then
    core.fail(string.format("manual_seed requires the current rank (%d) to be a part of the device mesh %s; otherwise "
      .. "the DTensor RNG state on the rank would not be initialized and DTensor random ops would be undefined",
      dist.rank(), tostring(mesh)))
  end
  engine.manual_seed(seed)
end

return M
