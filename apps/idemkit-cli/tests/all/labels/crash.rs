//! SIGKILL of `idemkit serve` at each boundary of a label request, and what
//! the database and the courier hold afterwards.

use super::*;

/// A label row of the service's database.
#[cfg(feature = "failpoints")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LabelRow {
    pub(crate) id: String,
    pub(crate) status: String,
    pub(crate) order: Option<String>,
    pub(crate) tracking: Option<String>,
    pub(crate) shipment: Option<i64>,
}

/// The label rows written for one idempotency key, oldest first.
#[cfg(feature = "failpoints")]
pub(crate) async fn label_rows(labels: &Labels, key: &str) -> Vec<LabelRow> {
    let url = format!("sqlite://{}?mode=ro", labels.db().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    type Raw = (String, String, Option<String>, Option<String>, Option<i64>);
    let rows: Vec<Raw> = sqlx::query_as(
        "SELECT id, status, courier_order, courier_tracking, courier_shipment FROM labels \
         WHERE json_extract(request, '$.idempotencyKey') = ?1 ORDER BY created_at, id",
    )
    .bind(key)
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    rows.into_iter()
        .map(|(id, status, order, tracking, shipment)| LabelRow {
            id,
            status,
            order,
            tracking,
            shipment,
        })
        .collect()
}

/// The courier's `POST /shipments` calls so far.
#[cfg(feature = "failpoints")]
pub(super) async fn calls_of(labels: &Labels) -> i64 {
    labels.stats().await["calls"].as_i64().unwrap()
}

/// The courier's shipment ids booked for one label (its `reference`).
#[cfg(feature = "failpoints")]
pub(super) async fn courier_shipments(labels: &Labels, label_id: &str) -> Vec<i64> {
    let url = format!("sqlite://{}?mode=ro", labels.dir.join("courier.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM courier_shipments WHERE reference = ?1 ORDER BY id")
            .bind(label_id)
            .fetch_all(&pool)
            .await
            .unwrap();
    pool.close().await;
    ids
}

/// SIGKILL at each phase boundary, then, from what the killed attempt
/// committed (read before any retry): exactly one label row for the key (the
/// committed one, when there is one), exactly one courier shipment for it,
/// exactly the courier calls the boundary implies (the courier honours keys: an
/// intent without a result is re-issued once with the same key, a duplicate the
/// courier suppresses; nothing else is called again), and an answer that is that
/// row with that shipment (a replay exactly when the killed attempt completed).
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_each_boundary_keeps_one_label_and_one_shipment() {
    let mut labels = Labels::start();
    // (boundary, courier calls made by the killed attempt, calls in all,
    //  whether it committed the label row, whether it completed)
    let boundaries = [
        ("idemkit::after_claim", 0, 1, false, false),
        ("idemkit::after_phase", 0, 1, true, false),
        ("idemkit::after_intent", 0, 1, true, false),
        ("idemkit::after_call", 1, 2, true, false),
        ("idemkit::after_complete", 1, 1, true, true),
    ];
    let boundaries = boundaries.map(|(b, at, all, row, done)| (b, at, all, row, done, done));
    crash_at_boundaries(&mut labels, &boundaries).await;
}

/// One boundary of [`crash_at_boundaries`]: (failpoint, courier calls made by
/// the killed attempt, calls in all, whether it committed the label row,
/// whether that row was already `created`, whether the key was completed).
#[cfg(feature = "failpoints")]
pub(super) type Boundary = (&'static str, i64, i64, bool, bool, bool);

/// SIGKILL at each of `boundaries` in turn, each with a fresh key (see
/// `crash_at_each_boundary_keeps_one_label_and_one_shipment`).
#[cfg(feature = "failpoints")]
pub(super) async fn crash_at_boundaries(labels: &mut Labels, boundaries: &[Boundary]) {
    for (n, &(boundary, calls_at_crash, calls, row_committed, row_created, completed)) in
        boundaries.iter().enumerate()
    {
        let stats = labels.stats().await;
        let (calls_before, shipments_before) = (
            stats["calls"].as_i64().unwrap(),
            stats["shipments"].as_i64().unwrap(),
        );
        labels.kill9();
        labels.start_service(&[("IDEMKIT_CRASH_AT", boundary)]);
        let key = format!("crash-{n}");
        let first = tokio::spawn({
            let (base, b) = (labels.base.clone(), body(&key, "GB"));
            async move {
                reqwest::Client::new()
                    .post(format!("{base}/labels"))
                    .bearer_auth(ACME)
                    .json(&b)
                    .send()
                    .await
            }
        });
        labels.wait_line(&format!("CRASHPOINT {boundary}"));
        labels.kill9();
        assert!(
            first.await.unwrap().is_err(),
            "{boundary}: the killed attempt cannot answer"
        );
        assert_eq!(
            calls_of(labels).await - calls_before,
            calls_at_crash,
            "{boundary}: courier calls of the killed attempt"
        );

        // What the killed attempt committed.
        let committed = label_rows(labels, &key).await;
        match committed.as_slice() {
            [] => assert!(!row_committed, "{boundary}: no label row committed"),
            [row] => {
                assert!(row_committed, "{boundary}: a label row before its phase: {row:?}");
                let done = row.status == "created";
                assert_eq!(done, row_created, "{boundary}: {row:?}");
                assert_eq!(row.tracking.is_some(), row_created, "{boundary}: {row:?}");
            }
            more => panic!(
                "{boundary}: the killed attempt wrote {} rows: {more:?}",
                more.len()
            ),
        }
        let booked_at_crash = match committed.first() {
            Some(row) => courier_shipments(labels, &row.id).await,
            None => vec![],
        };
        assert_eq!(
            booked_at_crash.len(),
            calls_at_crash as usize,
            "{boundary}: shipments booked by the killed attempt"
        );

        labels.start_service(&[]);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let answer = loop {
            let a = post(&labels.base, ACME, &body(&key, "GB")).await;
            if a.status == 201 || a.status == 200 {
                break a;
            }
            assert!(std::time::Instant::now() < deadline, "{boundary}: {a:?}");
            tokio::time::sleep(Duration::from_millis(150)).await;
        };
        assert_eq!(
            (answer.status, answer.replayed),
            if completed { (200, true) } else { (201, false) },
            "{boundary}: created, or replayed exactly when the killed attempt completed: {answer:?}"
        );

        let rows = label_rows(labels, &key).await;
        assert_eq!(
            rows.len(),
            1,
            "{boundary}: exactly one label row for the key: {rows:?}"
        );
        let row = &rows[0];
        if let Some(c) = committed.first() {
            assert_eq!(row.id, c.id, "{boundary}: the retry reused the committed row");
            if row_created {
                assert_eq!(row, c, "{boundary}: a replay changes nothing");
            }
        }
        assert_eq!(row.status, "created", "{boundary}: {row:?}");
        let booked = courier_shipments(labels, &row.id).await;
        assert_eq!(
            booked.len(),
            1,
            "{boundary}: exactly one courier shipment for the label: {booked:?}"
        );
        if !booked_at_crash.is_empty() {
            assert_eq!(
                booked, booked_at_crash,
                "{boundary}: the shipment the killed attempt booked"
            );
        }
        assert_eq!(
            row.shipment,
            Some(booked[0]),
            "{boundary}: the row records that shipment"
        );
        assert_eq!(
            calls_of(labels).await - calls_before,
            calls,
            "{boundary}: courier calls in all"
        );
        let stats = labels.stats().await;
        assert_eq!(
            stats["shipments"].as_i64().unwrap() - shipments_before,
            1,
            "{boundary}: one shipment per label"
        );
        // The answer is the row as committed.
        assert_eq!(answer.body["id"], json!(row.id), "{boundary}: {answer:?}");
        assert_eq!(answer.body["status"], "created", "{boundary}: {answer:?}");
        assert_eq!(
            answer.body["courierOrderNumber"],
            json!(row.order),
            "{boundary}: {answer:?}"
        );
        assert_eq!(
            answer.body["courierTrackingNumber"],
            json!(row.tracking),
            "{boundary}: {answer:?}"
        );
        assert!(answer.body["error"].is_null(), "{boundary}: {answer:?}");

        let again = post(&labels.base, ACME, &body(&key, "GB")).await;
        assert_eq!((again.status, again.replayed), (200, true), "{boundary}");
        assert_eq!(again.raw, answer.raw, "{boundary}: the same answer byte for byte");
        assert_eq!(
            calls_of(labels).await - calls_before,
            calls,
            "{boundary}: a replay calls nothing"
        );
        assert_eq!(
            label_rows(labels, &key).await,
            rows,
            "{boundary}: a replay writes nothing"
        );
    }
}
