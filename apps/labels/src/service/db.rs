//! The labels rows: the SQL both databases run, behind one trait so that every
//! handler (REST and gRPC, keys in the same database or in Redis) is written once.

use idemkit_core::TransactionalStore;
use idemkit_postgres::PgStore;
use idemkit_sqlite::SqliteStore;

use super::Shipment;

/// The SQL both databases run (placeholders in order of first use, so SQLite's
/// `$n` names bind like PostgreSQL's positions).
mod sql {
    pub(super) const INSERT: &str = "INSERT INTO labels (id, account, courier, status, request, created_at) \
         VALUES ($1, $2, $3, 'pending', $4, $5)";
    pub(super) const CREATED: &str = "UPDATE labels SET status = 'created', courier_order = $1, courier_tracking = $2, \
         courier_shipment = $3, error = NULL WHERE id = $4";
    pub(super) const FAILED: &str = "UPDATE labels SET status = 'failed', error = $1 WHERE id = $2";
    /// With keys on Redis: the label row's id is derived from the request's
    /// downstream key, so a re-run of the phase (a takeover after a crash
    /// before its result was recorded) writes nothing.
    pub(super) const INSERT_KEYED: &str = "INSERT INTO labels (id, account, courier, status, request, created_at) \
         VALUES ($1, $2, $3, 'pending', $4, $5) ON CONFLICT (id) DO NOTHING";
    /// With keys on Redis the write is not fenced by a transaction: a stale
    /// holder may never turn a created label back into a failed one.
    pub(super) const FAILED_UNLESS_CREATED: &str =
        "UPDATE labels SET status = 'failed', error = $1 WHERE id = $2 AND status <> 'created'";
    pub(super) const SELECT: &str = "SELECT id, courier, status, courier_order, courier_tracking, error, courier_shipment \
         FROM labels WHERE account = $1 AND (id = $2 OR courier_tracking = $2)";
    pub(super) const TABLE_SQLITE: &str = "CREATE TABLE IF NOT EXISTS labels (id TEXT PRIMARY KEY, account TEXT NOT NULL, \
         courier TEXT NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, courier_order TEXT, courier_tracking TEXT, \
         courier_shipment INTEGER, error TEXT, created_at INTEGER NOT NULL)";
    pub(super) const TABLE_PG: &str = "CREATE TABLE IF NOT EXISTS labels (id TEXT PRIMARY KEY, account TEXT NOT NULL, \
         courier TEXT NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, courier_order TEXT, courier_tracking TEXT, \
         courier_shipment BIGINT, error TEXT, created_at BIGINT NOT NULL)";
}

/// A label row as read: id, courier, status, order, tracking, error, shipment.
pub(super) type Row = (
    String,
    String,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
);

/// A new (pending) label row.
pub(super) struct NewLabel<'a> {
    pub(super) id: &'a str,
    pub(super) account: &'a str,
    pub(super) courier: &'a str,
    /// The request as received (REST body, or the gRPC request's JSON mapping).
    pub(super) request: &'a str,
    pub(super) created_at: i64,
}

/// The labels table on one database: in a phase's transaction (keys in the
/// same database) or on its own (keys in Redis).
#[async_trait::async_trait]
pub(super) trait LabelsDb: TransactionalStore + Send + Sync + 'static {
    /// Creates the table if it is missing.
    async fn create_table(&self) -> Result<(), sqlx::Error>;
    /// Inserts a pending label in the phase's transaction.
    async fn insert(tx: &mut Self::Tx, row: &NewLabel<'_>) -> Result<(), sqlx::Error>;
    /// Marks a label created with its shipment, in the phase's transaction.
    async fn mark_created(tx: &mut Self::Tx, id: &str, s: &Shipment) -> Result<(), sqlx::Error>;
    /// Marks a label failed, in the phase's transaction.
    async fn mark_failed(tx: &mut Self::Tx, id: &str, error_json: &str) -> Result<(), sqlx::Error>;
    /// Inserts a pending label on its own, unless the id exists.
    async fn insert_keyed(&self, row: &NewLabel<'_>) -> Result<(), sqlx::Error>;
    /// Marks a label created on its own (the same values on every attempt).
    async fn mark_created_keyed(&self, id: &str, s: &Shipment) -> Result<(), sqlx::Error>;
    /// Marks a label failed on its own, unless it is created.
    async fn mark_failed_unless_created(&self, id: &str, error_json: &str) -> Result<(), sqlx::Error>;
    /// The account's label with this id or tracking number.
    async fn find(&self, account: &str, id: &str) -> Result<Option<Row>, sqlx::Error>;
}

/// The same statements on either database; only the table definition differs.
macro_rules! labels_db {
    ($store:ty, $table:expr) => {
        #[async_trait::async_trait]
        impl LabelsDb for $store {
            async fn create_table(&self) -> Result<(), sqlx::Error> {
                sqlx::query($table).execute(self.pool()).await.map(|_| ())
            }

            async fn insert(tx: &mut Self::Tx, row: &NewLabel<'_>) -> Result<(), sqlx::Error> {
                sqlx::query(sql::INSERT)
                    .bind(row.id)
                    .bind(row.account)
                    .bind(row.courier)
                    .bind(row.request)
                    .bind(row.created_at)
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
            }

            async fn mark_created(tx: &mut Self::Tx, id: &str, s: &Shipment) -> Result<(), sqlx::Error> {
                sqlx::query(sql::CREATED)
                    .bind(&s.order_number)
                    .bind(&s.tracking_number)
                    .bind(s.shipment)
                    .bind(id)
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
            }

            async fn mark_failed(tx: &mut Self::Tx, id: &str, error_json: &str) -> Result<(), sqlx::Error> {
                sqlx::query(sql::FAILED)
                    .bind(error_json)
                    .bind(id)
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
            }

            async fn insert_keyed(&self, row: &NewLabel<'_>) -> Result<(), sqlx::Error> {
                sqlx::query(sql::INSERT_KEYED)
                    .bind(row.id)
                    .bind(row.account)
                    .bind(row.courier)
                    .bind(row.request)
                    .bind(row.created_at)
                    .execute(self.pool())
                    .await
                    .map(|_| ())
            }

            async fn mark_created_keyed(&self, id: &str, s: &Shipment) -> Result<(), sqlx::Error> {
                sqlx::query(sql::CREATED)
                    .bind(&s.order_number)
                    .bind(&s.tracking_number)
                    .bind(s.shipment)
                    .bind(id)
                    .execute(self.pool())
                    .await
                    .map(|_| ())
            }

            async fn mark_failed_unless_created(
                &self,
                id: &str,
                error_json: &str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(sql::FAILED_UNLESS_CREATED)
                    .bind(error_json)
                    .bind(id)
                    .execute(self.pool())
                    .await
                    .map(|_| ())
            }

            async fn find(&self, account: &str, id: &str) -> Result<Option<Row>, sqlx::Error> {
                sqlx::query_as(sql::SELECT)
                    .bind(account)
                    .bind(id)
                    .fetch_optional(self.pool())
                    .await
            }
        }
    };
}

labels_db!(SqliteStore, sql::TABLE_SQLITE);
labels_db!(PgStore, sql::TABLE_PG);
