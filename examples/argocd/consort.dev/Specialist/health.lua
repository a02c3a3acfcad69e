-- Argo CD health of a consort.dev Specialist, from the status the Consort operator writes
-- (operator/consort_operator/api/specialist.py: SpecialistStatus). Order matters: a stale status
-- says nothing about the current spec, a failure outranks progress, progress outranks Healthy.
local hs = {}

local function condition(status, type_)
  if status.conditions ~= nil then
    for _, c in ipairs(status.conditions) do
      if c.type == type_ then return c end
    end
  end
  return nil
end

local function message_of(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then return c.message end
  return fallback
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

local ready = condition(status, "Ready")
if status.phase == "Failed" or status.phase == "Degraded" then
  hs.status = "Degraded"
  hs.message = status.phase .. ": " .. message_of(ready, "not serving")
  return hs
end

-- Scaled to zero by spec.scaleToZero: it serves (the router starts a replica on the next request).
if status.phase == "Idle" then
  hs.status = "Healthy"
  hs.message = "Idle: " .. message_of(ready, "scaled to zero; the next request starts a replica")
  return hs
end

local replicas = 1
if obj.spec ~= nil and obj.spec.replicas ~= nil then replicas = obj.spec.replicas end
if replicas == 0 then
  hs.status = "Suspended"
  hs.message = "Scaled to zero replicas"
  return hs
end

-- The router demoted this specialist to shadow-only: it serves, but not as primary.
local demoted = condition(status, "Demoted")
if demoted ~= nil and demoted.status == "True" then
  hs.status = "Degraded"
  hs.message = "Breaker open: " .. message_of(demoted, "demoted to shadow-only")
  return hs
end

if status.adapters ~= nil then
  for _, a in ipairs(status.adapters) do
    if a.state == "RolledBack" then
      hs.status = "Degraded"
      hs.message = "Adapter " .. a.name .. " rolled back: " .. (a.message or "")
      return hs
    end
  end
end

if status.phase ~= "Ready" then
  hs.status = "Progressing"
  hs.message = status.phase .. ": " .. message_of(ready, "waiting for warm replicas")
  return hs
end

local warm = condition(status, "Warm")
if warm ~= nil and warm.status ~= "True" then
  hs.status = "Progressing"
  hs.message = "Warming: " .. message_of(warm, "not every replica is warm")
  return hs
end

if status.adapters ~= nil then
  for _, a in ipairs(status.adapters) do
    if a.state == "Loading" or a.state == "Probation" then
      hs.status = "Progressing"
      hs.message = "Adapter " .. a.name .. " in " .. a.state .. ": " .. (a.message or "")
      return hs
    end
  end
end

hs.status = "Healthy"
hs.message = message_of(ready, "Ready")
return hs
