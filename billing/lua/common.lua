-- Shared by the scripts. Amounts are canonical decimal strings of non-negative integers
-- (Python's str(int) and Redis's replies): compared by length then lexically, changed only by
-- HINCRBY with the string itself (a Lua number would be a double). Times and token counts
-- are numbers: microseconds since 1970 stay below 2^53, exact in a double.
local function less(a, b)
    if #a ~= #b then return #a < #b end
    return a < b
end

local function subtract(key, field, amount)
    if amount ~= '0' then redis.call('HINCRBY', key, field, '-' .. amount) end
end

-- unpack() is bounded by Lua's stack: long lists go in slices.
local function each_slice(items, fn)
    for i = 1, #items, 1000 do
        fn({unpack(items, i, math.min(i + 999, #items))})
    end
end

-- Window entries admitted at or before the cutoff (now - 60 s) leave, with their tokens.
local function prune_window(window, tokens, token_sum, cutoff)
    local old = redis.call('ZRANGEBYSCORE', window, '-inf', cutoff)
    if #old == 0 then return end
    local freed = 0
    each_slice(old, function(ids)
        for _, n in ipairs(redis.call('HMGET', tokens, unpack(ids))) do
            freed = freed + (tonumber(n) or 0)
        end
        redis.call('HDEL', tokens, unpack(ids))
    end)
    redis.call('ZREMRANGEBYSCORE', window, '-inf', cutoff)
    if freed ~= 0 then redis.call('DECRBY', token_sum, freed) end
end

-- Reservations whose expiry has come stop counting (their process died, or never settled).
local function prune_held(month, held, amounts, now)
    local gone = redis.call('ZRANGEBYSCORE', held, '-inf', now)
    if #gone == 0 then return end
    each_slice(gone, function(ids)
        for _, amount in ipairs(redis.call('HMGET', amounts, unpack(ids))) do
            if amount then subtract(month, 'committed', amount) end
        end
        redis.call('HDEL', amounts, unpack(ids))
    end)
    redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
end
