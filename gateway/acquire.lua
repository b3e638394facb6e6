-- Tollgate admission queue: take one of a model's engine slots, or wait in a priority queue.
--
-- try_slot(kr, kq, kx, kf, kc, rid, class, tenant, weight, cost, now, lease, budget, p2, giveup, p0extra)
--   kr running zset (request id -> lease deadline ms)   kq queue zset (request id -> rank)
--   kx queue expiry zset (request id -> give-up ms)      kf fair-share hash   kc ceiling
--   class 0 P0, 1 P1, 2 P2; cost in tokens; p2 '1' when engines have spare capacity;
--   p0extra: slots P0 may use beyond the ceiling when the engines preempt by priority
--   themselves (vLLM --scheduling-policy priority): P0 then never waits behind P2.
--
-- Rank = class * 1e13 + virtual start time: P0 before P1 before P2; inside a class, start-
-- time fair queueing by tokens (a tenant's virtual time advances by cost / weight), so one
-- tenant's burst cannot starve another's. A request takes a slot only when no better-ranked
-- request waits. Returns {1, running, ceiling} when admitted, {0, ahead, ceiling} when queued.
local function try_slot(kr, kq, kx, kf, kc, rid, class, tenant, weight, cost, now, lease, budget, p2, giveup, p0extra)
  local CLASS = 1e13
  -- Leases and queue entries of gateways that died expire on their own.
  redis.call('ZREMRANGEBYSCORE', kr, '-inf', now)
  local gone = redis.call('ZRANGEBYSCORE', kx, '-inf', now, 'LIMIT', 0, 200)
  if #gone > 0 then
    redis.call('ZREM', kq, unpack(gone))
    redis.call('ZREM', kx, unpack(gone))
  end
  local ceiling = tonumber(redis.call('GET', kc) or budget)
  if ceiling < 1 then ceiling = 1 end
  local limit = ceiling
  if class == 0 then limit = ceiling + (p0extra or 0) end

  local rank = tonumber(redis.call('ZSCORE', kq, rid) or '-1')
  if rank < 0 then
    local v = tonumber(redis.call('HGET', kf, '_v' .. class) or '0')
    local last = tonumber(redis.call('HGET', kf, tenant .. ':' .. class) or '0')
    local start = math.max(v, last)
    redis.call('HSET', kf, tenant .. ':' .. class, start + cost / weight)
    rank = class * CLASS + start
  end

  local running = redis.call('ZCARD', kr)
  local ahead = redis.call('ZCOUNT', kq, '-inf', '(' .. rank)
  if running < limit and (class < 2 or p2 == '1') and ahead == 0 then
    redis.call('ZREM', kq, rid)
    redis.call('ZREM', kx, rid)
    redis.call('ZADD', kr, now + lease, rid)
    redis.call('PEXPIRE', kr, lease)
    -- The class's virtual time moves to the start tag of what it last served.
    redis.call('HSET', kf, '_v' .. class, rank - class * CLASS)
    redis.call('PEXPIRE', kf, 3600000)
    return {1, running + 1, ceiling}
  end
  redis.call('ZADD', kq, rank, rid)
  redis.call('ZADD', kx, now + giveup, rid)
  redis.call('PEXPIRE', kq, giveup + 60000)
  redis.call('PEXPIRE', kx, giveup + 60000)
  redis.call('PEXPIRE', kf, 3600000)
  return {0, ahead, ceiling}
end
