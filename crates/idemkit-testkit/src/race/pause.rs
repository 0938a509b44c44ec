//! Yield points: pausing a step inside a store operation, so the scheduler can
//! run another actor between a store's read and its write.

use super::*;

pub(super) enum Stepped {
    Done(StepResult),
    Paused(Paused),
}

/// The steps the scheduler is watching, and how to wake a paused one.
#[derive(Default)]
struct Pauses {
    /// Tasks whose yield points pause.
    watched: HashSet<tokio::task::Id>,
    /// Paused tasks and the channel that lets each go on.
    go: HashMap<tokio::task::Id, std::sync::mpsc::Sender<()>>,
    /// Tells the scheduler a task reached a yield point.
    hit: Option<tokio::sync::mpsc::UnboundedSender<tokio::task::Id>>,
}

fn pauses() -> &'static Mutex<Pauses> {
    static PAUSES: OnceLock<Mutex<Pauses>> = OnceLock::new();
    PAUSES.get_or_init(Mutex::default)
}

fn lock_pauses() -> std::sync::MutexGuard<'static, Pauses> {
    pauses().lock().unwrap_or_else(|e| e.into_inner())
}

/// The scheduler's end of the hit channel (one scheduler runs at a time per
/// process: `SCHEDULER` serialises them).
fn hits() -> &'static tokio::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<tokio::task::Id>>> {
    static HITS: OnceLock<tokio::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<tokio::task::Id>>>> =
        OnceLock::new();
    HITS.get_or_init(|| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        lock_pauses().hit = Some(tx);
        tokio::sync::Mutex::new(Some(rx))
    })
}

pub(super) fn install_yield_points(points: &'static [&'static str]) {
    static INSTALLED: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let installed = INSTALLED.get_or_init(Mutex::default);
    let mut installed = installed.lock().unwrap_or_else(|e| e.into_inner());
    for point in points {
        if installed.insert(point) {
            let _ = hits();
            fail::cfg_callback(*point, yield_here).expect("failpoint callback");
        }
    }
}

/// The failpoint callback: a watched task blocks here (its worker thread
/// parked) until the scheduler lets it go on; any other task passes.
fn yield_here() {
    let Some(id) = tokio::task::try_id() else { return };
    let rx = {
        let mut p = lock_pauses();
        if !p.watched.contains(&id) {
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        p.go.insert(id, tx);
        if let Some(hit) = &p.hit {
            let _ = hit.send(id);
        }
        rx
    };
    // Parked without starving the tasks queued on this worker (tokio hands
    // them to another thread): a parked step must not stall the others.
    tokio::task::block_in_place(|| rx.recv()).ok();
}

pub(super) async fn start_step(fut: Pin<Box<dyn Future<Output = StepResult> + Send>>) -> Stepped {
    let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        let _ = gate_rx.await;
        fut.await
    });
    let id = handle.id();
    lock_pauses().watched.insert(id);
    let _ = gate_tx.send(());
    wait(Paused { handle, id }).await
}

pub(super) async fn resume_paused(paused: Paused) -> Stepped {
    if let Some(go) = lock_pauses().go.remove(&paused.id) {
        let _ = go.send(());
    }
    wait(paused).await
}

/// Waits until the step ends or pauses at a yield point.
async fn wait(mut paused: Paused) -> Stepped {
    let mut hits = hits().lock().await;
    let rx = hits.as_mut().expect("hit channel");
    loop {
        tokio::select! {
            done = &mut paused.handle => {
                lock_pauses().watched.remove(&paused.id);
                return Stepped::Done(done.unwrap_or_else(|e| Err(format!("step panicked: {e}"))));
            }
            Some(id) = rx.recv() => {
                if id == paused.id {
                    return Stepped::Paused(paused);
                }
            }
        }
    }
}
