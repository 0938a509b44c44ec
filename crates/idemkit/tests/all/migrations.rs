//! Migrations are never edited once they exist: an applied migration whose
//! file changed makes sqlx refuse the database (checksum mismatch) on every
//! instance, and the stores' tolerance of unknown versions (`ignore_missing`)
//! does not cover that. Each migration's checksum is pinned here (its first 8
//! bytes, as applied databases hold it); a new migration adds its line.

/// PostgreSQL's migrations.
const POSTGRES: &[(i64, &str)] = &[
    (20261130000001, "32684898abe20d78"),
    (20261201000001, "91defe672a843ddb"),
    (20261215000001, "508d01370e1ada98"),
    (20261216000001, "5f4da9d6e59e56db"),
    (20261217000001, "bfc3518e048b976f"),
    (20261218000001, "018018f19af31bd4"),
    (20261219000001, "52b73a17ef6d5e10"),
    (20261220000001, "968ddd3a18996d7c"),
    (20261221000001, "0ffe3a4e4c7a2ecc"),
    (20261222000001, "cc3f76d9ba410e60"),
];

/// SQLite's migrations.
const SQLITE: &[(i64, &str)] = &[
    (20261130000001, "7cbc9905a226ed51"),
    (20261201000001, "9cd69b62d6ab3716"),
    (20261215000001, "f6532604cf0e4c55"),
    (20261217000001, "bfc3518e048b976f"),
    (20261221000001, "82b348f2352a9dd8"),
];

fn checksums(migrator: &sqlx::migrate::Migrator) -> Vec<(i64, String)> {
    migrator
        .iter()
        .map(|m| {
            (
                m.version,
                m.checksum[..8].iter().map(|b| format!("{b:02x}")).collect(),
            )
        })
        .collect()
}

#[test]
fn migrations_are_never_edited() {
    for (store, migrator, pinned) in [
        ("postgres", &idemkit::stores::postgres::MIGRATOR, POSTGRES),
        ("sqlite", &idemkit::stores::sqlite::MIGRATOR, SQLITE),
    ] {
        let pinned: Vec<(i64, String)> = pinned.iter().map(|(v, c)| (*v, (*c).to_owned())).collect();
        assert_eq!(
            checksums(migrator),
            pinned,
            "{store}: a migration file changed (never edit one: add a new migration) or a new one is not pinned yet"
        );
    }
}
