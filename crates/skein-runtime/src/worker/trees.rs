//! Whole trees in one process: re-enqueue a tree after a crash, run a tree to its end
//! (or its pause) with only its own jobs taken.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use skein_core::SessionId;

use crate::runtime::{lock, Runtime};
use crate::session::Folded;
use crate::Result;

/// The trees a [`Runtime::run_tree`] works on, by root.
pub(crate) struct Scope {
    roots: Mutex<BTreeSet<SessionId>>,
}

impl Scope {
    fn new(root: &SessionId) -> Self {
        Self {
            roots: Mutex::new([root.root_id()].into()),
        }
    }

    pub(crate) fn wants(&self, session: &SessionId) -> bool {
        lock(&self.roots).contains(&session.root_id())
    }

    fn roots(&self) -> Vec<SessionId> {
        lock(&self.roots).iter().cloned().collect()
    }

    fn extend(&self, roots: Vec<SessionId>) {
        lock(&self.roots).extend(roots);
    }
}

impl Runtime {
    /// Roots of the trees that sessions of `scope` wait on through a shared run
    /// (single-flight) and that are not in it yet.
    pub(crate) async fn shared_trees(&self, scope: &Scope) -> Result<Vec<SessionId>> {
        let mut out = BTreeSet::new();
        for root in scope.roots() {
            for id in self.backend.log.tree(&root).await? {
                let records = self.backend.log.read(&id, 1).await?;
                let mut f = Folded::new(id.clone());
                f.absorb(&records)?;
                for slot in &f.state.turn {
                    if let skein_core::state::SlotState::Delegated {
                        child,
                        shared: true,
                        ..
                    } = &slot.state
                    {
                        if !scope.wants(child) {
                            out.insert(child.root_id());
                        }
                    }
                }
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Every session of the tree of `root`, folded to the end of its log, in the order of
    /// [`EventLog::tree`](crate::ports::EventLog::tree): the fold this runtime keeps of it
    /// with whatever its log holds past that, or, where none is kept, its whole log read
    /// and folded ([`crate::inspect::tree_folds`]). At the end of a run, which folded every
    /// record of the tree as it wrote it, this reads no record again.
    ///
    /// A kept fold is shared with the cache rather than copied (a wide tree's report would
    /// otherwise copy a thousand conversations), unless its log holds records past it.
    pub async fn tree_folds_held(&self, root: &SessionId) -> Result<Vec<Arc<Folded>>> {
        let ids = self.backend.log.tree(root).await?;
        let mut out: Vec<Option<Arc<Folded>>> = Vec::with_capacity(ids.len());
        let mut missing = vec![];
        for (i, id) in ids.iter().enumerate() {
            match self.sessions.kept(id) {
                Some(mut f) => {
                    let new = self.backend.log.read(id, f.state.last_seq + 1).await?;
                    if !new.is_empty() {
                        Arc::make_mut(&mut f).absorb(&new)?;
                    }
                    out.push(Some(f));
                }
                None => {
                    missing.push((i, id.clone()));
                    out.push(None);
                }
            }
        }
        if !missing.is_empty() {
            let at: Vec<usize> = missing.iter().map(|(i, _)| *i).collect();
            let read = crate::inspect::read_and_fold(
                &self.backend,
                root,
                missing.into_iter().map(|(_, id)| id).collect(),
            )
            .await?;
            for (i, (_, f)) in at.into_iter().zip(read) {
                out[i] = Some(Arc::new(f));
            }
        }
        // A session named in the tree whose first record was never written is passed
        // over (see `EventLog::tree`).
        Ok(out
            .into_iter()
            .flatten()
            .filter(|f| f.state.last_seq > 0)
            .collect())
    }

    /// Keeps the folds of those of `ids` (sessions of the tree of `root`) this runtime
    /// keeps none of, where the backend reads them together (one pass over a wide tree
    /// on NATS): a walk over a whole tree (a resume, a cancel) then loads each session with
    /// a read of its log's tail only. Nothing where the backend reads log by log, or where
    /// the folds would not fit in what this runtime keeps.
    pub(crate) async fn keep_tree(&self, root: &SessionId, ids: &[SessionId]) -> Result<()> {
        let cold: Vec<SessionId> = ids
            .iter()
            .filter(|id| !self.sessions.keeps(id))
            .cloned()
            .collect();
        if cold.len() < 2 || cold.len() > self.cfg.state_cache / 2 {
            return Ok(());
        }
        let Some(logs) = crate::inspect::read_together(&self.backend, root, &cold).await? else {
            return Ok(());
        };
        for (id, records) in cold.iter().zip(logs) {
            if !records.is_empty() {
                self.keep_state(crate::inspect::fold_records(id, &records)?);
            }
        }
        Ok(())
    }

    /// Re-enqueues every session of the tree that has not ended (what makes `resume`
    /// work after a crash). Returns how many were enqueued.
    pub async fn requeue_tree(&self, root: &SessionId) -> Result<usize> {
        let mut n = 0;
        let ids = self.backend.log.tree(root).await?;
        self.keep_tree(root, &ids).await?;
        for id in ids {
            let (f, _) = self.load(&id).await?;
            if f.state.last_seq == 0 {
                // Named in the tree, never written (see `EventLog::tree`).
                continue;
            }
            let pool = f.state.pool();
            let terminal = f.state.status.is_terminal();
            if !terminal {
                self.backend.jobs.push(&pool, &id).await?;
                n += 1;
            } else if f
                .state
                .submitted
                .as_ref()
                .is_some_and(|s| s.parent.is_some())
            {
                // A finished child whose parent may not have heard of it is woken too,
                // though its last job was acked as ended for good.
                self.backend.jobs.push_ended(&pool, &id).await?;
                n += 1;
            }
            self.keep_state(f);
        }
        Ok(n)
    }

    /// Runs workers in this process until the tree of `root` ends or has nothing left to
    /// run (paused for a person, or stuck); returns the root's final fold. Only this
    /// tree's jobs are taken (and those of a tree holding a run it shares): other trees
    /// waiting in the same queue stay as they are until they are run themselves.
    pub async fn run_tree(
        self: &Arc<Self>,
        root: &SessionId,
        concurrency: usize,
    ) -> Result<Folded> {
        let pools = self.pools();
        let scope = Arc::new(Scope::new(root));
        let (stop, handles) = self.spawn_in(pools.clone(), concurrency, Some(scope.clone()));
        let mut ends = self.ends.subscribe();
        // Watch the root's last record (not the fold cache the workers use): it is read
        // again when a session ends (the root's own end is one), or when waiting timed
        // out. Whether any job is left is asked at most every `RECOUNT` while records are
        // appended, and every `IDLE` when none are: the count reads the whole queue, and
        // a wide tree appends thousands of records.
        const RECOUNT: Duration = Duration::from_millis(20);
        const IDLE: Duration = Duration::from_millis(250);
        let appended = || self.appended.load(std::sync::atomic::Ordering::Relaxed);
        let result: Result<()> = async {
            // When the queue was last counted, and how many records had been appended then.
            let mut counted: Option<(tokio::time::Instant, u64)> = None;
            let mut check_root = true;
            loop {
                if check_root {
                    let last = self.backend.log.last(root).await?;
                    if last.as_ref().is_some_and(|r| r.env.body.is_terminal()) {
                        return Ok(());
                    }
                }
                let due = counted.is_none_or(|(at, seen)| {
                    let since = at.elapsed();
                    since >= IDLE || (since >= RECOUNT && appended() != seen)
                });
                if due {
                    counted = Some((tokio::time::Instant::now(), appended()));
                    let mut pending = 0;
                    let s = scope.clone();
                    let want = move |id: &SessionId| s.wants(id);
                    for p in &pools {
                        pending += self.backend.jobs.depth_matching(p, &want).await?;
                    }
                    if pending == 0 {
                        // Nothing left here: unless a session waits on a run in another
                        // tree, which then joins the scope, the tree is paused or stuck.
                        let more = self.shared_trees(&scope).await?;
                        if more.is_empty() {
                            return Ok(());
                        }
                        scope.extend(more);
                        check_root = true;
                        continue;
                    }
                }
                // Another session's end leaves the root as it was; the root's own end, a
                // missed end (lagged) or the time up has it read again.
                check_root = match tokio::time::timeout(RECOUNT, ends.recv()).await {
                    Ok(Ok(ended)) => ended == *root,
                    Ok(Err(_)) | Err(_) => true,
                };
            }
        }
        .await;
        let _ = stop.send(true);
        for h in handles {
            let _ = h.await;
        }
        result?;
        // The root's fold as the run left it, where it is kept: a wide root's log is
        // thousands of records, and reading and folding all of it again cost a tree of
        // 1,024 children some 8 ms after its end.
        let kept = self.sessions.kept(root).map(Arc::unwrap_or_clone);
        self.read_past(kept.unwrap_or_else(|| Folded::new(root.clone())))
            .await
    }

    /// `f` with the records its log holds past it folded in.
    async fn read_past(&self, mut f: Folded) -> Result<Folded> {
        let new = self.backend.log.read(&f.id, f.state.last_seq + 1).await?;
        f.absorb(&new)?;
        Ok(f)
    }
}
