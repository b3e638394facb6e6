-- Tollgate settlement: when a request ends, replace its token estimate with what it really
-- used, release its in-flight slots and quota reservation, and append its usage event —
-- all in one atomic call, so usage is counted once or not at all.
--
-- KEYS  1 key tokens hash  2 tenant tokens hash  3 key in-flight zset  4 tenant in-flight zset
--       5 quota hash  6 usage stream  7 settled marker (makes a retried settle a no-op)
--       8 the model's running-slots zset  9 the model's admission queue zset
--       10 open requests zset  11 open requests hash  12 delivered-token checkpoints hash
--       13 the model's in-flight tokens hash (see acquire.lua)  14 its preemptible holders
-- ARGV  1 request id  2 estimated tokens  3 actual tokens  4 estimated money (nano)
--       5 actual money (nano)  6 usage event (JSON, empty: none)  7 wake channel  8 model id
-- The arguments arrive as ONE JSON array in ARGV[1] (A below): one argument to encode
-- and send instead of dozens, which is most of the client's cost per call.
local A = cjson.decode(ARGV[1])

local rid = A[1]
if not redis.call('SET', KEYS[7], '1', 'NX', 'EX', 3600) then return 0 end
local est, actual = tonumber(A[2]), tonumber(A[3])
local est_money, actual_money = tonumber(A[4]), tonumber(A[5])

-- Only windows that still hold the request are corrected: older usage has left them.
for _, h in ipairs({KEYS[1], KEYS[2]}) do
  if redis.call('HEXISTS', h, rid) == 1 then
    redis.call('HINCRBY', h, rid, actual - est)
    redis.call('HINCRBY', h, '_sum', actual - est)
  end
end
redis.call('ZREM', KEYS[3], rid)
redis.call('ZREM', KEYS[4], rid)

local function release(field, amount)
  if amount == 0 then return end  -- Lua would send "-0", which HINCRBY refuses
  local left = redis.call('HINCRBY', KEYS[5], field, -amount)
  if left < 0 then redis.call('HSET', KEYS[5], field, 0) end
end
if redis.call('EXISTS', KEYS[5]) == 1 then
  release('tokens_reserved', est)
  release('money_reserved', est_money)
  redis.call('HINCRBY', KEYS[5], 'tokens_used', actual)
  redis.call('HINCRBY', KEYS[5], 'money_used', actual_money)
end
redis.call('ZREM', KEYS[10], rid)
redis.call('HDEL', KEYS[11], rid)
redis.call('HDEL', KEYS[12], rid)
-- Free the engine slot; a waiting request (in any gateway process) can take it now.
local freed = redis.call('ZREM', KEYS[8], rid) == 1
if KEYS[14] then redis.call('ZREM', KEYS[14], rid) end
local held = redis.call('HGET', KEYS[13], rid)
if held then
  local n = tonumber(held)
  local class = n % 4
  redis.call('HDEL', KEYS[13], rid)
  if n - class ~= 0 then redis.call('HINCRBY', KEYS[13], '_tok', -(n - class) / 4) end
  redis.call('HINCRBY', KEYS[13], '_c' .. class, -1)
end
if freed and redis.call('ZCARD', KEYS[9]) > 0 then
  redis.call('PUBLISH', A[7], A[8])
end
if A[6] ~= '' then
  redis.call('XADD', KEYS[6], '*', 'e', A[6])
end
return 1
