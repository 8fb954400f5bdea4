-- After common.lua (billing/limits.py joins them).
-- KEYS: month, held, amounts. ARGV: now (us). Returns false (the month is missing) or
-- {spent, committed, in flight}.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
prune_held(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
return {redis.call('HGET', KEYS[1], 'spent'), redis.call('HGET', KEYS[1], 'committed'), redis.call('ZCARD', KEYS[2])}
