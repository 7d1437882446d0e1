-- engine.nn.dropout: Dropout (inverted dropout; identity in eval mode).
local mod = require("engine.nn.module")
local F = require("engine.nn.functional")
local random_mod = require("engine.ops.random")
local Module = mod.Module

local M = {}

local Dropout = Module:extend("Dropout")
M.Dropout = Dropout

-- Dropout([p = 0.5 [, {generator = g}]]) or Dropout{p =, generator =}: zeroes each element with
-- probability p while training and scales the rest by 1/(1-p); the masks are drawn from the
-- engine.Generator g (default: the global counter-based generator).
function Dropout:__init(p, opts)
  if type(p) == "table" then p, opts = p.p, p end
  if p == nil then p = 0.5 end
  if type(p) ~= "number" or p < 0 or p > 1 then
    error("Dropout: probability p must be between 0 and 1, got " .. tostring(p), 3)
  end
  local g = nil
  if opts ~= nil then
    if type(opts) ~= "table" then error("Dropout: options must be a table {generator = g}, got " .. type(opts), 3) end
    for k in pairs(opts) do
      if k ~= "p" and k ~= "generator" then error("Dropout: unknown option '" .. tostring(k) .. "' (p, generator)", 3) end
    end
    g = opts.generator
    if g ~= nil and not random_mod.is_generator(g) then
      error("Dropout: generator must be an engine.Generator, got " .. type(g), 3)
    end
  end
  self.p = p
  self.generator = g
end

function Dropout:forward(x)
  return F.dropout(x, self.p, self.training, self.generator)
end

function Dropout:extra_repr() return string.format("p=%g", self.p) end

return M
