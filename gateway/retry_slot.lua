-- A queued request tries again for a slot (see acquire.lua for the options).
-- KEYS 1-9: the model's pool (core.keyspace.pool_keys); 10 the delivered-token checkpoints
--      hash: a granted slot puts the request on it (it goes to an engine now); 11 the open
--      requests zset (queue entries of requests no longer open are dropped).
-- ARGV 1: one JSON array: request id, class, tenant, weight, cost, now_ms, lease_ms, budget,
--      P2 allowed ('1'/'0'), give-up ms, predicted tokens, KV capacity, headroom window ms,
--      headroom max slots, may preempt (0/1), may be preempted (0/1), at the head of its
--      class (0/1), preemption channel.
local A = cjson.decode(ARGV[1])
local slot = try_slot(KEYS, {rid = A[1], class = tonumber(A[2]), tenant = A[3],
  weight = tonumber(A[4]), cost = tonumber(A[5]), now = tonumber(A[6]), lease = tonumber(A[7]),
  budget = tonumber(A[8]), p2 = A[9], giveup = tonumber(A[10]), kv = tonumber(A[11]),
  kvcap = tonumber(A[12]), hwin = tonumber(A[13]), hmax = tonumber(A[14]),
  preempt = tonumber(A[15]), victim = tonumber(A[16]), head = tonumber(A[17]), chan = A[18],
  open = KEYS[11], fresh = false})
if slot[1] == 1 and KEYS[10] then redis.call('HSET', KEYS[10], A[1], '0,0,0,0') end
return slot
