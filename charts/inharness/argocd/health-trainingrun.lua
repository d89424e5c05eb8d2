-- Argo CD health of an inharness.dev TrainingRun, from the status the operator writes (docs/operator.md).
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  if c.reason ~= nil and c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.message or c.reason or fallback
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "waiting for the operator to report a status"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready = condition(status, "Ready")
local progressing = condition(status, "Progressing")
local degraded = condition(status, "Degraded")

if status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = describe(condition(status, "Failed"), "the run failed")
  return hs
end

if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded, "degraded")
  return hs
end

if status.phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = describe(ready, "spec.suspend is true")
  return hs
end

if status.phase == "Complete" then
  hs.status = "Healthy"
  hs.message = describe(condition(status, "Complete"), "complete")
  return hs
end

if status.phase == "Running" and ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(progressing, "running")
  return hs
end

hs.status = "Progressing"
if ready ~= nil and ready.status ~= "True" then
  hs.message = describe(ready, status.phase)
else
  hs.message = describe(progressing, status.phase)
end
return hs
