-- Tollgate admission queue: take one of a model's engine slots, or wait in a priority queue.
--
-- KEYS  1 running zset (request id -> lease deadline ms)   2 queue zset (request id -> rank)
--       3 queue expiry zset (request id -> give-up ms)      4 fair-share hash   5 ceiling
-- ARGV  1 request id  2 class (0 P0, 1 P1, 2 P2)  3 tenant id  4 tenant weight  5 cost (tokens)
--       6 now_ms  7 lease_ms  8 static budget  9 P2 allowed now (1/0)  10 queue give-up ms
--
-- Rank = class * 1e13 + virtual finish time: P0 before P1 before P2; inside a class, start-
-- time fair queueing by tokens (a tenant's virtual time advances by cost / weight), so one
-- tenant's burst cannot starve another's. A request takes a slot only when no better-ranked
-- request waits. Returns {1, running, ceiling} when admitted, {0, ahead, ceiling} when queued.

local rid, class = ARGV[1], tonumber(ARGV[2])
local now, lease = tonumber(ARGV[6]), tonumber(ARGV[7])
local CLASS = 1e13

-- Leases and queue entries of gateways that died expire on their own.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 200)
if #gone > 0 then
  redis.call('ZREM', KEYS[2], unpack(gone))
  redis.call('ZREM', KEYS[3], unpack(gone))
end

local ceiling = tonumber(redis.call('GET', KEYS[5]) or ARGV[8])
if ceiling < 1 then ceiling = 1 end

local rank = tonumber(redis.call('ZSCORE', KEYS[2], rid) or '-1')
if rank < 0 then
  local tenant, weight, cost = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  local v = tonumber(redis.call('HGET', KEYS[4], '_v' .. class) or '0')
  local last = tonumber(redis.call('HGET', KEYS[4], tenant .. ':' .. class) or '0')
  local start = math.max(v, last)
  redis.call('HSET', KEYS[4], tenant .. ':' .. class, start + cost / weight)
  rank = class * CLASS + start
end

local running = redis.call('ZCARD', KEYS[1])
local ahead = redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. rank)
local may_run = running < ceiling and (class < 2 or ARGV[9] == '1')

if may_run and ahead == 0 then
  redis.call('ZREM', KEYS[2], rid)
  redis.call('ZREM', KEYS[3], rid)
  redis.call('ZADD', KEYS[1], now + lease, rid)
  redis.call('PEXPIRE', KEYS[1], lease)
  -- The class's virtual time moves to the start tag of what it last served.
  redis.call('HSET', KEYS[4], '_v' .. class, rank - class * CLASS)
  redis.call('PEXPIRE', KEYS[4], 3600000)
  return {1, running + 1, ceiling}
end

redis.call('ZADD', KEYS[2], rank, rid)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[10]), rid)
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[10]) + 60000)
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[10]) + 60000)
redis.call('PEXPIRE', KEYS[4], 3600000)
return {0, ahead, ceiling}
