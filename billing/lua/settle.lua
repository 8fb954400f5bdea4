-- After common.lua (billing/limits.py joins them).
-- KEYS: window, tokens, token_sum, month, held, amounts, settled marker.
-- ARGV: reservation id, now (us), cutoff (us), windowed ('1' or ''), actual tokens, window
-- key TTL (ms), actual cost, marker TTL (s). Returns {'duplicate'}, {'untracked'} (the
-- month is missing: the ledger has the cost) or {'settled', spent before, spent after}.
local window, tokens, token_sum, month, held, amounts = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local marker = KEYS[7]
local id, now, cost = ARGV[1], ARGV[2], ARGV[7]
if not redis.call('SET', marker, '1', 'NX', 'EX', ARGV[8]) then return {'duplicate'} end

if ARGV[4] == '1' then
    prune_window(window, tokens, token_sum, ARGV[3])
    local estimate = redis.call('HGET', tokens, id)
    if estimate then
        local delta = tonumber(ARGV[5]) - tonumber(estimate)
        if delta ~= 0 then
            redis.call('HSET', tokens, id, ARGV[5])
            redis.call('INCRBY', token_sum, delta)
            for _, key in ipairs({window, tokens, token_sum}) do redis.call('PEXPIRE', key, ARGV[6]) end
        end
    end
end

if redis.call('EXISTS', month) == 0 then
    redis.call('ZREM', held, id)
    redis.call('HDEL', amounts, id)
    return {'untracked'}
end
prune_held(month, held, amounts, now)
local reserved = redis.call('HGET', amounts, id)
if reserved then
    subtract(month, 'committed', reserved)
    redis.call('HDEL', amounts, id)
    redis.call('ZREM', held, id)
end
local before = redis.call('HGET', month, 'spent')
if cost ~= '0' then
    redis.call('HINCRBY', month, 'spent', cost)
    redis.call('HINCRBY', month, 'committed', cost)
end
return {'settled', before, redis.call('HGET', month, 'spent')}
