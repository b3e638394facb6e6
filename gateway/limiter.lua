-- Tollgate admission: sliding-window rate limits, concurrency and quota in one atomic call.
--
-- KEYS  1 key requests zset   2 key tokens hash    3 tenant requests zset  4 tenant tokens hash
--       5 key in-flight zset   6 tenant in-flight zset   7 quota hash
--       8-16 the model's engine pool (core.keyspace.pool_keys: running, queue, queue expiry,
--       fair share, ceiling, in-flight tokens, recent demand, preemptible holders, preemptions)
--       17 open requests zset (request id -> lease deadline)  18 open requests hash (-> record)
--       19 delivered-token checkpoints hash (an entry: the engine has taken the request)
-- ARGV  1 now_ms  2 request id  3 estimated tokens  4 window_ms
--       5 key rpm  6 key tpm  7 tenant rpm  8 tenant tpm  9 key max concurrent  10 tenant max concurrent
--       11 quota tokens  12 quota money (nano)  13 estimated money (nano)  14 in-flight deadline_ms
--       15 quota ttl seconds  16 class  17 tenant weight  18 static budget  19 P2 allowed
--       20 slot lease ms  21 queue give-up ms  22 tenant id  23 open-request record (JSON)
--       24 open-request lease deadline ms  25 predicted in-flight tokens
--       26 KV-cache capacity (tokens, 0: unknown)  27 headroom window ms  28 headroom max slots
--       29 may preempt (0/1)  30 may be preempted (0/1)  31 preemption channel (see acquire.lua)
-- Limits of 0 are off. A window is a zset (request id -> admission time) plus a hash
-- (request id -> tokens, "_sum" -> total); entries older than the window are pruned here,
-- each exactly once and a bounded number per call (see prune), and never counted once
-- expired, so the decision is exact at any instant (no fixed-window edge).
--
-- Returns {code, retry_ms, limit_req, remaining_req, reset_req_ms, limit_tok, remaining_tok, reset_tok_ms,
--          slot}: once admitted, the request also tries for an engine slot in the same call
--          (slot 1: it has one; 0: it is queued — see acquire.lua).
-- code: 0 admitted, 1/2 requests per minute (key/tenant), 3/4 tokens per minute (key/tenant),
--       5/6 concurrency (key/tenant), 7 token quota, 8 money quota, 9 larger than the tpm limit.
-- The arguments arrive as ONE JSON array in ARGV[1] (A below): one argument to encode
-- and send instead of dozens, which is most of the client's cost per call.
local A = cjson.decode(ARGV[1])

local now = tonumber(A[1])
local rid = A[2]
local est = tonumber(A[3])
local window = tonumber(A[4])
local cutoff = now - window

-- Pruning is bounded per call: after a burst (5,000 requests a second on one key leave
-- 300,000 entries that expire over the next minute) a call removes at most PRUNE_MAX of
-- them, so no request pays for the burst's whole tail. What is left expired but unpruned
-- (the backlog) still never counts: the request count subtracts it exactly (one ZCOUNT),
-- and the token total, which still includes it, is only an over-estimate — a request that
-- fits under it fits; one that does not makes the call prune up to DRAIN_MAX more first.
local PRUNE_MAX, DRAIN_MAX = 256, 4096
local backlog = {}
local function prune_some(z, h, most)
  local expired = redis.call('ZRANGEBYSCORE', z, '-inf', cutoff, 'LIMIT', 0, most)
  if #expired > 0 then
    local values = redis.call('HMGET', h, unpack(expired))
    local freed = 0
    for _, v in ipairs(values) do if v then freed = freed + tonumber(v) end end
    redis.call('ZREM', z, unpack(expired))
    redis.call('HDEL', h, unpack(expired))
    if freed ~= 0 then redis.call('HINCRBY', h, '_sum', -freed) end
  end
  if #expired < most then
    backlog[z] = 0
  else
    backlog[z] = redis.call('ZCOUNT', z, '-inf', cutoff)
  end
end
local function prune(z, h) prune_some(z, h, PRUNE_MAX) end

-- The oldest live entry's admission time in a window (or nil), read once per window.
local oldest_seen = {}
local function oldest(z)
  if oldest_seen[z] == nil then
    local first = redis.call('ZRANGE', z, backlog[z], backlog[z], 'WITHSCORES')
    oldest_seen[z] = first[2] and tonumber(first[2]) or false
  end
  return oldest_seen[z] or nil
end

-- Requests: admitted when one more fits; else wait until the oldest needed entry leaves.
local function check_requests(z, limit)
  if limit <= 0 then return 0, -1, 0 end
  local n = redis.call('ZCARD', z) - backlog[z]
  if n + 1 > limit then
    local at = backlog[z] + n - limit
    local e = redis.call('ZRANGE', z, at, at, 'WITHSCORES')
    return tonumber(e[2]) + window - now, 0, tonumber(e[2]) + window - now
  end
  local reset = 0
  if n > 0 then reset = oldest(z) + window - now end
  return 0, limit - n - 1, reset
end

-- Tokens: admitted when the estimate fits; else wait until enough old tokens leave (read
-- oldest first, at most SCAN_MAX entries: beyond them the wait is a lower bound).
local SCAN_MAX = 1024
local function check_tokens(z, h, limit)
  if limit <= 0 then return 0, -1, 0 end
  local used = tonumber(redis.call('HGET', h, '_sum') or '0')
  if used + est > limit and backlog[z] > 0 then
    prune_some(z, h, DRAIN_MAX)
    oldest_seen[z] = nil
    used = tonumber(redis.call('HGET', h, '_sum') or '0')
    -- Still more than DRAIN_MAX expired entries behind: their tokens are not known here
    -- without reading them all, so the request is refused briefly (its retry drains more).
    if used + est > limit and backlog[z] > 0 then return 100, 0, 100 end
  end
  if used + est <= limit then
    local reset = 0
    if used > 0 then
      local first = oldest(z)
      if first then reset = first + window - now end
    end
    return 0, limit - used - est, reset
  end
  local need = used + est - limit
  local freed, last = 0, nil
  for start = 0, SCAN_MAX - 1, 256 do
    local entries = redis.call('ZRANGE', z, start, start + 255, 'WITHSCORES')
    if #entries == 0 then break end
    local ids = {}
    for i = 1, #entries, 2 do ids[#ids + 1] = entries[i] end
    local values = redis.call('HMGET', h, unpack(ids))
    for i, v in ipairs(values) do
      freed = freed + tonumber(v or '0')
      last = tonumber(entries[2 * i])
      if freed >= need then
        local wait = last + window - now
        return wait, 0, wait
      end
    end
  end
  if last then
    local wait = math.max(last + window - now, 1)
    return wait, 0, wait
  end
  return window, 0, window
end

-- Entries past their deadline (gateways that died) are only looked for when they would
-- make the difference.
local function check_concurrency(z, limit)
  if limit <= 0 then return true end
  if redis.call('ZCARD', z) < limit then return true end
  redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
  return redis.call('ZCARD', z) < limit
end

local key_rpm, key_tpm = tonumber(A[5]), tonumber(A[6])
local ten_rpm, ten_tpm = tonumber(A[7]), tonumber(A[8])
local key_cc, ten_cc = tonumber(A[9]), tonumber(A[10])
local quota_tokens, quota_money = tonumber(A[11]), tonumber(A[12])
local est_money = tonumber(A[13])

prune(KEYS[1], KEYS[2])
prune(KEYS[3], KEYS[4])

local best_req_limit, best_req_rem, best_req_reset = -1, -1, 0
local best_tok_limit, best_tok_rem, best_tok_reset = -1, -1, 0

-- The binding (smallest remaining) scope is what the x-ratelimit-* headers report.
local function keep_req(limit, rem, reset)
  if limit > 0 and (best_req_rem < 0 or rem < best_req_rem) then
    best_req_limit, best_req_rem, best_req_reset = limit, rem, reset
  end
end
local function keep_tok(limit, rem, reset)
  if limit > 0 and (best_tok_rem < 0 or rem < best_tok_rem) then
    best_tok_limit, best_tok_rem, best_tok_reset = limit, rem, reset
  end
end
local function refuse(code, wait)
  return {code, wait, best_req_limit, best_req_rem, best_req_reset, best_tok_limit, best_tok_rem, best_tok_reset, 0}
end

if (key_tpm > 0 and est > key_tpm) or (ten_tpm > 0 and est > ten_tpm) then
  keep_tok(key_tpm > 0 and key_tpm or ten_tpm, 0, 0)
  return refuse(9, 0)
end

local wait, rem, reset = check_requests(KEYS[1], key_rpm)
keep_req(key_rpm, rem, reset)
if wait > 0 then return refuse(1, wait) end
wait, rem, reset = check_requests(KEYS[3], ten_rpm)
keep_req(ten_rpm, rem, reset)
if wait > 0 then return refuse(2, wait) end
wait, rem, reset = check_tokens(KEYS[1], KEYS[2], key_tpm)
keep_tok(key_tpm, rem, reset)
if wait > 0 then return refuse(3, wait) end
wait, rem, reset = check_tokens(KEYS[3], KEYS[4], ten_tpm)
keep_tok(ten_tpm, rem, reset)
if wait > 0 then return refuse(4, wait) end
if not check_concurrency(KEYS[5], key_cc) then return refuse(5, 1000) end
if not check_concurrency(KEYS[6], ten_cc) then return refuse(6, 1000) end

if quota_tokens > 0 or quota_money > 0 then
  local q = redis.call('HMGET', KEYS[7], 'tokens_used', 'tokens_reserved', 'money_used', 'money_reserved')
  local t_used = tonumber(q[1] or '0') + tonumber(q[2] or '0')
  local m_used = tonumber(q[3] or '0') + tonumber(q[4] or '0')
  if quota_tokens > 0 and t_used + est > quota_tokens then return refuse(7, 0) end
  if quota_money > 0 and m_used + est_money > quota_money then return refuse(8, 0) end
end

-- Admitted: record the request in every window, in-flight set and the quota reservation.
local deadline = tonumber(A[14])
for _, pair in ipairs({{KEYS[1], KEYS[2], key_rpm + key_tpm}, {KEYS[3], KEYS[4], ten_rpm + ten_tpm}}) do
  if pair[3] > 0 then
    redis.call('ZADD', pair[1], now, rid)
    redis.call('HSET', pair[2], rid, est)
    redis.call('HINCRBY', pair[2], '_sum', est)
    redis.call('PEXPIRE', pair[1], window)
    redis.call('PEXPIRE', pair[2], window)
  end
end
for _, pair in ipairs({{KEYS[5], key_cc}, {KEYS[6], ten_cc}}) do
  if pair[2] > 0 then
    redis.call('ZADD', pair[1], deadline, rid)
    redis.call('PEXPIREAT', pair[1], deadline)
  end
end
redis.call('HINCRBY', KEYS[7], 'tokens_reserved', est)
redis.call('HINCRBY', KEYS[7], 'money_reserved', est_money)
redis.call('EXPIRE', KEYS[7], tonumber(A[15]))
-- Until it settles, the request is on record: if its gateway dies, a reaper bills what it
-- delivered (see gateway/orphans.py).
redis.call('ZADD', KEYS[17], tonumber(A[24]), rid)
redis.call('HSET', KEYS[18], rid, A[23])
local slot = try_slot({KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13], KEYS[14],
  KEYS[15], KEYS[16]},
  {rid = rid, class = tonumber(A[16]), tenant = A[22], weight = tonumber(A[17]), cost = est,
   now = now, lease = tonumber(A[20]), budget = tonumber(A[18]), p2 = A[19],
   giveup = tonumber(A[21]), kv = tonumber(A[25]), kvcap = tonumber(A[26]),
   hwin = tonumber(A[27]), hmax = tonumber(A[28]), preempt = tonumber(A[29]),
   victim = tonumber(A[30]), head = 0, chan = A[31], open = KEYS[17], fresh = true})
-- A slot means the request goes to an engine now: from here its prompt is billed even if its
-- gateway dies before any usage arrives (gateway/orphans.py).
if slot[1] == 1 then redis.call('HSET', KEYS[19], rid, '0,0,0,0') end
return {0, 0, best_req_limit, best_req_rem, best_req_reset, best_tok_limit, best_tok_rem, best_tok_reset, slot[1]}
