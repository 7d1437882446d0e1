-- engine.nn.dropout: Dropout (inverted dropout; identity in eval mode).
local mod = require("engine.nn.module")
local F = require("engine.nn.functional")
local Module = mod.Module

local M = {}

local Dropout = Module:extend("Dropout")
M.Dropout = Dropout

-- Dropout([p = 0.5]): zeroes each element with probability p while training and
-- scales the rest by 1/(1-p); draws from the global counter-based generator.
function Dropout:__init(p)
  if type(p) == "table" then p = p.p end
  if p == nil then p = 0.5 end
  if type(p) ~= "number" or p < 0 or p > 1 then
    error("Dropout: probability p must be between 0 and 1, got " .. tostring(p), 3)
  end
  self.p = p
end

function Dropout:forward(x)
  return F.dropout(x, self.p, self.training)
end

function Dropout:extra_repr() return string.format("p=%g", self.p) end

return M
