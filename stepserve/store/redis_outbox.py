"""The Lua scripts of the Redis store's webhook outbox (redis.py; run after redis_scripts.COMMON, with its
conventions: ARGV[1] the key prefix, numbers printed with 17 digits)."""

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
    # ARGV: prefix, the owner's JSON, lease_s, a job id or '', '1' and a service or '0' and '' (any service)
    "claim_delivery": """
local t = now()
local function take(id)
  local key = P .. 'delivery:' .. id
  local lease = redis.call('HGET', key, 'lease_until')
  if not lease or tonumber(lease) >= t or not ended(id) then return nil end
  if ARGV[5] == '1' then  -- that service's, or one made before services ('')
    local s = cjson.decode(redis.call('HGET', key, 'doc')).service or ''
    if s ~= ARGV[6] and s ~= '' then return nil end
  end
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
