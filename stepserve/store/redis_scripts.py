"""The Lua scripts of the Redis store (redis.py): each runs atomically in Redis, one round trip. ARGV[1] is always
the key prefix; the comment above each script names the rest of its arguments. JSON comes from Python: the scripts
compare and copy it, decode only strings (a kind), and print the numbers they make (TIME, leases) with 17 digits, so
no float loses precision (cjson's encoder keeps 14)."""

COMMON = """
if redis.replicate_commands then redis.replicate_commands() end
local P = ARGV[1]
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function num(x) return string.format('%.17g', x) end
local function finished(status) return status == '"completed"' or status == '"failed"' end
local function service_of(value) return value and cjson.decode(value) or '' end
local function scoped(service) return P .. 'svc:' .. service .. ':' end
local function reindex(id, oldkind)
  local f = redis.call('HMGET', P .. 'job:' .. id, 'kind', 'status', 'created_at', 'completed_at', 'service')
  local kind, S = cjson.decode(f[1]), scoped(service_of(f[5]))
  if oldkind ~= nil and oldkind ~= kind then
    redis.call('ZREM', P .. 'jobs:' .. oldkind, id)
    redis.call('ZREM', S .. 'jobs:' .. oldkind, id)
    redis.call('ZREM', S .. 'open:' .. oldkind, id)
  end
  redis.call('ZADD', P .. 'jobs', f[3], id)
  redis.call('ZADD', P .. 'jobs:' .. kind, f[3], id)
  redis.call('ZADD', S .. 'jobs', f[3], id)
  redis.call('ZADD', S .. 'jobs:' .. kind, f[3], id)
  if finished(f[2]) then
    redis.call('ZREM', P .. 'open', id)
    redis.call('ZREM', S .. 'open:' .. kind, id)
    if f[4] == 'null' then redis.call('ZREM', P .. 'done', id) else redis.call('ZADD', P .. 'done', f[4], id) end
  else
    redis.call('ZADD', P .. 'open', f[3], id)
    redis.call('ZADD', S .. 'open:' .. kind, f[3], id)
    redis.call('ZREM', P .. 'done', id)
  end
end
local function forget(id)
  local key = P .. 'job:' .. id
  local doc = redis.call('HGETALL', key)
  if #doc == 0 then return false end
  local f = redis.call('HMGET', key, 'kind', '_idem', 'service')
  local kind, S = cjson.decode(f[1]), scoped(service_of(f[3]))
  if f[2] then redis.call('DEL', f[2]) end
  redis.call('DEL', key)
  redis.call('ZREM', P .. 'jobs', id)
  redis.call('ZREM', P .. 'jobs:' .. kind, id)
  redis.call('ZREM', P .. 'open', id)
  redis.call('ZREM', P .. 'done', id)
  redis.call('ZREM', S .. 'jobs', id)
  redis.call('ZREM', S .. 'jobs:' .. kind, id)
  redis.call('ZREM', S .. 'open:' .. kind, id)
  return doc
end
"""

SCRIPTS = {
    # ARGV: prefix, id, idempotency entry's key or '', the bound on unfinished jobs or '', the service's set of
    # unfinished jobs of the kind, then field, JSON value, ...
    "create": """
local id, idem = ARGV[2], ARGV[3]
if idem ~= '' then
  local other = redis.call('GET', idem)
  if other then
    local doc = redis.call('HGETALL', P .. 'job:' .. other)
    if #doc > 0 then return {0, doc} end
  end
end
local key = P .. 'job:' .. id
if redis.call('EXISTS', key) == 1 then return {-1} end
if ARGV[4] ~= '' then
  local unfinished = redis.call('ZCARD', ARGV[5])
  if unfinished >= tonumber(ARGV[4]) then return {-2, unfinished} end
end
redis.call('HSET', key, unpack(ARGV, 6))
if idem ~= '' then
  redis.call('SET', idem, id)
  redis.call('HSET', key, '_idem', idem)
end
reindex(id, nil)
return {1}
""",
    # ARGV: prefix, id, the owner's JSON or '' (no fence), then field, JSON value, ...
    "update": """
local id = ARGV[2]
local key = P .. 'job:' .. id
local f = redis.call('HMGET', key, 'owner', 'kind')
if not f[2] then return false end
if ARGV[3] ~= '' and f[1] ~= ARGV[3] then return false end
if #ARGV > 3 then
  redis.call('HSET', key, unpack(ARGV, 4))
  reindex(id, cjson.decode(f[2]))
end
return redis.call('HGETALL', key)
""",
    # ARGV: prefix, the owner's JSON, lease_s, a job id or '', the service's JSON or '' (any), max attempts or ''
    # (no limit), then the kinds. A job claimed max attempts times already ends failed (base.py: take), and the
    # next is taken. With a service: its sets of unfinished jobs, one per kind, oldest first across them. Returns
    # {the claimed job or 0, then each job it ended failed}.
    "claim": """
local t = now()
local kinds, service, most, failed = {}, ARGV[5], tonumber(ARGV[6]), {}
for i = 7, #ARGV do kinds[ARGV[i]] = true end
local function take(id)
  local key = P .. 'job:' .. id
  local f = redis.call('HMGET', key, 'kind', 'status', 'owner', 'lease_until', 'attempts', 'service')
  if not f[1] or not kinds[cjson.decode(f[1])] or finished(f[2]) then return nil end
  if service ~= '' and (f[6] or '""') ~= service then return nil end
  if f[3] ~= 'null' and tonumber(f[4]) >= t then return nil end
  local attempts = tonumber(f[5])
  if most and attempts >= most then
    redis.call('HSET', key, 'status', '"failed"', 'completed_at', num(t), 'owner', 'null', 'lease_until', '0.0',
               'error', cjson.encode({code = 'too_many_attempts', message = 'the job was started ' ..
                 string.format('%d', attempts) .. ' times and its process stopped before it finished each time; ' ..
                 'it is not run again'}))
    reindex(id, nil)
    failed[#failed + 1] = redis.call('HGETALL', key)
    return nil
  end
  redis.call('HSET', key, 'owner', ARGV[2], 'lease_until', num(t + tonumber(ARGV[3])),
             'attempts', string.format('%d', attempts + 1), 'status', '"queued"', 'progress', '0')
  return redis.call('HGETALL', key)
end
local function answer(got) return {got or 0, unpack(failed)} end
if ARGV[4] ~= '' then return answer(take(ARGV[4])) end
if service ~= '' then
  local open = {}
  for kind in pairs(kinds) do
    local found = redis.call('ZRANGE', scoped(cjson.decode(service)) .. 'open:' .. kind, 0, -1, 'WITHSCORES')
    for i = 1, #found, 2 do open[#open + 1] = {tonumber(found[i + 1]), found[i]} end
  end
  table.sort(open, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
  for _, entry in ipairs(open) do
    local got = take(entry[2])
    if got then return answer(got) end
  end
  return answer(nil)
end
local start = 0
while true do
  local ids = redis.call('ZRANGE', P .. 'open', start, start + 99)
  if #ids == 0 then return answer(nil) end
  for _, id in ipairs(ids) do
    local got = take(id)
    if got then return answer(got) end
  end
  start = start + 100
end
""",
    # ARGV: prefix, a model, the service's JSON, then the kinds: the jobs of before services made for that model
    # become the service's (a scan of every job: once, when a server starts)
    "adopt": """
local n = 0
for _, id in ipairs(redis.call('ZRANGE', P .. 'jobs', 0, -1)) do
  local f = redis.call('HMGET', P .. 'job:' .. id, 'service', 'meta')
  if (not f[1] or f[1] == '""') and f[2] then
    local meta = cjson.decode(f[2])
    if type(meta) == 'table' and meta.model == ARGV[2] then
      redis.call('HSET', P .. 'job:' .. id, 'service', ARGV[3])
      redis.call('ZREM', scoped('') .. 'jobs', id)
      for i = 4, #ARGV do
        redis.call('ZREM', scoped('') .. 'jobs:' .. ARGV[i], id)
        redis.call('ZREM', scoped('') .. 'open:' .. ARGV[i], id)
      end
      reindex(id, nil)
      n = n + 1
    end
  end
end
return n
""",
    # ARGV: prefix, the service, then the kinds: how many of its jobs of those kinds are unfinished
    "count": """
local n = 0
for i = 3, #ARGV do n = n + redis.call('ZCARD', scoped(ARGV[2]) .. 'open:' .. ARGV[i]) end
return n
""",
    # ARGV: prefix, id, the owner's JSON, '1' when the claim counts as an attempt, then field, JSON value, ... (the
    # hand-back's: base.py RELEASED). base.py's release, in Lua.
    "release": """
local id = ARGV[2]
local key = P .. 'job:' .. id
local f = redis.call('HMGET', key, 'owner', 'kind', 'attempts')
if not f[2] or f[1] ~= ARGV[3] then return false end
redis.call('HSET', key, unpack(ARGV, 5))
if ARGV[4] ~= '1' then
  redis.call('HSET', key, 'attempts', string.format('%d', math.max(0, tonumber(f[3]) - 1)))
end
reindex(id, cjson.decode(f[2]))
return redis.call('HGETALL', key)
""",
    # ARGV: prefix, id
    "delete": "return forget(ARGV[2])",
    # ARGV: prefix, finished before (a score)
    "sweep": """
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'done', '-inf', '(' .. ARGV[2])) do
  local doc = forget(id)
  if doc then out[#out + 1] = doc end
end
return out
""",
    # ARGV: prefix, kind or '', limit, then the service when one is given
    "list": """
local base = ARGV[4] and scoped(ARGV[4]) or P
local set = ARGV[2] == '' and base .. 'jobs' or base .. 'jobs:' .. ARGV[2]
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', set, 0, tonumber(ARGV[3]) - 1)) do
  out[#out + 1] = redis.call('HGETALL', P .. 'job:' .. id)
end
return out
""",
    # An adapter registration is the hash adapter:SERVICE/NAME; adapters holds the SERVICE/NAME of each (a
    # registration of before services: adapter:NAME, listed as NAME, service "").
    # ARGV: prefix, SERVICE/NAME, then field, JSON value, ...
    "register": """
local key = P .. 'adapter:' .. ARGV[2]
redis.call('DEL', key)
redis.call('HSET', key, unpack(ARGV, 3))
redis.call('ZADD', P .. 'adapters', 0, ARGV[2])
""",
    # ARGV: prefix, the service's JSON or '' (any)
    "adapters": """
local out = {}
for _, name in ipairs(redis.call('ZRANGE', P .. 'adapters', 0, -1)) do
  local doc = redis.call('HGETALL', P .. 'adapter:' .. name)
  if ARGV[2] == '' or (redis.call('HGET', P .. 'adapter:' .. name, 'service') or '""') == ARGV[2] then
    out[#out + 1] = doc
  end
end
return out
""",
    # ARGV: prefix, SERVICE/NAME
    "delete_adapter": """
local key = P .. 'adapter:' .. ARGV[2]
if redis.call('HGET', key, 'deleted_at') ~= 'null' then return false end
redis.call('HSET', key, 'deleted_at', num(now()))
return redis.call('HGETALL', key)
""",
    # ARGV: prefix, deleted before (a number)
    "sweep_adapters": """
local n = 0
for _, name in ipairs(redis.call('ZRANGE', P .. 'adapters', 0, -1)) do
  local deleted = redis.call('HGET', P .. 'adapter:' .. name, 'deleted_at')
  if not deleted or (deleted ~= 'null' and tonumber(deleted) < tonumber(ARGV[2])) then
    redis.call('DEL', P .. 'adapter:' .. name)
    redis.call('ZREM', P .. 'adapters', name)
    n = n + 1
  end
end
return n
""",
    # ARGV: prefix, replica, info's JSON, ttl_s
    "publish": """
local t, ttl = now(), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', P .. 'replicas', '-inf', '(' .. num(t))
redis.call('ZADD', P .. 'replicas', num(t + ttl), ARGV[2])
redis.call('SET', P .. 'replica:' .. ARGV[2], ARGV[3], 'PX', math.max(0, math.ceil(ttl * 1000)) + 1000)
""",
    # ARGV: prefix
    "replicas": """
local out = {}
for _, name in ipairs(redis.call('ZRANGEBYSCORE', P .. 'replicas', num(now()), '+inf')) do
  local info = redis.call('GET', P .. 'replica:' .. name)
  if info then
    out[#out + 1] = name
    out[#out + 1] = info
  end
end
return out
""",
}
