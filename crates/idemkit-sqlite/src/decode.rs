//! Rows to records. The columns are read here; parsing them (states, headers,
//! step outputs) and its errors live once, in `idemkit_core::storage::RecordRow` and
//! `ReviewRow`, for every SQL backend.

use idemkit_core::storage::{RecordRow, ReviewRow};
use idemkit_core::{Record, ReviewEntry, Scope, StoreError, StoreResult};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};

use crate::error::map_err;
use crate::sql::SELECT_RECORD;

pub(crate) async fn fetch_record(conn: &mut SqliteConnection, scope: &Scope) -> StoreResult<Option<Record>> {
    let row = sqlx::query(SELECT_RECORD)
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(map_err)?;
    row.map(|r| decode_at(&r, 0)).transpose()
}

/// Reads the 18 record columns starting at `at` (0 for `SELECT_RECORD`).
pub(crate) fn decode_at(row: &SqliteRow, at: usize) -> StoreResult<Record> {
    let g = |e: sqlx::Error| StoreError::Corrupt(e.to_string());
    Record::try_from(RecordRow {
        account: row.try_get(at).map_err(g)?,
        key: row.try_get(at + 1).map_err(g)?,
        fingerprint: row.try_get(at + 2).map_err(g)?,
        state: row.try_get(at + 3).map_err(g)?,
        created_at: row.try_get(at + 4).map_err(g)?,
        completed_at: row.try_get(at + 5).map_err(g)?,
        lease_expires_at: row.try_get(at + 6).map_err(g)?,
        fencing_token: row.try_get(at + 7).map_err(g)?,
        recovery_point: row.try_get(at + 8).map_err(g)?,
        step_outputs: row.try_get(at + 9).map_err(g)?,
        req_method: row.try_get(at + 10).map_err(g)?,
        req_path: row.try_get(at + 11).map_err(g)?,
        req_headers: row.try_get(at + 12).map_err(g)?,
        req_body: row.try_get(at + 13).map_err(g)?,
        resp_status: row.try_get(at + 14).map_err(g)?,
        resp_headers: row.try_get(at + 15).map_err(g)?,
        resp_body: row.try_get(at + 16).map_err(g)?,
        last_error: row.try_get(at + 17).map_err(g)?,
    })
}

/// Decodes a row of `idemkit_review` (columns in the order `SELECT_REVIEW` selects).
pub(crate) fn decode_review(row: &SqliteRow) -> StoreResult<ReviewEntry> {
    let g = |e: sqlx::Error| StoreError::Corrupt(e.to_string());
    ReviewEntry::try_from(ReviewRow {
        account: row.try_get(0).map_err(g)?,
        key: row.try_get(1).map_err(g)?,
        state: row.try_get(2).map_err(g)?,
        created_at: row.try_get(3).map_err(g)?,
        reaped_at: row.try_get(4).map_err(g)?,
        recovery_point: row.try_get(5).map_err(g)?,
        step_outputs: row.try_get(6).map_err(g)?,
        last_error: row.try_get(7).map_err(g)?,
        req_method: row.try_get(8).map_err(g)?,
        req_path: row.try_get(9).map_err(g)?,
        req_headers: row.try_get(10).map_err(g)?,
        req_body: row.try_get(11).map_err(g)?,
    })
}
