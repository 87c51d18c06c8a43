"""The shared decode pool's decisions, as Lua scripts that Redis runs atomically.

Every router process sharing a state URL runs these; Redis runs one script at a time, so a
script is the critical section the in-process pool gets from its event loop. No script
waits: a waiter is an entry in a queue, woken by a message from the script that handed it
a slot.

Keys (one hash tag, ``{pdr}``, so that a Redis Cluster keeps them on one shard):

* ``{pdr}:slots``  hash: node URL -> slots (written by every router from its own flags)
* ``{pdr}:used``   hash: node URL -> slots reserved, all routers together: always the
  number of ``res:R`` entries on that URL (every renewal counts them again)
* ``{pdr}:res:R``  hash: reservation id -> node URL, the reservations router R holds
* ``{pdr}:routers`` hash: router id -> its lease's end (ms, Redis's clock)
* ``{pdr}:floor``  hash: router id -> its lowest reservation id whose acquire it may still
  be waiting for (below: settled, see "Unknown outcomes")
* ``{pdr}:queue:M`` sorted set: ``"R reservation-id"`` by arrival (``{pdr}:seq``, one
  count for all models), the waiters for model M; M is "" for a waiter that asked for no
  model (a model id is never empty: ``edge/validation.py``)
* ``{pdr}:queues`` set: the models M whose queue may have waiters (dropped when found empty)
* ``{pdr}:rr``     counter: where the next pick starts among equally free nodes
* channel ``{pdr}:grant:R``: ``"reservation-id url"``, a slot handed to a waiter of R

Which waiters a slot on a node may go to is the router's to say (it knows the nodes'
models and states), in the scripts' arguments, as "a list of nodes": how many, then per
node its URL, ``+`` (it takes the waiters of the models listed) or ``-`` (of every model but
those listed), how many models are listed, and the models ("" for the waiters that asked
for none). A node not in the list takes none. Each model id is an argument of its own,
never joined to others nor split, so that any character may be in one.

One queue per model, as in-process: a slot freed on a node goes to the oldest of the heads
of the queues of the models it takes, a few reads however long a burst on another model
is (one queue for all would be scanned past that burst at every release).

A reservation is released exactly once: its id leaves ``res:R`` in the script that gives
the slot back, and a second release of the same id finds nothing. A router whose lease
ended (killed, partitioned) has its reservations given back and its queue entries dropped
by whichever router renews next.

Unknown outcomes. A call the router gave up on (no reply within the timeout, a connection
lost or killed, Redis paused) may have run, or may still run later. So a reservation id is
a number, increasing per router, and every renewal sends the floor (the lowest id whose
acquire the router still waits for; every lower one is settled: held, waiting, or given
up) and the ids the router holds or waits for. The renewal gives back every reservation
and drops every queue entry of that router below the floor that it did not send, and an
acquire below the floor, run late, takes nothing (``late``). Then the renewal counts
``used`` again from the reservations. It sends what the router holds (id and node) and
who waits in the queue (id and model), and writes back what Redis lost: a Redis that
failed over to a replica that had not received the last acquires. Whatever the fault,
what the router holds and what Redis counts agree again after the next renewal.

Values are checked before use: a count that is not one (``HSET {pdr}:used url x``), a lease
that is not a time, a queue entry that is not ``"R id"``, a counter that does not count is
noted (key, field, value, what was done) in the script's last reply element for the router
to log, and repaired: counts from the reservations, the rest dropped and written again by
the routers' renewals.
"""

from __future__ import annotations

_COMMON = """
local P = '{pdr}:'
-- What was wrong in the store, for the router's log: key, field, value, what was done.
local bad = {}
local function note(key, field, value, done)
  bad[#bad + 1] = key
  bad[#bad + 1] = field
  bad[#bad + 1] = value
  bad[#bad + 1] = done
end
-- A count (digits only, as HINCRBY writes them), or nil.
local function as_count(value)
  if type(value) == 'string' and #value < 16 and string.match(value, '^%d+$') then
    return tonumber(value)
  end
  return nil
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The count at key's field: 0 when absent, nil when what is there is no count.
local function count(key, field)
  local value = redis.call('HGET', key, field)
  if not value then return 0 end
  return as_count(value)
end
-- The slots in use on each node, counted again from the reservations of every router
-- holding a lease; ``used`` made to match (a count that differed is noted).
local function recount()
  local counts = {}
  for _, router in ipairs(redis.call('HKEYS', P .. 'routers')) do
    for _, url in ipairs(redis.call('HVALS', P .. 'res:' .. router)) do
      counts[url] = (counts[url] or 0) + 1
    end
  end
  local stored = redis.call('HGETALL', P .. 'used')
  local seen = {}
  for i = 1, #stored, 2 do
    local url, was = stored[i], stored[i + 1]
    local now = counts[url] or 0
    seen[url] = true
    if as_count(was) ~= now then
      redis.call('HSET', P .. 'used', url, now)
      note(P .. 'used', url, was, 'counted ' .. now .. ' reserved')
    end
  end
  for url, now in pairs(counts) do
    if not seen[url] then
      redis.call('HSET', P .. 'used', url, now)
      note(P .. 'used', url, '', 'counted ' .. now .. ' reserved')
    end
  end
  return counts
end
-- Called after the reservation on url was written or deleted. (A count that HINCRBY takes
-- but is no count, a negative one, is found by the next read: ``free``, or a renewal.)
local function add_used(url, delta)
  if type(redis.pcall('HINCRBY', P .. 'used', url, delta)) ~= 'number' then recount() end
end
-- Set when a node's slots were not in the store (lost, or dropped as bad): the router's
-- renewal writes them back.
local lacking = false
-- The fields of a hash, read in one command per thousand (one per field made a pick cost
-- two commands per node: 0.5 ms of Redis per request over 128 nodes); false for a field
-- that is absent. (``unpack`` is bounded by Lua's stack: 8,000.)
local function fields(key, names)
  local out = {}
  for first = 1, #names, 1000 do
    local last = math.min(first + 999, #names)
    for _, value in ipairs(redis.call('HMGET', key, unpack(names, first, last))) do
      out[#out + 1] = value
    end
  end
  return out
end
-- The free slots of url, given what ``slots`` and ``used`` held for it (``fields``) and,
-- once a bad count made them counted again, the counts (``recount``): what it reads of
-- the store is the same as one ``HGET`` of each would be. Returns the counts too.
local function free(url, slots_held, used_held, counts)
  local slots = 0
  if not slots_held then
    lacking = true
  else
    slots = as_count(slots_held)
    if slots == nil then
      lacking = true
      -- The router's renewal writes its nodes' slots back.
      note(P .. 'slots', url, slots_held, 'dropped')
      redis.call('HDEL', P .. 'slots', url)
      slots = 0
    end
  end
  local used
  if counts then
    used = counts[url] or 0
  elseif not used_held then
    used = 0
  else
    used = as_count(used_held)
    if used == nil then
      counts = recount()
      used = counts[url] or 0
    end
  end
  return slots - used, counts
end
-- INCR of a key that may hold no counter: then it is noted and started again at restart.
local function incr(key, restart)
  local n = redis.pcall('INCR', key)
  if type(n) == 'number' then return n end
  local kind = redis.call('TYPE', key)['ok']
  local value = kind == 'string' and redis.call('GET', key) or ('a ' .. kind)
  note(key, '', value, 'started again at ' .. restart)
  redis.call('DEL', key)
  redis.call('SET', key, restart)
  return redis.call('INCR', key)
end
-- A queue member's router and reservation id; nil for a member that is not one.
local function split(member)
  local at = string.find(member, ' ', 1, true)
  if not at then return nil end
  return string.sub(member, 1, at - 1), string.sub(member, at + 1)
end
-- Nodes and the waiters each takes, from ARGV[at] (the module docstring): the urls in
-- order, url -> where its entry starts in ARGV (read by ``spec_at`` when needed: a request
-- is offered every node and reads one's), and where the arguments after them start.
local function read_nodes(at)
  local urls, takes = {}, {}
  for _ = 1, tonumber(ARGV[at]) do
    urls[#urls + 1] = ARGV[at + 1]
    takes[ARGV[at + 1]] = at + 1
    at = at + 3 + tonumber(ARGV[at + 3])
  end
  return urls, takes, at + 1
end
-- The waiters the entry at ARGV[at] (url, "+" or "-", n, n models) takes: {plus = true for
-- a "+" node, models = {model -> true}, listed = {models}}; nil for no entry (the node
-- takes no new requests).
local specs = {}
local function spec_at(at)
  if at == nil then return nil end
  if specs[at] == nil then
    local models, listed = {}, {}
    for i = at + 3, at + 2 + tonumber(ARGV[at + 2]) do
      models[ARGV[i]] = true
      listed[#listed + 1] = ARGV[i]
    end
    specs[at] = {plus = ARGV[at + 1] == '+', models = models, listed = listed}
  end
  return specs[at]
end
local function serves(spec, model)
  return spec ~= nil and (spec.models[model] == true) == spec.plus
end
-- The highest arrival in any queue: where a lost arrival counter starts again.
local function last_arrival()
  local top = 0
  for _, model in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
    local last = redis.call('ZRANGE', P .. 'queue:' .. model, -1, -1, 'WITHSCORES')
    if #last > 0 then top = math.max(top, tonumber(last[2])) end
  end
  return top
end
-- True once this script found no queue with a waiter: only ``enqueue`` adds one, so it
-- stays so until then, and a script asks Redis once, not at every slot it hands out.
local no_queue = false
local function nobody_queued()
  if not no_queue then no_queue = redis.call('SCARD', P .. 'queues') == 0 end
  return no_queue
end
local function enqueue(model, member)
  local seq = redis.pcall('INCR', P .. 'seq')
  if type(seq) ~= 'number' then seq = incr(P .. 'seq', last_arrival()) end
  redis.call('ZADD', P .. 'queue:' .. model, seq, member)
  redis.call('SADD', P .. 'queues', model)
  no_queue = false
end
-- True when the member was in model's queue.
local function dequeue(model, member)
  if redis.call('ZREM', P .. 'queue:' .. model, member) == 0 then return false end
  if redis.call('EXISTS', P .. 'queue:' .. model) == 0 then
    redis.call('SREM', P .. 'queues', model)
  end
  return true
end
-- The oldest waiter of a live router for model: its member and arrival, or nil. Waiters of
-- routers whose lease ended, and members that name no waiter, are dropped on the way.
local function head(model)
  local key = P .. 'queue:' .. model
  while true do
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if #first == 0 then
      redis.call('SREM', P .. 'queues', model)
      return nil
    end
    local router = split(first[1])
    if router == nil then
      note(key, first[1], first[2], 'dropped')
    elseif redis.call('HEXISTS', P .. 'routers', router) == 1 then
      return first[1], tonumber(first[2])
    end
    redis.call('ZREM', key, first[1])
  end
end
-- The oldest waiter among the models spec takes (all but those listed: the queued ones):
-- its model and member, or nil.
local function first_for(spec)
  -- Nobody waits, the usual case: one read, not one per model the node takes.
  if spec == nil or nobody_queued() then return nil end
  local models = spec.listed
  if not spec.plus then models = redis.call('SMEMBERS', P .. 'queues') end
  local model, member, seq = nil, nil, nil
  for _, m in ipairs(models) do
    if serves(spec, m) then
      local h, s = head(m)
      if h and (seq == nil or s < seq) then model, member, seq = m, h, s end
    end
  end
  return model, member
end
local function grant(model, member, url)
  dequeue(model, member)
  local router, resid = split(member)
  redis.call('HSET', P .. 'res:' .. router, resid, url)
  redis.call('PUBLISH', P .. 'grant:' .. router, resid .. ' ' .. url)
end
-- The oldest waiter (of a live router) that url takes (takes: as ``read_nodes`` gives it;
-- a url not in it takes no new requests) gets the slot on url; without one the slot goes
-- back to url.
local function hand_over(url, takes)
  local model, member = first_for(spec_at(takes[url]))
  if member then
    grant(model, member, url)
  else
    add_used(url, -1)
  end
end
-- The router's reservations named in ARGV[from], ARGV[from + 1]... given back (an id no
-- longer held: nothing), each slot to the oldest waiter its node takes (takes: a list of
-- nodes), else back to its node; how many were held.
local function release(router, takes, from)
  local key = P .. 'res:' .. router
  local released = 0
  for i = from, #ARGV do
    local url = redis.call('HGET', key, ARGV[i])
    if url then
      redis.call('HDEL', key, ARGV[i])
      hand_over(url, takes)
      released = released + 1
    end
  end
  return released
end
-- The freest of the given urls (ties in turn) and its free slots, or nil when none has a
-- free slot.
local function pick(urls)
  local n = #urls
  if n == 0 then return nil end
  local start = redis.pcall('INCR', P .. 'rr')
  if type(start) ~= 'number' then start = incr(P .. 'rr', 0) end
  local slots, used = fields(P .. 'slots', urls), fields(P .. 'used', urls)
  local best, most, counts = nil, 0, nil
  for i = 0, n - 1 do
    local at = 1 + (start + i) % n
    local f
    f, counts = free(urls[at], slots[at], used[at], counts)
    if f > most then best, most = urls[at], f end
  end
  return best, most
end
-- The router's floor, raised to at least floor; its value before.
local function raise_floor(router, floor)
  local was = count(P .. 'floor', router)
  if was == nil then
    note(P .. 'floor', router, redis.call('HGET', P .. 'floor', router), 'written again')
    was = 0
  end
  if floor > was then redis.call('HSET', P .. 'floor', router, floor) end
  return was
end
-- What calls the router gave up on left behind: its queue entries and reservations below
-- floor that are not in kept (id -> true), dropped and given back; how many.
local function settle(router, floor, kept, takes)
  local function stale(id)
    return not kept[id] and (as_count(id) or 0) < floor
  end
  local settled = 0
  -- The queue first: a slot given back below must not reach a waiter dropped after.
  for _, model in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
    for _, member in ipairs(redis.call('ZRANGE', P .. 'queue:' .. model, 0, -1)) do
      local who, id = split(member)
      if who == router and stale(id) then
        dequeue(model, member)
        settled = settled + 1
      end
    end
  end
  local key = P .. 'res:' .. router
  local held = redis.call('HGETALL', key)
  for i = 1, #held, 2 do
    if stale(held[i]) then
      redis.call('HDEL', key, held[i])
      hand_over(held[i + 1], takes)
      settled = settled + 1
    end
  end
  return settled
end
"""

# ARGV: router, n, then n requests, each: its reservation id, "1" to queue it when nothing
# is free, its model ("": any), the nodes it may land on (a list of nodes: see the module
# docstring); then the router's releases sent along, as RELEASE takes them: the nodes that
# take new requests (a list of nodes) and the reservation ids (mostly none: "0" and no id)
# -> {{the reply to each request, in order}, bad}, a reply being {"ok", url, room} (room:
# 1 if the node has a slot left and nobody waits, in any queue) | {"queued"} | {"busy"} |
# {"unknown"} (the router must register first) | {"stale"} (no slot free, and the slots of
# some node were not in the store: the router must renew first) | {"late"} (an id below
# the router's floor: a call it gave up on)
# The releases first: they came first. The requests in the order they came, each as if
# alone (those sent together came while one call ran: ``shared/pool.py``). As
# in-process: the freest node is taken unless a waiter it takes is queued (a newcomer
# never overtakes a waiter, one queued earlier in the same call included); a burst queued
# on another model's nodes is no obstacle.
ACQUIRE = _COMMON + """
local router, n = ARGV[1], tonumber(ARGV[2])
local asked, at = {}, 3
for i = 1, n do
  local urls, takes, after = read_nodes(at + 3)
  asked[i] = {ARGV[at], ARGV[at + 1], ARGV[at + 2], urls, takes}
  at = after
end
local _, freed, from = read_nodes(at)
release(router, freed, from)
local replies = {}
if redis.call('HEXISTS', P .. 'routers', router) == 0 then
  for i = 1, n do replies[i] = {'unknown'} end
  return {replies, bad}
end
local floor = count(P .. 'floor', router) or 0
for i, request in ipairs(asked) do
  local resid, may_queue, model, urls, takes = unpack(request)
  if (as_count(resid) or 0) < floor then
    replies[i] = {'late'}
  else
    local url, most = pick(urls)
    if url and first_for(spec_at(takes[url])) == nil then
      redis.call('HSET', P .. 'res:' .. router, resid, url)
      add_used(url, 1)
      local room = 0
      if most > 1 and nobody_queued() then room = 1 end
      replies[i] = {'ok', url, room}
    elseif lacking then
      replies[i] = {'stale'}
    elseif may_queue == '1' then
      enqueue(model, router .. ' ' .. resid)
      replies[i] = {'queued'}
    else
      replies[i] = {'busy'}
    end
  end
end
return {replies, bad}
"""

# ARGV: router, the nodes that take new requests (a list of nodes), the reservation ids
# -> {how many were held (a release of an id no longer held does nothing), bad}
RELEASE = _COMMON + """
local _, takes, at = read_nodes(2)
return {release(ARGV[1], takes, at), bad}
"""

# ARGV: router, reservation id, its model
# -> {"left", bad} | {"granted", url, bad} | {"gone", bad}
ABANDON = _COMMON + """
if dequeue(ARGV[3], ARGV[1] .. ' ' .. ARGV[2]) then return {'left', bad} end
local url = redis.call('HGET', P .. 'res:' .. ARGV[1], ARGV[2])
if url then return {'granted', url, bad} end
return {'gone', bad}
"""

# ARGV: router, lease ms, floor, n, n pairs of (url, slots), the nodes that take new
# requests (a list of nodes), m, m pairs of (reservation id, url) the router holds, q, q
# pairs of (reservation id, model) of its waiters in the queue, o, the o ids of its other
# waiters (their acquire not answered yet, or their slot not yet heard of), then the ids
# of the reservations it released since its last call (as RELEASE takes them)
# -> {1 if the router is registered (else it must REGISTER, nothing done), reclaimed,
# settled, restored, bad}
# Renews the lease and the nodes' slots; gives back what routers whose lease ended held;
# counts the slots in use again; gives back the releases (before ``settle``, which would
# count them as calls given up on); settles this router's unknown outcomes (``settle``);
# writes back what it holds and who waits where Redis lost them (``restored``);
# hands free slots to waiters (a node readmitted, a release that could not reach a waiter):
# the oldest waiter first, each to the freest node that takes it, until no waiter left can
# be given a slot.
RENEW = _COMMON + """
local router, lease, floor, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('HEXISTS', P .. 'routers', router) == 0 then return {0, 0, 0, 0, bad} end
local now = now_ms()
redis.call('HSET', P .. 'routers', router, now + lease)
for i = 0, n - 1 do redis.call('HSET', P .. 'slots', ARGV[5 + 2 * i], ARGV[6 + 2 * i]) end
local urls, takes, at = read_nodes(5 + 2 * n)
local kept, held, queued = {}, {}, {}
for i = at + 1, at + 2 * tonumber(ARGV[at]), 2 do
  kept[ARGV[i]] = true
  held[#held + 1] = {ARGV[i], ARGV[i + 1]}
end
at = at + 1 + 2 * tonumber(ARGV[at])
for i = at + 1, at + 2 * tonumber(ARGV[at]), 2 do
  kept[ARGV[i]] = true
  queued[#queued + 1] = {ARGV[i], ARGV[i + 1]}
end
at = at + 1 + 2 * tonumber(ARGV[at])
for i = at + 1, at + tonumber(ARGV[at]) do kept[ARGV[i]] = true end
local released = at + 1 + tonumber(ARGV[at])
raise_floor(router, floor)
-- First, so that every count below is one (a bad one is repaired and noted).
recount()
-- Routers whose lease ended: out of ``routers`` first, so that no slot of theirs, nor of
-- anyone's, is handed to their waiters.
local ended = {}
local routers = redis.call('HGETALL', P .. 'routers')
for i = 1, #routers, 2 do
  local other, ends = routers[i], as_count(routers[i + 1])
  if ends == nil then
    note(P .. 'routers', other, routers[i + 1], 'its lease ended')
    ends = 0
  end
  if ends < now then
    redis.call('HDEL', P .. 'routers', other)
    redis.call('HDEL', P .. 'floor', other)
    ended[#ended + 1] = other
  end
end
local reclaimed = 0
for _, other in ipairs(ended) do
  local held = redis.call('HGETALL', P .. 'res:' .. other)
  redis.call('DEL', P .. 'res:' .. other)
  for j = 1, #held, 2 do
    hand_over(held[j + 1], takes)
    reclaimed = reclaimed + 1
  end
  for _, model in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
    for _, member in ipairs(redis.call('ZRANGE', P .. 'queue:' .. model, 0, -1)) do
      if split(member) == other then dequeue(model, member) end
    end
  end
end
-- After the routers whose lease ended are out: no released slot goes to their waiters.
release(router, takes, released)
local settled = settle(router, floor, kept, takes)
-- What the router holds and who waits, written back where Redis lost them (a failover to
-- a replica that had not received them). After ``settle``: a slot it gave back goes to
-- the waiters Redis knew, never to one written back here. A waiter whose slot came
-- meanwhile (it is in res:R) is not queued again.
local restored = 0
local mine = P .. 'res:' .. router
for _, pair in ipairs(held) do
  if redis.call('HSETNX', mine, pair[1], pair[2]) == 1 then
    add_used(pair[2], 1)
    restored = restored + 1
  end
end
for _, pair in ipairs(queued) do
  local member = router .. ' ' .. pair[1]
  if not redis.call('ZSCORE', P .. 'queue:' .. pair[2], member)
      and redis.call('HEXISTS', mine, pair[1]) == 0 then
    enqueue(pair[2], member)
    restored = restored + 1
  end
end
-- A model none of whose nodes has a free slot is passed over from then on.
local full = {}
while true do
  local model, member, seq = nil, nil, nil
  for _, m in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
    if not full[m] then
      local h, s = head(m)
      if h and (seq == nil or s < seq) then model, member, seq = m, h, s end
    end
  end
  if not model then break end
  local candidates = {}
  for _, url in ipairs(urls) do
    if serves(spec_at(takes[url]), model) then candidates[#candidates + 1] = url end
  end
  local url = pick(candidates)
  if url then
    grant(model, member, url)
    add_used(url, 1)
  else
    full[model] = true
  end
end
return {1, reclaimed, settled, restored, bad}
"""

# ARGV: router, lease ms, floor, n, n pairs of (url, slots), m, m pairs of (reservation id,
# url), then pairs of (waiting reservation id, its model), oldest first -> {1, bad}
# A router's start, or its return after its registration was lost (Redis restarted empty,
# or its lease ended): its lease, its floor, its nodes' slots, what it holds (each counted
# once, however often sent) and who waits, all at once, so that no other router sees it
# registered without its reservations.
REGISTER = _COMMON + """
local router, lease, floor, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSET', P .. 'routers', router, now_ms() + lease)
raise_floor(router, floor)
for i = 0, n - 1 do redis.call('HSET', P .. 'slots', ARGV[5 + 2 * i], ARGV[6 + 2 * i]) end
local at = 5 + 2 * n
local m = tonumber(ARGV[at])
for i = 0, m - 1 do
  local resid, url = ARGV[at + 1 + 2 * i], ARGV[at + 2 + 2 * i]
  if redis.call('HSETNX', P .. 'res:' .. router, resid, url) == 1 then add_used(url, 1) end
end
for i = at + 1 + 2 * m, #ARGV, 2 do
  local member, model = router .. ' ' .. ARGV[i], ARGV[i + 1]
  if not redis.call('ZSCORE', P .. 'queue:' .. model, member) then enqueue(model, member) end
end
return {1, bad}
"""

# Keys of a wrong type (``SET {pdr}:used x``) fail every script that reads them: deleted
# (noted), then the slots in use counted again; the routers write back the rest (their
# registration, as after a Redis that lost its data). -> bad
REPAIR = _COMMON + """
local function check(key, kind)
  local is = redis.call('TYPE', key)['ok']
  if is ~= 'none' and is ~= kind then
    redis.call('DEL', key)
    note(key, '', 'a ' .. is, 'deleted')
    return false
  end
  return is == kind
end
for _, key in ipairs({'slots', 'used', 'floor'}) do check(P .. key, 'hash') end
for _, key in ipairs({'seq', 'rr'}) do check(P .. key, 'string') end
if check(P .. 'routers', 'hash') then
  for _, router in ipairs(redis.call('HKEYS', P .. 'routers')) do
    check(P .. 'res:' .. router, 'hash')
  end
end
if check(P .. 'queues', 'set') then
  for _, model in ipairs(redis.call('SMEMBERS', P .. 'queues')) do
    check(P .. 'queue:' .. model, 'zset')
  end
end
recount()
return bad
"""

RESERVATIONS = "{pdr}:res:"
GRANTS = "{pdr}:grant:"

# ---------------------------------------------------------------- the fleet (shared/fleet.py)
#
# * ``{pdr}:node-ids``  hash: "role url" -> node id, never deleted: a URL keeps its id
# * ``{pdr}:next-id``   counter: the next id to give (ids are never given twice)
# * ``{pdr}:nodes``     hash: node id -> JSON {role, url, slots, labels}
# * ``{pdr}:admin``     hash: node id -> serving | draining | draining gone (DNS stopped
#   listing it) | removed | removed forced
# * ``{pdr}:health``    hash: node id -> JSON verdict {dead, reason, message, by}
# * ``{pdr}:incarnation`` hash: node id -> times it was added again after its removal
# * ``{pdr}:removed-at`` hash: node id -> when it was removed (ms, Redis's clock)
# * ``{pdr}:pruned``    hash: node id -> the admin state of a removed node whose record
#   PRUNE dropped (``removed``, ``removed forced``): read by id only, never listed
# * ``{pdr}:pruners``   hash: router id -> when it last called PRUNE (the live routers that
#   know records are pruned)
# * ``{pdr}:in-flight:R`` hash: node id -> requests router R has on it, expiring with R's
#   lease (rewritten while it lives)
# * ``{pdr}:prober``    the router that probes the engines for the whole fleet, expiring
# * channel ``{pdr}:fleet``: the id of a router that changed the fleet; the others reload it

# ARGV: "set" (an operator's add: the record and "serving" are written, the verdict
# dropped), "adopt" (a router's configured nodes, or the records it puts back: written only
# if new, or if the record alone was lost; not if it was pruned) or "discover" (an
# address DNS lists: written, the verdict dropped, if new or removed; a known node keeps
# its record and admin state, an operator's drain included), the router, then
# per node (role, url, record, admin state, preferred id or "") -> {the nodes' ids, in order,
# for each its removal if it was removed and pruned ("" if not: ``pruned``), bad (as the
# pool's scripts: a lost id counter)}.
# A preferred id (a router putting back a fleet Redis lost) is taken if nobody has it. An id
# is never given twice: a pruned node's stays its URL's.
NODES = _COMMON + """
local router, ids, gone, changed = ARGV[2], {}, {}, false
local function taken(id)
  return redis.call('HEXISTS', P .. 'nodes', id) == 1
    or redis.call('HEXISTS', P .. 'pruned', id) == 1
end
for i = 3, #ARGV, 5 do
  local key = ARGV[i] .. ' ' .. ARGV[i + 1]
  local id = redis.call('HGET', P .. 'node-ids', key)
  local write, again, pruned = ARGV[1] == 'set', false, ''
  if not id then
    id = ARGV[i + 4]
    if id == '' or taken(id) then
      repeat
        -- A lost counter starts again at 0: taken ids are skipped.
        id = tostring(incr(P .. 'next-id', 0) - 1)
      until not taken(id)
    elseif (as_count(redis.call('GET', P .. 'next-id')) or 0) <= tonumber(id) then
      redis.call('SET', P .. 'next-id', tonumber(id) + 1)
    end
    redis.call('HSET', P .. 'node-ids', key, id)
    write = true
  else
    again = string.sub(redis.call('HGET', P .. 'admin', id) or 'removed', 1, 7) == 'removed'
    if ARGV[1] == 'discover' then write = again end
    if ARGV[1] == 'adopt' and redis.call('HEXISTS', P .. 'nodes', id) == 0 then
      pruned = redis.call('HGET', P .. 'pruned', id) or ''
      write = pruned == ''
    end
  end
  if write then
    redis.call('HSET', P .. 'nodes', id, ARGV[i + 2])
    redis.call('HSET', P .. 'admin', id, ARGV[i + 3])
    redis.call('HDEL', P .. 'pruned', id)
    redis.call('HDEL', P .. 'removed-at', id)
    changed = true
  end
  -- An add starts the node afresh: an old verdict on it is the prober's to renew.
  if write and ARGV[1] ~= 'adopt' then redis.call('HDEL', P .. 'health', id) end
  -- Back after its removal: a new incarnation, so that a router that missed the removal
  -- (its reload came after both) starts it afresh too, and a verdict still in flight on
  -- the old one is dropped (VERDICT).
  if write and again and ARGV[1] ~= 'adopt' then
    if type(redis.pcall('HINCRBY', P .. 'incarnation', id, 1)) ~= 'number' then
      note(P .. 'incarnation', id, redis.call('HGET', P .. 'incarnation', id), 'started again')
      redis.call('HSET', P .. 'incarnation', id, 1)
    end
  end
  ids[#ids + 1] = tonumber(id)
  gone[#gone + 1] = pruned
end
if changed then redis.call('PUBLISH', P .. 'fleet', router) end
return {ids, gone, bad}
"""

# ARGV: router, node id, draining | removed | removed forced, the admin state the router
# saw (its first word: serving, draining, removed; "": any) -> 1, or 0 when no such node,
# when it is no longer what the router saw (an operator's change on another router came
# first: re-added, removed), or for a drain, when it was removed
ADMIN = _COMMON + """
if redis.call('HEXISTS', P .. 'nodes', ARGV[2]) == 0 then return 0 end
local now = redis.call('HGET', P .. 'admin', ARGV[2]) or 'removed'
if ARGV[4] ~= '' and string.match(now, '^%S+') ~= ARGV[4] then return 0 end
if ARGV[3] == 'draining' and string.sub(now, 1, 7) == 'removed' then return 0 end
redis.call('HSET', P .. 'admin', ARGV[2], ARGV[3])
if ARGV[3] ~= 'draining' then redis.call('HSET', P .. 'removed-at', ARGV[2], now_ms()) end
redis.call('PUBLISH', P .. 'fleet', ARGV[1])
return 1
"""

# ARGV: router, node id, admin state expected, new one -> 1 if it was the expected one
# (DNS discovery: a drain only of a serving node, undone only if it is discovery's); a node
# serving again has its verdict dropped (it joins afresh)
DNS_ADMIN = _COMMON + """
if redis.call('HGET', P .. 'admin', ARGV[2]) ~= ARGV[3] then return 0 end
redis.call('HSET', P .. 'admin', ARGV[2], ARGV[4])
if ARGV[4] == 'serving' then redis.call('HDEL', P .. 'health', ARGV[2]) end
redis.call('PUBLISH', P .. 'fleet', ARGV[1])
return 1
"""

# ARGV: router, node id, verdict, the node's incarnation when it was found ("": not known)
# -> 1, or 0 when the node was added again since (the verdict was on its old incarnation)
# or was removed and pruned (a removal an older router's add left in ``pruned`` is not one:
# the node has a record)
VERDICT = _COMMON + """
if redis.call('HEXISTS', P .. 'pruned', ARGV[2]) == 1
    and redis.call('HEXISTS', P .. 'nodes', ARGV[2]) == 0 then
  return 0
end
local now = as_count(redis.call('HGET', P .. 'incarnation', ARGV[2])) or 0
if ARGV[4] ~= '' and now > tonumber(ARGV[4]) then return 0 end
redis.call('HSET', P .. 'health', ARGV[2], ARGV[3])
redis.call('PUBLISH', P .. 'fleet', ARGV[1])
return 1
"""

# ARGV: ms a removed node's record is kept, most records to drop, the router -> the number
# dropped. Nothing is dropped while a live router has not called PRUNE (``pruners``): a
# router of an older version would take a node without a record as one it may serve.
# A removed node is timed from its removal (ADMIN; one removed by an older version, from
# the first call that sees it). Past ``ms``, and once no live router counts requests on it
# (``in-flight:R``: a long stream still running there) nor reserves a slot on its URL,
# its record, admin state and verdict are dropped, and the decode slots on its URL; its id
# stays its URL's (``node-ids``), and its removal stays (``pruned``) for NODES and VERDICT.
# Else every reload would read every node ever removed: a fleet followed through DNS
# removes one per pod replaced. Bounded, as Redis runs nothing else meanwhile (20,000
# dropped at once held it 130 ms).
PRUNE = _COMMON + """
local now, kept, left, stamps = now_ms(), tonumber(ARGV[1]), tonumber(ARGV[2]), 0
redis.call('HSET', P .. 'pruners', ARGV[3], now)
local busy, live = {}, {}
for _, router in ipairs(redis.call('HKEYS', P .. 'routers')) do
  if redis.call('HEXISTS', P .. 'pruners', router) == 0 then return 0 end
  live[router] = true
  for _, id in ipairs(redis.call('HKEYS', P .. 'in-flight:' .. router)) do busy[id] = true end
end
for _, router in ipairs(redis.call('HKEYS', P .. 'pruners')) do
  if not live[router] and router ~= ARGV[3] then redis.call('HDEL', P .. 'pruners', router) end
end
local states = redis.call('HGETALL', P .. 'admin')
for i = 1, #states, 2 do
  local id, admin = states[i], states[i + 1]
  if left == 0 or stamps == 2 * tonumber(ARGV[2]) then break end
  if string.sub(admin, 1, 7) == 'removed' and not busy[id] then
    local at = tonumber(redis.call('HGET', P .. 'removed-at', id))
    if not at then
      redis.call('HSET', P .. 'removed-at', id, now)
      stamps = stamps + 1
    elseif now - at >= kept then
      local ok, record = pcall(cjson.decode, redis.call('HGET', P .. 'nodes', id) or '')
      local url = ok and type(record) == 'table' and record.role == 'decode' and record.url
      if not (type(url) == 'string' and (count(P .. 'used', url) or 1) > 0) then
        if type(url) == 'string' then
          redis.call('HDEL', P .. 'slots', url)
          redis.call('HDEL', P .. 'used', url)
        end
        redis.call('HSET', P .. 'pruned', id, admin)
        for _, key in ipairs({'nodes', 'admin', 'health', 'removed-at'}) do
          redis.call('HDEL', P .. key, id)
        end
        left = left - 1
      end
    end
  end
end
return tonumber(ARGV[2]) - left
"""

# -> {nodes (id, record...), admin states (id, state...), verdicts (id, verdict...),
# incarnations (id, count...)}
SNAPSHOT = _COMMON + """
return {redis.call('HGETALL', P .. 'nodes'), redis.call('HGETALL', P .. 'admin'),
  redis.call('HGETALL', P .. 'health'), redis.call('HGETALL', P .. 'incarnation')}
"""

# ARGV: router, ms to live, then pairs of (node id, requests in flight)
PUT_IN_FLIGHT = _COMMON + """
local key = P .. 'in-flight:' .. ARGV[1]
redis.call('DEL', key)
if #ARGV > 2 then redis.call('HSET', key, unpack(ARGV, 3)) end
redis.call('PEXPIRE', key, ARGV[2])
return 1
"""

# -> {router, {node id, requests...}, ...} for every router holding a lease
IN_FLIGHT = _COMMON + """
local out = {}
for _, router in ipairs(redis.call('HKEYS', P .. 'routers')) do
  out[#out + 1] = router
  out[#out + 1] = redis.call('HGETALL', P .. 'in-flight:' .. router)
end
return out
"""

# ARGV: router, ms -> 1 if the router is (still, or now) the prober for that long, else 0
PROBER = _COMMON + """
local holder = redis.call('GET', P .. 'prober')
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', P .. 'prober', ARGV[1], 'PX', ARGV[2])
return 1
"""

# ARGV: router -> the prober lease given up, if the router held it (a router stopping)
UNPROBE = _COMMON + """
if redis.call('GET', P .. 'prober') == ARGV[1] then redis.call('DEL', P .. 'prober') end
return 1
"""

FLEET_CHANNEL = "{pdr}:fleet"

# ---------------------------------------------------------------- client keys (shared/keys.py)
#
# * ``{pdr}:keys:R``       hash: key name -> requests router R has in flight for it, written
#   whole by R at each of its calls, expiring with R's lease
# * ``{pdr}:key-holders``  sorted set: routers holding some, scored by when their lease ends
# * ``{pdr}:key-call:R``   string: the number of R's last call that ran (kept 10 minutes)

# ARGV: router, lease ms, the call's number, n, n pairs of (key name, requests held), then
# pairs of (key name, max_in_flight) asked for, in order -> {per ask 1 (counted) or 0 (at
# its limit, or the call ran late), notes}.
# The router's own counts are replaced by what it says it holds, never added to: a call
# whose reply was lost, or a release that never arrived, is undone by the router's next call.
# A call the router gave up on may also run late, after the calls that followed it (a slow
# link, a proxy holding it): it would write back counts the router no longer has. So each
# call of a router has a number, higher than its last, and one that is not higher than the
# last that ran changes nothing and counts no ask.
KEYS_SYNC = _COMMON + """
local router, lease, call, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local holders, own = P .. 'key-holders', P .. 'keys:' .. router
-- Whether key is of kind; one of another type is deleted and noted (every router writes
-- its own counts again at its next call, and enters the holders then).
local function kept(key, kind)
  local is = redis.call('TYPE', key)['ok']
  if is == 'none' or is == kind then return is == kind end
  redis.call('DEL', key)
  note(key, '', 'a ' .. is, 'deleted')
  return false
end
local calls = P .. 'key-call:' .. router
if kept(calls, 'string') then
  local stored = redis.call('GET', calls)
  local last = as_count(stored)
  if last == nil then
    note(calls, '', stored, 'written again')
  elseif call <= last then
    local late = {}
    for _ = 5 + 2 * n, #ARGV, 2 do late[#late + 1] = 0 end
    return {late, bad}
  end
end
redis.call('SET', calls, ARGV[3], 'PX', 600000)
local now = now_ms()
if kept(holders, 'zset') then redis.call('ZREMRANGEBYSCORE', holders, '-inf', now) end
redis.call('DEL', own)
for i = 0, n - 1 do redis.call('HSET', own, ARGV[5 + 2 * i], ARGV[6 + 2 * i]) end
local others = {}
for _, other in ipairs(redis.call('ZRANGE', holders, 0, -1)) do
  local key = P .. 'keys:' .. other
  if other ~= router and kept(key, 'hash') then others[#others + 1] = key end
end
local counted = {}
for i = 5 + 2 * n, #ARGV, 2 do
  local name, limit = ARGV[i], tonumber(ARGV[i + 1])
  local total = tonumber(redis.call('HGET', own, name) or '0')
  for _, key in ipairs(others) do
    local held = count(key, name)
    if not held then
      -- Until its router writes its counts again, within a third of its lease.
      note(key, name, redis.call('HGET', key, name), 'counted as 0')
      held = 0
    end
    total = total + held
  end
  if total < limit then
    redis.call('HINCRBY', own, name, 1)
    counted[#counted + 1] = 1
  else
    counted[#counted + 1] = 0
  end
end
if redis.call('EXISTS', own) == 1 then
  redis.call('PEXPIRE', own, lease)
  redis.call('ZADD', holders, now + lease, router)
else
  redis.call('ZREM', holders, router)
end
return {counted, bad}
"""
