-- A queued request tries again for a slot (see acquire.lua for the arguments).
-- KEYS 1-5: running, queue, queue expiry, fair share, ceiling.
-- ARGV 1 request id  2 class  3 tenant  4 weight  5 cost  6 now_ms  7 lease_ms  8 budget
--      9 P2 allowed (1/0)  10 give-up ms  11 extra slots for P0
return try_slot(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], tonumber(ARGV[2]), ARGV[3],
  tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]),
  ARGV[9], tonumber(ARGV[10]), tonumber(ARGV[11]))
