-- Keep a finished /v1/responses answer (gateway/response_store.py) in one atomic call: the
-- record every gateway process reads a previous_response_id from, and its entry on the
-- stream the persister writes to PostgreSQL from.
-- KEYS  1 the record's key  2 the responses log stream
-- ARGV  1 the record (JSON)  2 its TTL in seconds
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'op', 'put', 'r', ARGV[1])
return 1
