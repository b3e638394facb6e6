-- Tollgate prefix-aware routing: which replica of a model serves a request.
--
-- KEYS  1 the model's prefix table, a hash (prefix digest -> replica id)
--       2 its recency, a zset (prefix digest -> last use, ms), to forget the oldest
-- ARGV  1 one JSON array: now_ms, most entries kept, load factor, the request's prefix
--       digests (longest first), then per candidate replica [id, in flight, slots]
--
-- The longest of the request's prefixes that a replica served most recently names that
-- replica: its engine likely still holds the prefix's KV cache. It is taken while its in-
-- flight requests, this one included, stay within ceil(factor × the mean per slot after this
-- request × its slots) (consistent hashing with bounded loads); otherwise, and for a prefix never seen, the least-loaded replica is. The
-- request's full prefix (its first digest) is then recorded for the chosen replica, so
-- the next turn of the same conversation, which extends it, finds it — in every gateway
-- process. Returns the chosen replica id.
local A = cjson.decode(ARGV[1])
local now, most, factor, digests, replicas = A[1], A[2], A[3], A[4], A[5]

local total, slots, by_id = 1, 0, {}
for _, r in ipairs(replicas) do
  total = total + r[2]
  slots = slots + r[3]
  by_id[tostring(r[1])] = r
end

local chosen = nil
if #digests > 0 then
  local found = redis.call('HMGET', KEYS[1], unpack(digests))
  for _, replica in ipairs(found) do
    if replica then
      local r = by_id[replica]
      if r and r[2] + 1 <= math.ceil(factor * total / slots * r[3]) then chosen = r end
      break
    end
  end
end
if not chosen then
  -- Least loaded; among equals, the one a hash of the prefix ranks first, so that every
  -- gateway process places a new conversation alike and idle replicas share new ones.
  local best_rank = nil
  for _, r in ipairs(replicas) do
    local rank = #digests > 0 and redis.sha1hex(digests[1] .. ':' .. r[1]) or ''
    if not chosen or r[2] / r[3] < chosen[2] / chosen[3]
        or (r[2] / r[3] == chosen[2] / chosen[3] and rank < best_rank) then
      chosen, best_rank = r, rank
    end
  end
end

if #digests > 0 then
  redis.call('HSET', KEYS[1], digests[1], chosen[1])
  redis.call('ZADD', KEYS[2], now, digests[1])
  if redis.call('ZCARD', KEYS[2]) > most then
    local old = redis.call('ZPOPMIN', KEYS[2], 100)
    local names = {}
    for i = 1, #old, 2 do names[#names + 1] = old[i] end
    redis.call('HDEL', KEYS[1], unpack(names))
  end
  redis.call('PEXPIRE', KEYS[1], 86400000)
  redis.call('PEXPIRE', KEYS[2], 86400000)
end
return chosen[1]
