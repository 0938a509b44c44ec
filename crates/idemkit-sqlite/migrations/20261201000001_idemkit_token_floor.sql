-- Fencing tokens never repeat for a key (SPEC §3, §7): the reaper deletes old
-- completed and released records, and a later claim of such a key must not start
-- again at token 1, where a holder paused since the deleted record's time could
-- still match. The reaper raises this floor to the highest token it deleted, in
-- its own transaction; new records start above it.
CREATE TABLE IF NOT EXISTS idemkit_token_floor (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    floor INTEGER NOT NULL
);
INSERT OR IGNORE INTO idemkit_token_floor (id, floor) VALUES (1, 0);
