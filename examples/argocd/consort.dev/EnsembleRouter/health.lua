-- Argo CD health of a consort.dev EnsembleRouter, from the status the Consort operator writes
-- (operator/consort_operator/api/router.py: EnsembleRouterStatus).
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
if status.phase == "Invalid" then
  hs.status = "Degraded"
  hs.message = "Invalid: " .. message_of(condition(status, "ConfigValid"), "the spec does not render into a router config")
  return hs
end

if status.phase == "Degraded" then
  hs.status = "Degraded"
  hs.message = "Degraded: " .. message_of(ready, "some Specialists are not Ready")
  return hs
end

local replicas = 2
if obj.spec ~= nil and obj.spec.replicas ~= nil then replicas = obj.spec.replicas end
if replicas == 0 then
  hs.status = "Suspended"
  hs.message = "Scaled to zero replicas"
  return hs
end

if status.phase ~= "Ready" then
  hs.status = "Progressing"
  hs.message = status.phase .. ": " .. message_of(ready, "waiting for router replicas")
  return hs
end

local ready_replicas = status.readyReplicas or 0
if ready_replicas < replicas then
  hs.status = "Progressing"
  hs.message = "Scaling: " .. ready_replicas .. "/" .. replicas .. " router replicas ready"
  return hs
end

hs.status = "Healthy"
hs.message = message_of(ready, "Ready")
return hs
