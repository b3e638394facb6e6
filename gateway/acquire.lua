-- Tollgate admission queue: take one of a model's engine slots, or wait in a priority queue.
--
-- try_slot(kr, kq, kx, kf, kc, rid, class, tenant, weight, cost, now, lease, budget, p2, giveup, p0extra, fresh)
--   kr running zset (request id -> lease deadline ms)   kq queue zset (request id -> rank)
--   kx queue expiry zset (request id -> give-up ms)      kf fair-share hash   kc ceiling
--   class 0 P0, 1 P1, 2 P2; cost in tokens; p2 '1' when engines have spare capacity;
--   p0extra: slots P0 may use beyond the ceiling when the engines preempt by priority
--   themselves (vLLM --scheduling-policy priority): P0 then never waits behind P2;
--   fresh: true when called by admission (the request is not in the queue yet).
--
-- Rank = class * 1e13 + virtual start time: P0 before P1 before P2; inside a class, start-
-- time fair queueing by tokens (a tenant's virtual time advances by cost / weight), so one
-- tenant's burst cannot starve another's. A request takes a slot only when no better-ranked
-- request waits. Returns {1, running, ceiling} when admitted, {0, ahead, ceiling} when queued.
local function try_slot(kr, kq, kx, kf, kc, rid, class, tenant, weight, cost, now, lease, budget, p2, giveup, p0extra, fresh)
  local CLASS = 1e13
  local ceiling = tonumber(redis.call('GET', kc) or budget)
  if ceiling < 1 then ceiling = 1 end
  local limit = ceiling
  if class == 0 then limit = ceiling + (p0extra or 0) end

  -- A fresh request (from admission) cannot be queued yet; a retry has its rank.
  local rank, tag = -1, nil
  if not fresh then rank = tonumber(redis.call('ZSCORE', kq, rid) or '-1') end
  if rank < 0 then
    local vt = redis.call('HMGET', kf, '_v' .. class, tenant .. ':' .. class)
    local start = math.max(tonumber(vt[1] or '0'), tonumber(vt[2] or '0'))
    tag = start + cost / weight
    rank = class * CLASS + start
  end

  -- Leases and queue entries of gateways that died expire on their own; they only matter
  -- (and are only looked for) when they would keep this request waiting.
  local running = redis.call('ZCARD', kr)
  if running >= limit then
    redis.call('ZREMRANGEBYSCORE', kr, '-inf', now)
    running = redis.call('ZCARD', kr)
  end
  local ahead = redis.call('ZCOUNT', kq, '-inf', '(' .. rank)
  if ahead > 0 then
    local gone = redis.call('ZRANGEBYSCORE', kx, '-inf', now, 'LIMIT', 0, 200)
    if #gone > 0 then
      redis.call('ZREM', kq, unpack(gone))
      redis.call('ZREM', kx, unpack(gone))
      ahead = redis.call('ZCOUNT', kq, '-inf', '(' .. rank)
    end
  end
  if running < limit and (class < 2 or p2 == '1') and ahead == 0 then
    if not fresh then
      redis.call('ZREM', kq, rid)
      redis.call('ZREM', kx, rid)
    end
    redis.call('ZADD', kr, now + lease, rid)
    redis.call('PEXPIRE', kr, lease)
    -- The class's virtual time moves to the start tag of what it last served.
    if tag then
      redis.call('HSET', kf, '_v' .. class, rank - class * CLASS, tenant .. ':' .. class, tag)
    else
      redis.call('HSET', kf, '_v' .. class, rank - class * CLASS)
    end
    redis.call('PEXPIRE', kf, 3600000)
    return {1, running + 1, ceiling}
  end
  if tag then redis.call('HSET', kf, tenant .. ':' .. class, tag) end
  redis.call('ZADD', kq, rank, rid)
  redis.call('ZADD', kx, now + giveup, rid)
  redis.call('PEXPIRE', kq, giveup + 60000)
  redis.call('PEXPIRE', kx, giveup + 60000)
  redis.call('PEXPIRE', kf, 3600000)
  return {0, ahead, ceiling}
end
