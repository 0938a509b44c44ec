-- Each lease-mode claim's write carries the claiming call's attempt id
-- (issue 30, item 5). A claim whose statement was sent but whose reply never
-- arrived (the connection dropped after the commit) reads the record again on
-- another connection: if it carries this attempt's id, in flight on a live
-- lease, the claim committed and its caller holds the key, instead of the key
-- being held by nobody for a whole lease. Nullable, with no default: adding it
-- rewrites nothing, and records claimed by an older release (or in
-- single-step mode, whose claims commit with the handler) have none.
ALTER TABLE idemkit_keys ADD COLUMN IF NOT EXISTS claim_attempt TEXT;
