-- After common.lua (billing/limits.py joins them).
-- KEYS: window, tokens, token_sum, month, held, amounts.
-- ARGV: reservation id, now (us), cutoff (us), rpm, tpm ('' = unlimited), estimated tokens,
-- window key TTL (ms), budget ('' = none), reserved amount, reservation expiry (us), month
-- keys' TTL (s). Returns {'ok', spent, committed} (before this reservation),
-- {'init'} (the month is missing), {'budget', spent, committed, in flight},
-- {'rpm', count, retry_us} or {'tpm', used, retry_us} (retry_us -1: never).
local window, tokens, token_sum, month, held, amounts = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, now, cutoff = ARGV[1], ARGV[2], tonumber(ARGV[3])
local rpm, tpm, estimate = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local budget, reserve = ARGV[8], ARGV[9]
local budgeted, windowed = budget ~= '', (rpm ~= nil or tpm ~= nil)

local spent, committed = '0', '0'
if budgeted then
    if redis.call('EXISTS', month) == 0 then return {'init'} end
    prune_held(month, held, amounts, now)
    spent = redis.call('HGET', month, 'spent')
    committed = redis.call('HGET', month, 'committed')
    if not less(committed, budget) then
        return {'budget', spent, committed, redis.call('ZCARD', held)}
    end
end
if windowed then prune_window(window, tokens, token_sum, ARGV[3]) end
if rpm then
    local count = redis.call('ZCARD', window)
    if count >= rpm then
        if rpm == 0 then return {'rpm', count, -1} end
        -- count - rpm + 1 entries must leave; the last of them is at index count - rpm.
        local entry = redis.call('ZRANGE', window, count - rpm, count - rpm, 'WITHSCORES')
        return {'rpm', count, tonumber(entry[2]) - cutoff}
    end
end
if tpm then
    local used = tonumber(redis.call('GET', token_sum) or '0')
    if estimate > tpm then return {'tpm', used, -1} end
    if used + estimate > tpm then
        local excess, freed, start = used + estimate - tpm, 0, 0
        while true do
            local slice = redis.call('ZRANGE', window, start, start + 99, 'WITHSCORES')
            if #slice == 0 then break end
            for i = 1, #slice, 2 do
                freed = freed + (tonumber(redis.call('HGET', tokens, slice[i])) or 0)
                if freed >= excess then return {'tpm', used, tonumber(slice[i + 1]) - cutoff} end
            end
            start = start + 100
        end
        return {'tpm', used, now - cutoff}  -- entries lost their tokens: a whole window
    end
end

if windowed then
    redis.call('ZADD', window, now, id)
    redis.call('HSET', tokens, id, estimate)
    redis.call('INCRBY', token_sum, estimate)
    for _, key in ipairs({window, tokens, token_sum}) do redis.call('PEXPIRE', key, ARGV[7]) end
end
if budgeted then
    redis.call('HINCRBY', month, 'committed', reserve)
    redis.call('ZADD', held, ARGV[10], id)
    redis.call('HSET', amounts, id, reserve)
    redis.call('EXPIRE', held, ARGV[11])
    redis.call('EXPIRE', amounts, ARGV[11])
end
return {'ok', spent, committed}
