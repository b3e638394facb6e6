-- Tollgate admission queue: take one of a model's engine slots, or wait in a priority queue.
--
-- try_slot(K, o)
--   K  the model's pool (core.keyspace.pool_keys): kr running zset (request id -> lease
--      deadline ms), kq queue zset (request id -> rank), kx queue expiry zset (request id ->
--      give-up ms), kf fair-share hash, kc ceiling, kt in-flight hash (request id -> predicted
--      tokens * 4 + class; _tok their total, _c0/_c1/_c2 slot holders by class), kh recent
--      higher-class demand (see headroom below), kp preemptible slot holders (request id ->
--      class * 1e13 + admission ms; see preemption below), km the gateway's preemptions (a
--      hash: t the last one's time in ms, from which the controller judges whether
--      preempting frees an engine slot, gateway/tuning.py; frees: until when its verdict
--      "it does" holds, ms)
--   o  rid, class (0 P0, 1 P1, 2 P2), tenant, weight, cost (tokens, for fair share), now,
--      lease, budget, p2 ('1' when engines have spare capacity), giveup (ms), fresh (true
--      when called by admission: the request is not queued yet),
--      kv       the request's predicted in-flight tokens (prompt estimate + expected output),
--      kvcap    the engines' KV-cache capacity in tokens for admission (0: unknown, no limit),
--      hwin     headroom window (ms, 0: no headroom), hmax most slots the headroom keeps,
--      preempt  1: this P0/P1 request may take the slot of a preemptible lower-class one
--               (the gateway preempts on every engine: gateway/preempt.py; until the
--               controller finds that it frees an engine slot, one per PROBATION_MS)
--      victim   1: this request may be preempted
--      head     1: a preempted request queueing again: at the head of its class (and the
--               last of its class to be preempted again)
--      chan     the channel that tells the victim's gateway process to let go of its slot
--      open     the open requests zset (request id -> lease deadline): a queue entry ahead
--               whose request is not on it (settled, or its gateway died) is dropped
--
-- Rank = class * 1e13 + virtual start time: P0 before P1 before P2; inside a class, start-
-- time fair queueing by tokens (a tenant's virtual time advances by cost / weight), so one
-- tenant's burst cannot starve another's. A request takes a slot only when no better-ranked
-- request waits, a slot is free under the ceiling, and its predicted tokens fit in
-- the KV cache beside those in flight (a request alone always fits: the engine decides).
--
-- Headroom: on engines that serve first come, first served, a P0 request arriving while
-- P2 holds every slot waits for a P2 reply to end (seconds). So lower classes leave free
-- the slots higher classes recently needed: k = the most higher-class requests that ran at
-- once (holding a slot or asking for one) in the last one to two windows (0 once they stop
-- coming), at most hmax and never every slot. A lower-class request takes a slot only while
-- running + max(0, k - higher-class slot holders now) < ceiling.
--
-- Preemption (on every engine: none of vLLM, llama.cpp, SGLang or Ollama gives a waiting P0
-- request a running one's slot, and the headroom alone costs throughput and still leaves
-- P0 behind a P2 reply now and then; gateway/preempt.py): a P0/P1 request that finds every
-- slot taken, with nothing better queued, takes the slot of the youngest preemptible
-- request of the lowest class below it. The slot changes hands here, atomically; the
-- victim's gateway process hears it on `chan`, aborts the engine request (the engine frees
-- the slot at once) and queues the request again at the head of its class to resume it.
-- Returns {1, running, ceiling} when admitted, {0, ahead, ceiling} when queued.

-- gateway/controller.py's PREEMPT_QUIET_SECONDS: a preemption is judged by the engine's
-- counts in the window after it, so one per window on probation is judged before the next.
local PROBATION_MS = 30000

-- Until the controller has judged that preempting frees an engine slot on the model (km's
-- 'frees': until when that verdict holds, ms), one preemption per PROBATION_MS: where the
-- engine finishes what the gateway aborts, each preemption adds a request no slot was
-- counted for, and one per P0 arrival before the verdict would fill the engine.
local function on_probation(km, now)
  local m = redis.call('HMGET', km, 't', 'frees')
  if tonumber(m[2] or '0') > now then return false end
  return now - tonumber(m[1] or '0') < PROBATION_MS
end

-- Slot holders whose gateway died (lease lapsed) leave the running set and the token count.
local function reap(kr, kt, kp, now)
  local gone = redis.call('ZRANGEBYSCORE', kr, '-inf', now, 'LIMIT', 0, 200)
  if #gone == 0 then return end
  redis.call('ZREM', kr, unpack(gone))
  redis.call('ZREM', kp, unpack(gone))
  local held = redis.call('HMGET', kt, unpack(gone))
  local tokens, by_class = 0, {0, 0, 0}
  for _, v in ipairs(held) do
    if v then
      local n = tonumber(v)
      local c = n % 4
      tokens = tokens + (n - c) / 4
      by_class[c + 1] = by_class[c + 1] + 1
    end
  end
  redis.call('HDEL', kt, unpack(gone))
  if tokens ~= 0 then redis.call('HINCRBY', kt, '_tok', -tokens) end
  for c = 1, 3 do
    if by_class[c] ~= 0 then redis.call('HINCRBY', kt, '_c' .. (c - 1), -by_class[c]) end
  end
end

-- Take a slot from a holder: out of the running set, its tokens out of the in-flight count.
local function unhold(kr, kt, kp, rid)
  redis.call('ZREM', kp, rid)
  if redis.call('ZREM', kr, rid) == 0 then return false end
  local held = redis.call('HGET', kt, rid)
  if held then
    local n = tonumber(held)
    local c = n % 4
    redis.call('HDEL', kt, rid)
    if n - c ~= 0 then redis.call('HINCRBY', kt, '_tok', -(n - c) / 4) end
    redis.call('HINCRBY', kt, '_c' .. c, -1)
  end
  return true
end

-- The youngest preemptible slot holder of the lowest class below `class` (nil: none).
local function victim_of(kr, kp, class, CLASS)
  for _ = 1, 3 do
    local v = redis.call('ZREVRANGEBYSCORE', kp, '+inf', (class + 1) * CLASS, 'LIMIT', 0, 1)
    if #v == 0 then return nil end
    if redis.call('ZSCORE', kr, v[1]) then return v[1] end
    redis.call('ZREM', kp, v[1])  -- its lease lapsed: not running any more
  end
  return nil
end

-- Recent demand of the classes above a class, kept per series s (1: P0; 2: P0 and P1) as
-- the most that ran at once in the current window (m) and the one before (p).
local function recent_demand(kh, s, now, win)
  local v = redis.call('HMGET', kh, 'b' .. s, 'm' .. s, 'p' .. s)
  if not v[1] then return 0 end
  local b, cur = tonumber(v[1]), math.floor(now / win)
  if b == cur then return math.max(tonumber(v[2]), tonumber(v[3])) end
  if b == cur - 1 then return tonumber(v[2]) end
  return 0
end

local function note_demand(kh, s, n, now, win)
  local v = redis.call('HMGET', kh, 'b' .. s, 'm' .. s)
  local cur = math.floor(now / win)
  local b = tonumber(v[1] or '-1')
  if b == cur then
    if n > tonumber(v[2]) then redis.call('HSET', kh, 'm' .. s, n) end
  elseif b == cur - 1 then
    redis.call('HSET', kh, 'b' .. s, cur, 'p' .. s, v[2], 'm' .. s, n)
  else
    redis.call('HSET', kh, 'b' .. s, cur, 'p' .. s, 0, 'm' .. s, n)
  end
  redis.call('PEXPIRE', kh, 2 * win)
end

local function try_slot(K, o)
  local kr, kq, kx, kf, kc, kt, kh, kp, km = K[1], K[2], K[3], K[4], K[5], K[6], K[7], K[8], K[9]
  local class, now, lease = o.class, o.now, o.lease
  local CLASS = 1e13
  local ceiling = tonumber(redis.call('GET', kc) or o.budget)
  if ceiling < 1 then ceiling = 1 end

  -- A fresh request (from admission) cannot be queued yet; a retry has its rank.
  local rank, tag = -1, nil
  if not o.fresh then rank = tonumber(redis.call('ZSCORE', kq, o.rid) or '-1') end
  if rank < 0 and o.head == 1 then
    -- Preempted: ahead of every request of its class still waiting (their ranks are at
    -- least the class's virtual time), its tenant's fair-share tag unchanged.
    rank = class * CLASS + tonumber(redis.call('HGET', kf, '_v' .. class) or '0') - 1
  elseif rank < 0 then
    local vt = redis.call('HMGET', kf, '_v' .. class, o.tenant .. ':' .. class)
    local start = math.max(tonumber(vt[1] or '0'), tonumber(vt[2] or '0'))
    tag = start + o.cost / o.weight
    rank = class * CLASS + start
  end

  -- Leases and queue entries of gateways that died expire on their own; they only matter
  -- (and are only looked for) when they would keep this request waiting.
  local running = redis.call('ZCARD', kr)
  local held = redis.call('HMGET', kt, '_tok', '_c0', '_c1')
  -- A higher-class request is demand whether it gets a slot now or waits for one: the
  -- series of P0 counts the P0 slot holders and this one; that of P0 and P1 counts both.
  if class < 2 and o.hwin > 0 then
    local p0, p1 = tonumber(held[2] or '0'), tonumber(held[3] or '0')
    if class == 0 then note_demand(kh, 1, p0 + 1, now, o.hwin) end
    note_demand(kh, 2, p0 + p1 + 1, now, o.hwin)
  end
  local in_flight = tonumber(held[1] or '0')
  local higher = 0  -- slot holders of better classes
  if class >= 1 then higher = higher + tonumber(held[2] or '0') end
  if class == 2 then higher = higher + tonumber(held[3] or '0') end
  local reserved = 0
  -- Every request keeps the headroom, preemptible and preempted ones too: a P0 that finds
  -- its slot free costs nothing, while preempting throws away work (the tokens a stream's
  -- engine made after the last one its client got; a whole non-streaming answer so far).
  -- Preemption is for the P0 the headroom did not foresee. A preempted request coming back
  -- waits for a slot beyond the headroom like the rest of its class (it heads the class):
  -- taking the slot back would leave the next P0 nothing but another preemption.
  if class > 0 and o.hwin > 0 then
    reserved = math.max(0, math.min(recent_demand(kh, class, now, o.hwin), o.hmax, ceiling - 1) - higher)
  end
  local kv_ok = o.kvcap <= 0 or running == 0 or in_flight + o.kv <= o.kvcap
  if running + reserved >= ceiling or not kv_ok then
    reap(kr, kt, kp, now)
    running = redis.call('ZCARD', kr)
    if running == 0 then redis.call('DEL', kt) end  -- nothing runs: nothing is in flight
    held = redis.call('HMGET', kt, '_tok', '_c0', '_c1')
    in_flight = tonumber(held[1] or '0')
    higher = 0
    if class >= 1 then higher = higher + tonumber(held[2] or '0') end
    if class == 2 then higher = higher + tonumber(held[3] or '0') end
    if reserved > 0 then
      reserved = math.max(0, math.min(recent_demand(kh, class, now, o.hwin), o.hmax, ceiling - 1) - higher)
    end
    kv_ok = o.kvcap <= 0 or running == 0 or in_flight + o.kv <= o.kvcap
  end
  local ahead = redis.call('ZCOUNT', kq, '-inf', '(' .. rank)
  if ahead > 0 then
    local gone = redis.call('ZRANGEBYSCORE', kx, '-inf', now, 'LIMIT', 0, 200)
    -- A request that is no longer open (settled, or its gateway's lease on the record
    -- lapsed) waits for nothing: its entry must not hold up the queue until it gives up.
    if o.open then
      local first = redis.call('ZRANGEBYSCORE', kq, '-inf', '(' .. rank, 'LIMIT', 0, 8)
      for _, rid in ipairs(first) do
        local until_ms = redis.call('ZSCORE', o.open, rid)
        if not until_ms or tonumber(until_ms) < now then gone[#gone + 1] = rid end
      end
    end
    if #gone > 0 then
      redis.call('ZREM', kq, unpack(gone))
      redis.call('ZREM', kx, unpack(gone))
      ahead = redis.call('ZCOUNT', kq, '-inf', '(' .. rank)
    end
  end
  if running + reserved >= ceiling and running <= ceiling and o.preempt == 1 and class < 2 and kv_ok
      and ahead == 0 and not on_probation(km, now) then
    local v = victim_of(kr, kp, class, CLASS)
    if v and unhold(kr, kt, kp, v) then
      redis.call('PUBLISH', o.chan, v)
      redis.call('HSET', km, 't', now)
      redis.call('PEXPIRE', km, 3600000)
      running = running - 1
      reserved = 0
    end
  end
  if running + reserved < ceiling and kv_ok and (class < 2 or o.p2 == '1') and ahead == 0 then
    if not o.fresh then
      redis.call('ZREM', kq, o.rid)
      redis.call('ZREM', kx, o.rid)
    end
    redis.call('ZADD', kr, now + lease, o.rid)
    redis.call('PEXPIRE', kr, lease)
    redis.call('HSET', kt, o.rid, o.kv * 4 + class)
    redis.call('HINCRBY', kt, '_tok', o.kv)
    redis.call('HINCRBY', kt, '_c' .. class, 1)
    redis.call('PEXPIRE', kt, lease)
    if o.victim == 1 then
      -- The youngest is preempted first (it has the least to recompute); one already
      -- preempted and resumed comes last in its class (it has the most).
      redis.call('ZADD', kp, class * CLASS + (o.head == 1 and 0 or now), o.rid)
      redis.call('PEXPIRE', kp, lease)
    end
    -- The class's virtual time moves to the start tag of what it last served.
    if tag then
      redis.call('HSET', kf, '_v' .. class, rank - class * CLASS, o.tenant .. ':' .. class, tag)
    else
      redis.call('HSET', kf, '_v' .. class, rank - class * CLASS)
    end
    redis.call('PEXPIRE', kf, 3600000)
    return {1, running + 1, ceiling}
  end
  if tag then redis.call('HSET', kf, o.tenant .. ':' .. class, tag) end
  redis.call('ZADD', kq, rank, o.rid)
  redis.call('ZADD', kx, now + o.giveup, o.rid)
  redis.call('PEXPIRE', kq, o.giveup + 60000)
  redis.call('PEXPIRE', kx, o.giveup + 60000)
  redis.call('PEXPIRE', kf, 3600000)
  return {0, ahead, ceiling}
end
