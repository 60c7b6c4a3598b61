"""The Lua scripts of the claim store (`claims.py`, which says what each mark means) and
the pieces the event-append script (`publish.py`) shares with them. Every script but the
release checks the dataset epoch first (`claims.EpochChanged`). KEYS and ARGV of each
are in the comment above it."""

_EPOCH_CHECK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('EPOCH changed') end
"""

# The last entry of a job's log: its `q` (seq; the next seq of a new attempt follows it)
# and `a` (attempt; 0 for an entry without one) fields, or -1, 0 for an empty log.
LAST_SEQ = """
local function last_entry(log)
  local last = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)
  local q, a = -1, 0
  if last[1] then
    local f = last[1][2]
    for i = 1, #f, 2 do
      if f[i] == 'q' then q = tonumber(f[i + 1]) elseif f[i] == 'a' then a = tonumber(f[i + 1]) end
    end
  end
  return q, a
end
"""

# The `e` (event JSON) fields of a log's last DONE_TAIL entries, newest first: a done
# job's terminal event is among them (it is appended with the done mark; only a stale
# attempt's late events can follow it).
DONE_TAIL = 4
LAST_EVENTS = """
local function last_events(log)
  local out = {}
  for _, entry in ipairs(redis.call('XREVRANGE', log, '+', '-', 'COUNT', DONE_TAIL)) do
    local f = entry[2]
    for i = 1, #f, 2 do if f[i] == 'e' then out[#out + 1] = f[i + 1] end end
  end
  return out
end
""".replace("DONE_TAIL", str(DONE_TAIL))

# KEYS: epoch, restore window, then per job: done, claim, attempts, log, failures, cancelled.
# ARGV: epoch, lease_ms, ttl_s, then per job: claim token. Returns per job:
# {'done', reason, {events}} | {'contested'} | {'restoring'}
# | {'claimed', attempt, next_seq, failures, cancelled, {seq, attempt, event, splits, ...} of the log (a later attempt)}.
TAKE_LUA = _EPOCH_CHECK + LAST_SEQ + LAST_EVENTS + """
local out = {}
local restoring = redis.call('EXISTS', KEYS[2]) == 1
local n = (#KEYS - 2) / 6
for j = 0, n - 1 do
  local k = 2 + j * 6
  local done = redis.call('GET', KEYS[k + 1])
  if done then
    out[j + 1] = {'done', done, last_events(KEYS[k + 4])}
  elseif restoring then
    out[j + 1] = {'restoring'}
  elseif not redis.call('SET', KEYS[k + 2], ARGV[4 + j], 'NX', 'PX', ARGV[2]) then
    out[j + 1] = {'contested'}
  else
    local attempt = redis.call('INCR', KEYS[k + 3])
    local q, a = last_entry(KEYS[k + 4])
    if a >= attempt then
      attempt = a + 1
      redis.call('SET', KEYS[k + 3], attempt)
    end
    redis.call('EXPIRE', KEYS[k + 3], ARGV[3])
    local failures = redis.call('SCARD', KEYS[k + 5])
    if failures == 0 then
      redis.call('SADD', KEYS[k + 5], attempt)
      redis.call('EXPIRE', KEYS[k + 5], ARGV[3])
    end
    local prior = {}  -- a later attempt keeps the earlier attempts' entries (restored with its own)
    if attempt > 1 then
      for _, entry in ipairs(redis.call('XRANGE', KEYS[k + 4], '-', '+')) do
        local f, e, s, at, sp = entry[2], false, -1, 0, ''
        for i = 1, #f, 2 do
          if f[i] == 'e' then e = f[i + 1] elseif f[i] == 'q' then s = f[i + 1] elseif f[i] == 'a' then at = f[i + 1]
          elseif f[i] == 's' then sp = f[i + 1] end
        end
        if e then
          prior[#prior + 1] = s; prior[#prior + 1] = at; prior[#prior + 1] = e; prior[#prior + 1] = sp
        end
      end
    end
    out[j + 1] = {'claimed', attempt, q + 1, failures, redis.call('EXISTS', KEYS[k + 6]), prior}
  end
end
return out
"""

# Adopt the dataset epoch. KEYS: epoch, restore window. ARGV: a new epoch value
# (`<random>@<server run id>`), the window in ms (0: none), the run id of the server
# answering ('' when unknown). Creates the marker if there is none, or if the one there was
# made on another server (a failover promoted a replica, or the server restarted from its
# persistence files: either may lack the last writes acknowledged, a data loss of those
# writes), and then the window; returns the marker's value.
ADOPT_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and ARGV[3] ~= '' then
  local at = string.find(cur, '@', 1, true)
  if not at or string.sub(cur, at + 1) ~= ARGV[3] then cur = false end
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1])
  if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[2], '1', 'PX', ARGV[2]) end
  return ARGV[1]
end
return cur
"""

# KEYS: epoch, then per job: claim, done, attempts. ARGV: epoch, lease_ms, then per job:
# token, attempt. Returns per job: 1 renewed, 2 re-acquired (the lease had lapsed and
# nobody claimed the job since: no done mark, the attempt counter still ours), 0 lost.
RENEW_LUA = _EPOCH_CHECK + """
local out = {}
for j = 0, (#KEYS - 1) / 3 - 1 do
  local k, ai = 2 + j * 3, 3 + j * 2
  local cur = redis.call('GET', KEYS[k])
  if cur == ARGV[ai] then
    redis.call('PEXPIRE', KEYS[k], ARGV[2]); out[j + 1] = 1
  elseif not cur and redis.call('EXISTS', KEYS[k + 1]) == 0
      and tonumber(redis.call('GET', KEYS[k + 2]) or '0') == tonumber(ARGV[ai + 1]) then
    redis.call('SET', KEYS[k], ARGV[ai], 'PX', ARGV[2]); out[j + 1] = 2
  else
    out[j + 1] = 0
  end
end
return out
"""

# A clean end of one attempt: release the claim if still ours, forget the attempt's
# failure mark, and (when reason ~= '') set the done mark. Idempotent, so a re-sent
# pipeline changes nothing. Used inside the publish script and by `release`.
FINISH_LUA = """
local function finish_job(done, claim, failures, reason, token, attempt, ttl)
  if reason ~= '' then redis.call('SET', done, reason, 'EX', ttl) end
  if redis.call('GET', claim) == token then redis.call('DEL', claim) end
  redis.call('SREM', failures, attempt)
end
"""

# KEYS: per job: done, claim, failures. ARGV: ttl, then per job: reason, token, attempt.
RELEASE_LUA = FINISH_LUA + """
for j = 0, #KEYS / 3 - 1 do
  finish_job(KEYS[j * 3 + 1], KEYS[j * 3 + 2], KEYS[j * 3 + 3], ARGV[2 + j * 3], ARGV[3 + j * 3],
             ARGV[4 + j * 3], ARGV[1])
end
return #KEYS / 3
"""

# A job forwarded to another pool before it ran here: the claim is given back, the
# attempt's failure mark cleared and, when nobody claimed since, the attempt counter set
# back, so the pool that runs it claims the same attempt (its stream shows no restart).
# KEYS: per job: claim, failures, attempts. ARGV: per job: token, attempt.
UNCLAIM_LUA = """
for j = 0, #KEYS / 3 - 1 do
  local claim, failures, attempts = KEYS[j * 3 + 1], KEYS[j * 3 + 2], KEYS[j * 3 + 3]
  local token, attempt = ARGV[j * 2 + 1], ARGV[j * 2 + 2]
  if redis.call('GET', claim) == token then
    redis.call('DEL', claim)
    if redis.call('GET', attempts) == attempt then
      redis.call('SET', attempts, tonumber(attempt) - 1, 'KEEPTTL')
    end
  end
  redis.call('SREM', failures, attempt)
end
return #KEYS / 3
"""

# Restore the held jobs after Redis lost its data. KEYS: epoch, then per job: claim,
# attempts, failures, done. ARGV: epoch, lease_ms, ttl, then per job: token, attempt.
# Returns per job 1 if the claim is ours again, 0 if another worker claimed (or ended)
# the job meanwhile.
RECLAIM_LUA = _EPOCH_CHECK + """
local out = {}
for j = 0, (#KEYS - 1) / 4 - 1 do
  local k, ai = 1 + j * 4, 4 + j * 2
  local cur = redis.call('GET', KEYS[k + 1])
  if (cur and cur ~= ARGV[ai]) or redis.call('EXISTS', KEYS[k + 4]) == 1 then
    out[j + 1] = 0
  else
    redis.call('SET', KEYS[k + 1], ARGV[ai], 'PX', ARGV[2])
    local a = tonumber(redis.call('GET', KEYS[k + 2]) or '0')
    if a < tonumber(ARGV[ai + 1]) then redis.call('SET', KEYS[k + 2], ARGV[ai + 1], 'EX', ARGV[3]) end
    redis.call('SADD', KEYS[k + 3], ARGV[ai + 1])
    redis.call('EXPIRE', KEYS[k + 3], ARGV[3])
    out[j + 1] = 1
  end
end
return out
"""

# A job at its failure limit: since when (Redis server time) claims have found it so.
# KEYS: per job: suspect. ARGV: ttl_s. Returns per job the milliseconds since the first
# such claim (0 for this one).
SUSPECT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for j = 1, #KEYS do
  redis.call('SET', KEYS[j], now, 'NX', 'EX', ARGV[1])
  out[j] = now - tonumber(redis.call('GET', KEYS[j]))
end
return out
"""
