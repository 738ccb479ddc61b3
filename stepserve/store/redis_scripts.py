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
local function reindex(id, oldkind)
  local f = redis.call('HMGET', P .. 'job:' .. id, 'kind', 'status', 'created_at', 'completed_at')
  local kind = cjson.decode(f[1])
  if oldkind ~= nil and oldkind ~= kind then redis.call('ZREM', P .. 'jobs:' .. oldkind, id) end
  redis.call('ZADD', P .. 'jobs', f[3], id)
  redis.call('ZADD', P .. 'jobs:' .. kind, f[3], id)
  if finished(f[2]) then
    redis.call('ZREM', P .. 'open', id)
    if f[4] == 'null' then redis.call('ZREM', P .. 'done', id) else redis.call('ZADD', P .. 'done', f[4], id) end
  else
    redis.call('ZADD', P .. 'open', f[3], id)
    redis.call('ZREM', P .. 'done', id)
  end
end
local function forget(id)
  local key = P .. 'job:' .. id
  local doc = redis.call('HGETALL', key)
  if #doc == 0 then return false end
  local f = redis.call('HMGET', key, 'kind', '_idem')
  if f[2] then redis.call('DEL', f[2]) end
  redis.call('DEL', key)
  redis.call('ZREM', P .. 'jobs', id)
  redis.call('ZREM', P .. 'jobs:' .. cjson.decode(f[1]), id)
  redis.call('ZREM', P .. 'open', id)
  redis.call('ZREM', P .. 'done', id)
  return doc
end
"""

SCRIPTS = {
    # ARGV: prefix, id, idempotency entry's key or '', then field, JSON value, ...
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
redis.call('HSET', key, unpack(ARGV, 4))
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
    # ARGV: prefix, the owner's JSON, lease_s, a job id or '', then the kinds
    "claim": """
local t = now()
local kinds = {}
for i = 5, #ARGV do kinds[ARGV[i]] = true end
local function take(id)
  local key = P .. 'job:' .. id
  local f = redis.call('HMGET', key, 'kind', 'status', 'owner', 'lease_until', 'attempts')
  if not f[1] or not kinds[cjson.decode(f[1])] or finished(f[2]) then return nil end
  if f[3] ~= 'null' and tonumber(f[4]) >= t then return nil end
  redis.call('HSET', key, 'owner', ARGV[2], 'lease_until', num(t + tonumber(ARGV[3])),
             'attempts', string.format('%d', tonumber(f[5]) + 1), 'status', '"queued"', 'progress', '0')
  return redis.call('HGETALL', key)
end
if ARGV[4] ~= '' then return take(ARGV[4]) or false end
local start = 0
while true do
  local ids = redis.call('ZRANGE', P .. 'open', start, start + 99)
  if #ids == 0 then return false end
  for _, id in ipairs(ids) do
    local got = take(id)
    if got then return got end
  end
  start = start + 100
end
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
    # ARGV: prefix, kind or '', limit
    "list": """
local set = ARGV[2] == '' and P .. 'jobs' or P .. 'jobs:' .. ARGV[2]
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', set, 0, tonumber(ARGV[3]) - 1)) do
  out[#out + 1] = redis.call('HGETALL', P .. 'job:' .. id)
end
return out
""",
    # ARGV: prefix, name, then field, JSON value, ...
    "register": """
local key = P .. 'adapter:' .. ARGV[2]
redis.call('DEL', key)
redis.call('HSET', key, unpack(ARGV, 3))
redis.call('ZADD', P .. 'adapters', 0, ARGV[2])
""",
    # ARGV: prefix
    "adapters": """
local out = {}
for _, name in ipairs(redis.call('ZRANGE', P .. 'adapters', 0, -1)) do
  out[#out + 1] = redis.call('HGETALL', P .. 'adapter:' .. name)
end
return out
""",
    # ARGV: prefix, name
    "delete_adapter": """
local key = P .. 'adapter:' .. ARGV[2]
if redis.call('HGET', key, 'deleted_at') ~= 'null' then return false end
redis.call('HSET', key, 'deleted_at', num(now()))
return redis.call('HGETALL', key)
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

# The webhook outbox (redis.py): delivery:JOB_ID a hash (doc: the record's JSON as Python wrote it, without its
# body, owner, lease_until and attempts, which are fields of their own that the scripts set), deliveries: the job
# ids scored by lease_until (a claim takes the one whose lease ended first among those whose job has ended or is
# gone: a parked delivery, body "", waits for its job).
OUTBOX_COMMON = """
local function held(key, t)
  local f = redis.call('HMGET', key, 'body', 'owner', 'lease_until')
  return f[1] ~= '' or (f[2] ~= 'null' and tonumber(f[3]) >= t)
end
local function ended(id)
  local status = redis.call('HGET', P .. 'job:' .. id, 'status')
  return (not status) or finished(status)
end
"""

OUTBOX_SCRIPTS = {
    # ARGV: prefix, job id, doc, body, owner's JSON, lease_until, attempts
    "create_delivery": """
local key = P .. 'delivery:' .. ARGV[2]
if redis.call('EXISTS', key) == 1 and held(key, now()) then return 0 end
redis.call('HSET', key, 'doc', ARGV[3], 'body', ARGV[4], 'owner', ARGV[5], 'lease_until', ARGV[6],
           'attempts', ARGV[7])
redis.call('ZADD', P .. 'deliveries', ARGV[6], ARGV[2])
return 1
""",
    # ARGV: prefix, the owner's JSON, lease_s, a job id or ''
    "claim_delivery": """
local t = now()
local function take(id)
  local key = P .. 'delivery:' .. id
  local lease = redis.call('HGET', key, 'lease_until')
  if not lease or tonumber(lease) >= t or not ended(id) then return nil end
  local until_ = num(t + tonumber(ARGV[3]))
  redis.call('HSET', key, 'owner', ARGV[2], 'lease_until', until_)
  redis.call('ZADD', P .. 'deliveries', until_, id)
  return redis.call('HGETALL', key)
end
if ARGV[4] ~= '' then return take(ARGV[4]) or false end
local start = 0
while true do
  local ids = redis.call('ZRANGEBYSCORE', P .. 'deliveries', '-inf', '(' .. num(t), 'LIMIT', start, 100)
  if #ids == 0 then return false end
  for _, id in ipairs(ids) do
    local got = take(id)
    if got then return got end
  end
  start = start + 100
end
""",
    # ARGV: prefix, job id, the owner's JSON, lease_s, attempts or '', body or '' (with a flag: ARGV[7] == '1')
    "renew_delivery": """
local key = P .. 'delivery:' .. ARGV[2]
if redis.call('HGET', key, 'owner') ~= ARGV[3] then return false end
local until_ = num(now() + tonumber(ARGV[4]))
redis.call('HSET', key, 'lease_until', until_)
if ARGV[5] ~= '' then redis.call('HSET', key, 'attempts', ARGV[5]) end
if ARGV[7] == '1' then redis.call('HSET', key, 'body', ARGV[6]) end
redis.call('ZADD', P .. 'deliveries', until_, ARGV[2])
return redis.call('HGETALL', key)
""",
    # ARGV: prefix, job id, the owner's JSON or '' (no fence)
    "end_delivery": """
local key = P .. 'delivery:' .. ARGV[2]
local owner = redis.call('HGET', key, 'owner')
if not owner or (ARGV[3] ~= '' and owner ~= ARGV[3]) then return 0 end
redis.call('DEL', key)
redis.call('ZREM', P .. 'deliveries', ARGV[2])
return 1
""",
}
