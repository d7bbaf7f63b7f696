//! The Lua scripts of the Redis index. Each runs atomically in Redis (one script at a time), so
//! every rule (one winner per key, no reuse of a leased slot, a new generation per
//! reservation) holds whatever number of clients call at once.
//!
//! The pool is cut into shards (one on a standalone server by default, 16 on a Cluster): a
//! shard is a complete pool of its own keys and of its own share of every tier's slots (slot
//! `g` of a tier belongs to shard `g % shards`), so every script touches one shard only, and
//! every key of a shard shares its hash tag `{prefix}` (one shard) or `{prefix.s}`: one
//! Cluster slot. `P` below is that tag.
//!
//! | key | type | holds |
//! |---|---|---|
//! | `P:blocks` | hash | block key (16 bytes) -> sealed placement value (published blocks only) |
//! | `P:shards` | string | the pool's shard count (shard 0 only: clients must agree) |
//! | `P:nodes` | set | node ids ever announced |
//! | `P:node:N` | string, TTL | node N's announcement; absent = dead |
//! | `P:ntiers:N` | set | node N's tier ids |
//! | `P:tier:N:T` | hash | the tier's `slot_size`, `slot_count`, `durable`, `low`, `high` (the whole tier's), and this shard's share: `lcount` slots `first`, `first + stride`, ..., watermarks `llow`, `lhigh`, `next` (never-used cursor, in shares) |
//! | `P:free:N:T` | list | used slots free again |
//! | `P:gen:N:T` | hash | slot -> generation (new at each reservation: at least the server's clock in ms × 1000, so a restarted server or a promoted replica that lost writes never hands one out again) |
//! | `P:owner:N:T` | hash | slot -> key of the block published there |
//! | `P:lru:N:T` | sorted set | published slot -> last use (ms, server clock) |
//! | `P:resv:N:T` | sorted set | reserved slot -> deadline (ms) |
//! | `P:rkey:N:T` | hash | reserved slot -> key, length, generation and deadline (ms) |
//! | `P:tl:N:T` | set | ids of leases that hold slots of the tier (some may have ended) |
//! | `P:lease:I` | hash, TTL | lease I: field `-` (so a lease of nothing exists too), and per tier it holds slots of, `N:T` -> those slots, comma-separated; absent = ended |
//! | `P:groups` | hash | group id (16 bytes) -> sealed summary: the placements of the group's keys in this shard, as their entries hold them (see [`summary`](super::summary)) |
//! | `P:heads` | hash | group id -> the head of its summary (the nodes it names, sealed): what a prefix lookup reads |
//! | `P:member` | hash | block key -> the ids of the groups whose summaries count it (16 bytes each, at most [`GROUPS_PER_KEY`]) |
//! | `P:once:I` | string, TTL | the answers of call I (a reserve, publish, removal, eviction or leave), for a repeat of it: see [`repeat_window`] |
//!
//! A published entry is *live* only while its node is alive (its announcement has not
//! expired) and its slot's `owner` still names its key. Every script that asks whether a key
//! is present (reserve, publish) asks whether it is live: a dead node's entries are absent to
//! writers at once, not only hidden from lookups, so its keys can be stored again elsewhere.
//! Dead nodes' state is deleted in bounded steps ([`WIPE_BUDGET`] entries a call): by the
//! node itself when it rejoins (it is alive again only once its old entries are gone), by
//! [`LEAVE`], and by every renewal of a live node, which reaps a few dead nodes as it goes
//! ([`ANNOUNCE`]).
//!
//! A group summary stands for its blocks in a prefix lookup, so it must never outlive one of
//! them: whatever deletes or replaces a key's entry (a removal, an eviction, a dead node's
//! wipe, a publish over a dead entry) first deletes every summary the key's `member` field
//! names. That is the one rule [`SUMMARIZE`] relies on.
//!
//! `ARGV[1]` of every script is `P`, and `KEYS[1]` is `P:nodes`, for a Cluster to route the
//! call to the shard's node. Time is the server's (`TIME`), so clients' clocks never matter.
//! Scripts touch keys they compute rather than declare; every key shares the shard's hash
//! tag, so they are in the declared key's Cluster slot.

/// Helpers every script starts with.
const PRELUDE: &str = r#"
local P = ARGV[1]
local function k(kind, n, t) return P .. ':' .. kind .. ':' .. n .. ':' .. t end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The ids of the nodes alive now.
local function alive_ids()
  local out = {}
  for _, n in ipairs(redis.call('SMEMBERS', P .. ':nodes')) do
    if redis.call('EXISTS', P .. ':node:' .. n) == 1 then out[#out + 1] = n end
  end
  return out
end
local alive_now = {}
local function alive(n)
  local a = alive_now[n]
  if a == nil then
    a = redis.call('EXISTS', P .. ':node:' .. n) == 1
    alive_now[n] = a
  end
  return a
end
-- The node, tier and slot a published value names, as the strings keys are made of; nil for
-- a value too short to be one.
local function where(blob)
  if #blob < 10 then return nil end
  local n, t, slot = struct.unpack('>I4I2I4', blob)
  return string.format('%d', n), string.format('%d', t), string.format('%d', slot)
end
-- A script's call to Redis takes at most this many arguments after the key (an `unpack` is
-- bounded by Lua's C stack, 8,000 values); even, so field-value pairs never split.
local BULK = 1024
-- `cmd key [opt] args...` for a list of `args` of any length, in calls of at most BULK
-- arguments: one call per thousand items instead of one per item (a call from a script costs
-- about a microsecond of Redis's time whatever it does). Returns the replies concatenated,
-- for a command that answers one value per argument (HMGET).
local function bulk(cmd, key, args, opt)
  local out = {}
  for i = 1, #args, BULK do
    local last = math.min(i + BULK - 1, #args)
    local r
    if opt then r = redis.call(cmd, key, opt, unpack(args, i, last))
    else r = redis.call(cmd, key, unpack(args, i, last)) end
    if type(r) == 'table' then
      for j = 1, #r do out[#out + 1] = r[j] end
    end
  end
  return out
end
-- A call's items, each `width` arguments from ARGV[first] on: `field(j, f)`, argument f
-- (from 0) of item j, and the number of items.
local function items(first, width)
  return function(j, f) return ARGV[first + (j - 1) * width + f] end,
    math.floor((#ARGV - first + 1) / width)
end
-- The tiers that items whose fields 1, 2 and 3 are node, tier and slot name, in the order
-- first named: each `{n =, t =, at = {its items}, slots = {their slots}}`; and item j's tier.
local function by_tier(field, m)
  local tiers, order, tier_of = {}, {}, {}
  for j = 1, m do
    local n, t = field(j, 1), field(j, 2)
    local nt = n .. ':' .. t
    local g = tiers[nt]
    if not g then
      g = {n = n, t = t, at = {}, slots = {}}
      tiers[nt] = g
      order[#order + 1] = g
    end
    g.at[#g.at + 1] = j
    g.slots[#g.slots + 1] = field(j, 3)
    tier_of[j] = g
  end
  return order, tier_of
end
-- Whether `blob`, the published value of `key`, is live: its node is alive and its slot
-- still holds the key.
local function is_live(key, blob)
  local n, t, slot = where(blob)
  return n and alive(n) and redis.call('HGET', k('owner', n, t), slot) == key
end
-- The published value of `key` if it is live.
local function live(key)
  local blob = redis.call('HGET', P .. ':blocks', key)
  if blob and is_live(key, blob) then return blob end
  return nil
end
-- live() of each of `keys` (a list): their values, false where not live.
local function live_many(keys)
  local blobs = bulk('HMGET', P .. ':blocks', keys)
  for j = 1, #keys do
    if blobs[j] and not is_live(keys[j], blobs[j]) then blobs[j] = false end
  end
  return blobs
end
-- Deletes every group summary that counts one of `keys` (a list): called before their
-- entries are deleted or replaced. `unsummarize(key)` for one key.
local function unsummarize_all(keys)
  local members = bulk('HMGET', P .. ':member', keys)
  local counted = {}
  for i, ids in ipairs(members) do
    if ids then
      counted[#counted + 1] = keys[i]
      for at = 1, #ids, 16 do
        local id = string.sub(ids, at, at + 15)
        redis.call('HDEL', P .. ':groups', id)
        redis.call('HDEL', P .. ':heads', id)
      end
    end
  end
  bulk('HDEL', P .. ':member', counted)
end
local function unsummarize(key) unsummarize_all({key}) end
-- Forgets that `slot` of node n's tier t holds `key`; the key's entry goes too if it names
-- this slot (another writer may have stored the key elsewhere since this slot's node died).
local function drop_owner(n, t, slot, key)
  unsummarize(key)
  local blob = redis.call('HGET', P .. ':blocks', key)
  if blob then
    local bn, bt, bs = where(blob)
    if bn == n and bt == t and bs == slot then redis.call('HDEL', P .. ':blocks', key) end
  end
  redis.call('HDEL', k('owner', n, t), slot)
end
-- Whether a lease that has not ended holds `slot` of node n's tier t. The first ask of a call
-- reads the tier's leased slots from every lease its `tl` set names (those that ended leave
-- the set then), and later asks look them up: nothing else runs while a script does. So a
-- lease costs one field per tier rather than a key per slot, and an eviction or removal pays
-- once per call for the slots the tier's leases hold at that moment.
local leased_now = {}
local function leased(n, t, slot)
  local nt = n .. ':' .. t
  local slots = leased_now[nt]
  if not slots then
    slots = {}
    local tl = k('tl', n, t)
    for _, id in ipairs(redis.call('SMEMBERS', tl)) do
      local held = redis.call('HGET', P .. ':lease:' .. id, nt)
      if held then
        for s in string.gmatch(held, '%d+') do slots[s] = true end
      else
        redis.call('SREM', tl, id)
      end
    end
    leased_now[nt] = slots
  end
  return slots[slot] == true
end
local function drop_published(n, t, slot)
  local key = redis.call('HGET', k('owner', n, t), slot)
  if key then drop_owner(n, t, slot, key) end
  redis.call('ZREM', k('lru', n, t), slot)
  redis.call('RPUSH', k('free', n, t), slot)
end
-- Evicts up to `want` of tier t's least recently used published blocks, skipping leased slots
-- and those `keep` names (a table slot -> true, or nil). Returns the number evicted.
local function evict(n, t, want, keep)
  local lru = k('lru', n, t)
  local done, kept, scanned = 0, 0, 0
  while done < want and scanned < want + 256 do
    local batch = redis.call('ZRANGE', lru, kept, kept + 63)
    if #batch == 0 then break end
    for _, slot in ipairs(batch) do
      scanned = scanned + 1
      if done < want and not (keep and keep[slot]) and not leased(n, t, slot) then
        drop_published(n, t, slot)
        done = done + 1
      else
        kept = kept + 1
      end
    end
  end
  return done
end
-- What `P:rkey:N:T` holds for a reservation of `key`, `len` bytes, at generation `gen` (all
-- strings): this, then its deadline.
local function reservation(key, len, gen) return key .. len .. ':' .. gen .. ':' end
-- The deadline of the reservation `held` (rkey's value, or false) if it is `key`'s, `len`
-- bytes at generation `gen`; nil otherwise.
local function deadline_of(held, key, len, gen)
  if not held then return nil end
  local r = reservation(key, len, gen)
  if string.sub(held, 1, #r) ~= r then return nil end
  return tonumber(string.sub(held, #r + 1))
end
local function unreserve(n, t, slot)
  redis.call('ZREM', k('resv', n, t), slot)
  redis.call('HDEL', k('rkey', n, t), slot)
end
-- Frees up to 256 of tier t's reservations whose deadline passed; returns how many.
local function reclaim(n, t, now)
  local expired = redis.call('ZRANGEBYSCORE', k('resv', n, t), '-inf', now, 'LIMIT', 0, 256)
  for _, slot in ipairs(expired) do
    unreserve(n, t, slot)
    redis.call('RPUSH', k('free', n, t), slot)
  end
  return #expired
end
-- A call whose repeat must not act again (a client makes a call again on a fresh connection
-- when it lost the first one's answer) keeps its answers under its id, `ARGV[2]`, for
-- `ARGV[3]` ms: `replayed()` is those answers for a repeat, else nil, and `answered(out)`
-- keeps and returns them.
local function replayed()
  local kept = redis.call('GET', P .. ':once:' .. ARGV[2])
  if kept then return cmsgpack.unpack(kept) end
  return nil
end
local function answered(out)
  redis.call('SET', P .. ':once:' .. ARGV[2], cmsgpack.pack(out), 'PX', ARGV[3])
  return out
end
-- Deletes up to `budget` of tier t's published entries of node n, then (once none is left)
-- its reservations and free list, so the tier is empty with its shape kept. Returns whether
-- the tier is empty and the budget left.
local function wipe_tier(n, t, budget)
  local ok = k('owner', n, t)
  while budget > 0 do
    local batch = redis.call('HRANDFIELD', ok, math.min(budget, 256), 'WITHVALUES')
    if #batch == 0 then break end
    for j = 1, #batch, 2 do drop_owner(n, t, batch[j], batch[j + 1]) end
    budget = budget - #batch / 2
  end
  if redis.call('EXISTS', ok) == 1 then return false, 0 end
  redis.call('UNLINK', k('lru', n, t), k('resv', n, t), k('rkey', n, t), k('free', n, t),
    k('tl', n, t))
  redis.call('HSET', k('tier', n, t), 'next', 0)
  return true, budget - 1
end
-- wipe_tier over every tier of node n: whether all are empty, and the budget left.
local function wipe(n, budget)
  for _, t in ipairs(redis.call('SMEMBERS', P .. ':ntiers:' .. n)) do
    local done
    done, budget = wipe_tier(n, t, budget)
    if not done then return false, 0 end
  end
  return true, budget
end
-- Deletes, in steps of at most `budget` entries, everything of up to `sample` dead nodes
-- (chosen at random): entries, tiers, generations (a node that returns starts its slots'
-- generations from the clock, as after a server restart). Returns the nodes reaped whole.
local function reap(budget, sample)
  local reaped = 0
  for _, n in ipairs(redis.call('SRANDMEMBER', P .. ':nodes', sample)) do
    if budget <= 0 then break end
    if redis.call('EXISTS', P .. ':node:' .. n) == 0 then
      local done
      done, budget = wipe(n, budget)
      if not done then break end
      for _, t in ipairs(redis.call('SMEMBERS', P .. ':ntiers:' .. n)) do
        redis.call('UNLINK', k('tier', n, t), k('gen', n, t))
      end
      redis.call('DEL', P .. ':ntiers:' .. n)
      redis.call('SREM', P .. ':nodes', n)
      reaped = reaped + 1
    end
  end
  return reaped
end
"#;

/// ARGV: P, node, tier, slot_size, slot_count, durable, low, high (the whole tier's), then
/// this shard's share: lcount, llow, lhigh, stride, first.
/// Returns `{'ok'}`, `{'more'}` (call again: a dead node's tier with another shape is being
/// emptied, [`WIPE_BUDGET`] entries a call) or `{'conflict', slot_size, slot_count, durable}`
/// (another shape, and the node is alive: its blocks live in the registered shape).
pub(super) const REGISTER_TIER: &str = r#"
local n, t = ARGV[2], ARGV[3]
local tk = k('tier', n, t)
local have = redis.call('HMGET', tk, 'slot_size', 'slot_count', 'durable', 'stride', 'first')
if have[1] then
  if have[1] == ARGV[4] and have[2] == ARGV[5] and have[3] == ARGV[6]
      and have[4] == ARGV[12] and have[5] == ARGV[13] then
    redis.call('HSET', tk, 'low', ARGV[7], 'high', ARGV[8], 'llow', ARGV[10], 'lhigh', ARGV[11])
    return {'ok'}
  end
  if alive(n) then return {'conflict', have[1], have[2], have[3]} end
  -- A node that is not alive comes back with another shape: its old slots are emptied, then
  -- the tier takes the new shape.
  if not wipe_tier(n, t, WIPE_BUDGET) then return {'more'} end
end
redis.call('HSET', tk, 'slot_size', ARGV[4], 'slot_count', ARGV[5], 'durable', ARGV[6],
  'low', ARGV[7], 'high', ARGV[8], 'lcount', ARGV[9], 'llow', ARGV[10], 'lhigh', ARGV[11],
  'stride', ARGV[12], 'first', ARGV[13], 'next', 0)
redis.call('SADD', P .. ':ntiers:' .. n, t)
return {'ok'}
"#;

/// ARGV: P, call id, its repeat window (ms), node, tier, ttl_ms, then per item: key, len.
/// Returns one string, the items' answers one after another (integers big-endian):
///
/// | answer | bytes |
/// |---|---|
/// | a slot reserved | `o`, slot (4 bytes), generation (8) |
/// | the key is present | `p`, the placement value's length (2), the value |
/// | the node is not alive | `d` |
/// | the tier is unknown | `u` |
/// | the block is too large | `t`, the slot size (8) |
/// | the tier is full | `f` |
///
/// (One string rather than an array per item: building, keeping for a repeat and sending a
/// table per item cost Redis about 1 µs an item, a sixth of the call, by `SLOWLOG` over calls
/// of 1,024 items.) A repeat of a call (same id) answers as the call did, and reserves (and
/// evicts) nothing more.
///
/// The items are answered in order, as if one by one: before each slot is taken, a tier
/// whose free slots fell below its low watermark evicts up to its high one (never a block
/// this call answers present). The reads and writes go to Redis in bulk (a few calls per
/// thousand items), the decisions are made in between.
pub(super) const RESERVE_MANY: &str = r#"
local kept = replayed()
if kept then return kept end
local n, t, ttl = ARGV[4], ARGV[5], tonumber(ARGV[6])
local now = now_ms()
local keys, lens = {}, {}
for i = 7, #ARGV - 1, 2 do
  keys[#keys + 1] = ARGV[i]
  lens[#lens + 1] = ARGV[i + 1]
end
local out = {}
local present = live_many(keys)
-- Slots of this tier holding blocks answered present: this call's evictions keep them.
local keep = {}
for j = 1, #keys do
  if present[j] then
    out[j] = 'p' .. struct.pack('>I2', #present[j]) .. present[j]
    local pn, pt, ps = where(present[j])
    if pn == n and pt == t then keep[ps] = true end
  end
end
local tk, fk = k('tier', n, t), k('free', n, t)
local meta = redis.call('HMGET', tk, 'slot_size', 'lcount', 'llow', 'lhigh', 'next', 'stride', 'first')
local slot_size, count, low, high, nxt, stride, first
-- The items still to give a slot (or answer full): never fewer than this call takes off
-- the free list, so none it takes is left unused.
local wanting = 0
if meta[1] then
  slot_size, count, low = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3])
  high, nxt, stride, first = tonumber(meta[4]), tonumber(meta[5]), tonumber(meta[6]), tonumber(meta[7])
  for j = 1, #keys do
    if not present[j] and tonumber(lens[j]) <= slot_size then wanting = wanting + 1 end
  end
end
local next_before = nxt
-- Free slots: `popped[at..]` taken off the free list by this call and not handed out yet,
-- `listed` still on it (nil until the first slot is wanted), and the never-used ones from
-- the cursor `nxt` on.
local popped, at, listed = {}, 1, nil
local taken, takers = {}, {}
for j = 1, #keys do
  if not present[j] then
    if not alive(n) then out[j] = 'd'
    elseif not meta[1] then out[j] = 'u'
    elseif tonumber(lens[j]) > slot_size then out[j] = 't' .. struct.pack('>I8', slot_size)
    else
      if not listed then
        repeat until reclaim(n, t, now) < 256
        listed = redis.call('LLEN', fk)
      end
      local free = #popped - at + 1 + listed + (count - nxt)
      if free < math.max(low, 1) then
        listed = listed + evict(n, t, math.max(high, 1) - free, keep)
      end
      if at > #popped and listed > 0 then
        popped, at = redis.call('LPOP', fk, math.min(listed, wanting)), 1
        listed = listed - #popped
      end
      local slot
      if at <= #popped then
        slot, at = popped[at], at + 1
      elseif nxt < count then
        slot, nxt = string.format('%d', nxt * stride + first), nxt + 1
      end
      if slot then
        taken[#taken + 1] = slot
        takers[#takers + 1] = j
      else
        out[j] = 'f'
      end
      wanting = wanting - 1
    end
  end
end
if nxt ~= next_before then redis.call('HSET', tk, 'next', nxt) end
if #taken > 0 then
  -- Each slot's next generation, and never below the server's clock (ms * 1000): a server
  -- that lost its data (a restart, a replica promoted before it had the latest writes, a
  -- reaped node) hands out generations above every one an earlier life handed out for the
  -- slot (unless it made 1,000 reservations of one slot per millisecond), so a placement or
  -- reservation from before never matches again. Exact in Lua's doubles until the year 2255.
  local gk = k('gen', n, t)
  local old, given = bulk('HMGET', gk, taken), {}
  local gens, resv, rkey = {}, {}, {}
  -- Numbers turn into strings once each: Lua formats them with printf, a microsecond apiece.
  local deadline = string.format('%d', now + ttl)
  for i, slot in ipairs(taken) do
    local j = takers[i]
    local gen = math.max((given[slot] or tonumber(old[i]) or 0) + 1, now * 1000)
    local gen_s = string.format('%d', gen)
    given[slot] = gen
    gens[2 * i - 1], gens[2 * i] = slot, gen_s
    resv[2 * i - 1], resv[2 * i] = deadline, slot
    rkey[2 * i - 1], rkey[2 * i] = slot, reservation(keys[j], lens[j], gen_s) .. deadline
    out[j] = struct.pack('>BI4I8', 111, tonumber(slot), gen)
  end
  bulk('HSET', gk, gens)
  bulk('ZADD', k('resv', n, t), resv)
  bulk('HSET', k('rkey', n, t), rkey)
end
return answered(table.concat(out))
"#;

/// ARGV: P, call id, its repeat window (ms), then per item: key, node, tier, slot,
/// generation, len, placement value.
/// Returns one string, the items' answers one after another, as [`RESERVE_MANY`]'s: `W`
/// (won), `E` (expired), or `L`, the winner's placement value's length (2 bytes, big-endian)
/// and the value (lost). An entry of the key that is not live (its node died) is replaced. A
/// repeat of a call (same id) answers as the call did.
///
/// The items are decided in order, as if published one by one (a later item of a key this
/// call published loses to it; a reservation named twice is ended once); the reads and
/// writes go to Redis in bulk, per tier.
pub(super) const PUBLISH: &str = r#"
local kept = replayed()
if kept then return kept end
local now = now_ms()
local field, m = items(4, 7)
local order, tier_of = by_tier(field, m)
-- What this call changes in each tier: reservations ended (`done`: slot -> true), slots
-- freed, slots published (owner, lru).
for _, g in ipairs(order) do
  g.done, g.ended, g.freed, g.owner, g.lru = {}, {}, {}, {}, {}
end
-- Each item's deadline, if Redis holds its reservation (nil if not, or another's).
local deadline = {}
for _, g in ipairs(order) do
  local held = bulk('HMGET', k('rkey', g.n, g.t), g.slots)
  for i, j in ipairs(g.at) do
    deadline[j] = deadline_of(held[i], field(j, 0), field(j, 5), field(j, 4))
  end
end
-- Whether each item's reservation is still in time (and its node alive), and the live
-- entries of those items' keys.
local timely, timely_keys = {}, {}
for j = 1, m do
  if deadline[j] and deadline[j] > now and alive(tier_of[j].n) then
    timely[j] = true
    timely_keys[#timely_keys + 1] = field(j, 0)
  end
end
local winners = {}
for i, blob in ipairs(live_many(timely_keys)) do
  if blob then winners[timely_keys[i]] = blob end
end
local now_s = string.format('%d', now)
local out, entries, published = {}, {}, {}
for j = 1, m do
  local key, slot, g = field(j, 0), field(j, 3), tier_of[j]
  -- A reservation named twice is ended by its first item.
  local ours = deadline[j] and not g.done[slot]
  if ours then
    g.done[slot] = true
    g.ended[#g.ended + 1] = slot
  end
  if ours and timely[j] then
    local winner = winners[key]
    if winner then
      g.freed[#g.freed + 1] = slot
      out[j] = 'L' .. struct.pack('>I2', #winner) .. winner
    else
      local blob = field(j, 6)
      winners[key] = blob
      published[#published + 1] = key
      entries[#entries + 1] = key
      entries[#entries + 1] = blob
      g.owner[#g.owner + 1] = slot
      g.owner[#g.owner + 1] = key
      g.lru[#g.lru + 1] = now_s
      g.lru[#g.lru + 1] = slot
      out[j] = 'W'
    end
  else
    if ours then g.freed[#g.freed + 1] = slot end
    out[j] = 'E'
  end
end
unsummarize_all(published)
bulk('HSET', P .. ':blocks', entries)
for _, g in ipairs(order) do
  bulk('ZREM', k('resv', g.n, g.t), g.ended)
  bulk('HDEL', k('rkey', g.n, g.t), g.ended)
  bulk('HSET', k('owner', g.n, g.t), g.owner)
  bulk('ZADD', k('lru', g.n, g.t), g.lru)
  bulk('RPUSH', k('free', g.n, g.t), g.freed)
end
return answered(table.concat(out))
"#;

/// ARGV: P, then per item: key, node, tier, slot, generation, len. Returns the number aborted.
pub(super) const ABORT: &str = r#"
local done = 0
local i = 2
while i + 5 <= #ARGV do
  local key, n, t, slot, gen, len = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4], ARGV[i+5]
  i = i + 6
  if deadline_of(redis.call('HGET', k('rkey', n, t), slot), key, len, gen) then
    unreserve(n, t, slot)
    redis.call('RPUSH', k('free', n, t), slot)
    done = done + 1
  end
end
return done
"#;

/// ARGV: P. Returns the ids of the nodes alive now.
pub(super) const ALIVE: &str = r#"
return alive_ids()
"#;

/// ARGV: P, ttl_ms, lease id (the client's: one lease spans shards), then per placement: key,
/// node, tier, slot, generation. Returns `{granted (1/0) per placement...}`.
pub(super) const LEASE: &str = r#"
local id = ARGV[3]
local lk = P .. ':lease:' .. id
local now_s = string.format('%d', now_ms())
local field, m = items(4, 5)
local out = {}
for j = 1, m do out[j] = 0 end
-- The lease's fields: `-` (so a lease of nothing exists, and can be renewed), then per tier
-- it holds slots of, `N:T` and those slots; the tier's `tl` set names the lease.
local held = {'-', ''}
for _, g in ipairs(by_tier(field, m)) do
  if alive(g.n) then
    local owners = bulk('HMGET', k('owner', g.n, g.t), g.slots)
    local gens = bulk('HMGET', k('gen', g.n, g.t), g.slots)
    local used, slots = {}, {}
    for i, j in ipairs(g.at) do
      if owners[i] == field(j, 0) and gens[i] == field(j, 4) then
        slots[#slots + 1] = g.slots[i]
        used[#used + 1] = now_s
        used[#used + 1] = g.slots[i]
        out[j] = 1
      end
    end
    if #slots > 0 then
      held[#held + 1] = g.n .. ':' .. g.t
      held[#held + 1] = table.concat(slots, ',')
      redis.call('SADD', k('tl', g.n, g.t), id)
      bulk('ZADD', k('lru', g.n, g.t), used, 'XX')
    end
  end
end
bulk('HSET', lk, held)
redis.call('PEXPIRE', lk, ARGV[2])
return out
"#;

/// ARGV: P, lease id. Ends the lease.
pub(super) const RELEASE: &str = r#"
local lk = P .. ':lease:' .. ARGV[2]
for _, nt in ipairs(redis.call('HKEYS', lk)) do
  if nt ~= '-' then redis.call('SREM', P .. ':tl:' .. nt, ARGV[2]) end
end
redis.call('DEL', lk)
return 1
"#;

/// ARGV: P, call id, its repeat window (ms), keys... Returns one string per key: `R` removed,
/// `A` absent, `L` leased. A repeat of a call (same id) answers as the call did.
pub(super) const REMOVE: &str = r#"
local kept = replayed()
if kept then return kept end
local out = {}
for i = 4, #ARGV do
  local key = ARGV[i]
  local blob = redis.call('HGET', P .. ':blocks', key)
  if not blob then
    out[#out + 1] = 'A'
  else
    local n, t, slot = where(blob)
    if not n then
      unsummarize(key)
      redis.call('HDEL', P .. ':blocks', key)
      out[#out + 1] = 'R'
    elseif leased(n, t, slot) then
      out[#out + 1] = 'L'
    elseif redis.call('HGET', k('owner', n, t), slot) == key then
      drop_published(n, t, slot)
      out[#out + 1] = 'R'
    else
      unsummarize(key)
      redis.call('HDEL', P .. ':blocks', key)
      out[#out + 1] = 'R'
    end
  end
end
return answered(out)
"#;

/// ARGV: P, then per group: its id, its sealed summary (a head naming its nodes, the
/// placements of its m keys in this shard,
/// [`PLACEMENT_BYTES`](crate::placement::PLACEMENT_BYTES) each, then a tag: see
/// `seal::Sealer::encode_summary`), m, and those m keys. A group is summarized only if each key's entry still holds the placement the
/// summary gives it; its id is then added to each key's `member` field (a field already
/// holding [`GROUPS_PER_KEY`] ids drops its oldest, whose summary is deleted), and the
/// summary is stored. Returns 1 (summarized) or 0 per group.
pub(super) const SUMMARIZE: &str = r#"
local groups, heads, member = P .. ':groups', P .. ':heads', P .. ':member'
local out = {}
local i = 2
while i + 2 <= #ARGV do
  local id, value, m = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local first = i + 3
  i = first + m
  local base = #value >= 2 and 2 + 4 * struct.unpack('>I2', value) + SUMMARY_TAG or #value
  local ok = first + m - 1 <= #ARGV and #value == base + m * PLACEMENT_BYTES + SUMMARY_TAG
  for j = 0, m - 1 do
    if not ok then break end
    local blob = redis.call('HGET', P .. ':blocks', ARGV[first + j])
    local at = base + j * PLACEMENT_BYTES
    ok = blob and string.sub(blob, 1, PLACEMENT_BYTES) == string.sub(value, at + 1, at + PLACEMENT_BYTES)
  end
  if ok then
    for j = first, first + m - 1 do
      local key = ARGV[j]
      local ids = redis.call('HGET', member, key) or ''
      local listed = false
      for at = 1, #ids, 16 do
        if string.sub(ids, at, at + 15) == id then listed = true break end
      end
      if not listed then
        if #ids >= 16 * GROUPS_PER_KEY then
          redis.call('HDEL', groups, string.sub(ids, 1, 16))
          redis.call('HDEL', heads, string.sub(ids, 1, 16))
          ids = string.sub(ids, 17)
        end
        redis.call('HSET', member, key, ids .. id)
      end
    end
    redis.call('HSET', groups, id, value)
    redis.call('HSET', heads, id, string.sub(value, 1, base))
  end
  out[#out + 1] = ok and 1 or 0
end
return out
"#;

/// ARGV: P, call id, its repeat window (ms), node, tier, count. Returns the number evicted,
/// or -1 for an unknown tier. A repeat of a call (same id) answers as the call did, and
/// evicts nothing more.
pub(super) const EVICT: &str = r#"
local kept = replayed()
if kept then return kept end
if redis.call('EXISTS', k('tier', ARGV[4], ARGV[5])) == 0 then return -1 end
return answered(evict(ARGV[4], ARGV[5], tonumber(ARGV[6])))
"#;

/// ARGV: P, node, tier. Returns `{free, reserved, published}`, or `{-1}` for an unknown tier.
pub(super) const STATS: &str = r#"
local n, t = ARGV[2], ARGV[3]
local meta = redis.call('HMGET', k('tier', n, t), 'lcount', 'next')
if not meta[1] then return {-1} end
reclaim(n, t, now_ms())
local free = redis.call('LLEN', k('free', n, t)) + tonumber(meta[1]) - tonumber(meta[2])
return {free, redis.call('ZCARD', k('resv', n, t)), redis.call('HLEN', k('owner', n, t))}
"#;

/// ARGV: P, node, ttl_ms, announcement. A node that was not alive joins empty: its old
/// placements and reservations are deleted first ([`WIPE_BUDGET`] entries a call; generations
/// are kept so old placements never match again), and it is alive only once they are gone. A
/// node that renews reaps up to [`WIPE_BUDGET`] entries of a few dead nodes (picked at random)
/// on its way. Returns 1 when the node joined, 0 when it renewed, 2 when it is still being
/// emptied (call again).
pub(super) const ANNOUNCE: &str = r#"
local n = ARGV[2]
local nk = P .. ':node:' .. n
redis.call('SADD', P .. ':nodes', n)
if redis.call('EXISTS', nk) == 1 then
  redis.call('SET', nk, ARGV[4], 'PX', ARGV[3])
  reap(WIPE_BUDGET, 4)
  return 0
end
if not wipe(n, WIPE_BUDGET) then return 2 end
redis.call('SET', nk, ARGV[4], 'PX', ARGV[3])
return 1
"#;

/// ARGV: P. Deletes, in one bounded step ([`WIPE_BUDGET`] entries), the state of dead nodes
/// (those that stopped renewing). Returns `{nodes reaped whole, dead nodes left}`.
pub(super) const REAP: &str = r#"
local reaped = reap(WIPE_BUDGET, redis.call('SCARD', P .. ':nodes'))
local left = 0
for _, n in ipairs(redis.call('SMEMBERS', P .. ':nodes')) do
  if redis.call('EXISTS', P .. ':node:' .. n) == 0 then left = left + 1 end
end
return {reaped, left}
"#;

/// ARGV: P, call id, its repeat window (ms), node. The node leaves now, as if its announcement had expired, and its
/// placements and reservations are deleted ([`WIPE_BUDGET`] entries a call). Returns
/// `{was alive (1/0), emptied (1/0)}`: call again until emptied (the node stays dead
/// meanwhile, and reapers finish the work if the caller stops). A repeat of a call (same id)
/// answers as the call did.
pub(super) const LEAVE: &str = r#"
local kept = replayed()
if kept then return kept end
local n = ARGV[4]
local was = redis.call('DEL', P .. ':node:' .. n)
local done = wipe(n, WIPE_BUDGET)
return answered({was, done and 1 or 0})
"#;

/// Entries of dead nodes one script call deletes at most (`WIPE_BUDGET` in the scripts): the
/// bound on the work a join, a leave, a renewal or a reap does in one call, so no call holds
/// Redis for long whatever a dead node left behind.
pub(super) const WIPE_BUDGET: u32 = 1024;

/// Group summaries one key's `member` field names at most (`GROUPS_PER_KEY` in the scripts):
/// a key in more groups (prefixes that share it and then part) drops the oldest group's
/// summary, which is built again by the next lookup that finds it whole.
pub(super) const GROUPS_PER_KEY: u32 = 4;

/// How long a call that must not act twice (a reserve, publish, removal, eviction or leave)
/// keeps its answers for a repeat, for a client whose calls time out after `timeout`: a
/// client makes a call at most five times, each at once after the previous one failed, which
/// takes at most `timeout` (see `conn::Conns::with`); one second more for the clocks' ticks.
/// At most a day, whatever the timeout (Redis refuses an expiry past its clock's range).
pub(super) fn repeat_window(timeout: std::time::Duration) -> std::time::Duration {
    let window = timeout.saturating_mul(5).saturating_add(std::time::Duration::from_secs(1));
    window.min(std::time::Duration::from_secs(24 * 3600))
}

/// The full source of a script: the prelude, then its body.
pub(super) fn source(body: &str) -> String {
    format!(
        "local WIPE_BUDGET = {WIPE_BUDGET}\nlocal GROUPS_PER_KEY = {GROUPS_PER_KEY}\n\
         local PLACEMENT_BYTES = {}\nlocal SUMMARY_TAG = {}\n{PRELUDE}{body}",
        crate::placement::PLACEMENT_BYTES,
        super::seal::SUMMARY_TAG
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::repeat_window;

    /// Five timeouts and a second, and never past a day (Redis takes the window as a `PX`).
    #[test]
    fn the_repeat_window_covers_five_calls_and_stays_in_redis_range() {
        assert_eq!(repeat_window(Duration::from_secs(5)), Duration::from_secs(26));
        assert_eq!(repeat_window(Duration::from_millis(200)), Duration::from_secs(2));
        assert_eq!(repeat_window(Duration::MAX), Duration::from_secs(24 * 3600));
    }
}
