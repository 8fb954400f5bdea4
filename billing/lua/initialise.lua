-- KEYS: month, held, amounts. ARGV: spent from the ledger, the month keys' TTL (s).
-- Creates the month only if it is absent (reservations left without it are dropped: they
-- were never counted in it). Returns 1 when it created it.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'spent', ARGV[1], 'committed', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
