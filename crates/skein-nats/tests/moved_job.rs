//! A parent's job that moves to another worker: NATS keeps the notices whatever happens
//! to a worker, so the worker that loads the parent without a cached fold reads the
//! parent's notices and settles the children they name, and reads no log of a child
//! still running (nor pushes its job again). A parent whose job stays on the worker that
//! kept its fold reads its few children's last records with its notices, and reads again
//! a child whose record read so was not its end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use skein_core::{AgentSet, Event, Record, SessionId};
use skein_llm::scripted::ScriptedProvider;
use skein_llm::Registry;
use skein_nats::{NatsConfig, NatsStore};
use skein_runtime::ports::{Backend, Durability, EventLog, Job};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_runtime::Result;
use skein_testnats::NatsServer;
use skein_tools::ToolBox;

/// The log port of one worker, noting which sessions it read; when `stale` names a
/// session, its next `last` answers with the record before its last (what a read served a
/// moment before that session's end returns).
struct Watched {
    inner: Arc<dyn EventLog>,
    read: Mutex<Vec<SessionId>>,
    stale: Mutex<Option<SessionId>>,
}

#[async_trait]
impl EventLog for Watched {
    async fn append(
        &self,
        session: &SessionId,
        expected_last: u64,
        records: &[Record],
        durability: Durability,
    ) -> Result<()> {
        self.inner
            .append(session, expected_last, records, durability)
            .await
    }
    async fn read(&self, session: &SessionId, from_seq: u64) -> Result<Vec<Record>> {
        self.read.lock().unwrap().push(session.clone());
        self.inner.read(session, from_seq).await
    }
    async fn last(&self, session: &SessionId) -> Result<Option<Record>> {
        self.read.lock().unwrap().push(session.clone());
        let stale = {
            let mut s = self.stale.lock().unwrap();
            (s.as_ref() == Some(session)).then(|| s.take())
        };
        if stale.is_some() {
            let mut all = self.inner.read(session, 1).await?;
            all.pop();
            return Ok(all.pop());
        }
        self.inner.last(session).await
    }
    async fn tree(&self, root: &SessionId) -> Result<Vec<SessionId>> {
        self.inner.tree(root).await
    }

    // Every read goes through `read`, where it is watched.
    async fn read_tree(
        &self,
        _root: &SessionId,
        _ids: &[SessionId],
    ) -> Result<Option<Vec<Vec<Record>>>> {
        Ok(None)
    }
    async fn roots(&self) -> Result<Vec<SessionId>> {
        self.inner.roots().await
    }
}

fn runtime(backend: Backend, dir: &std::path::Path) -> Arc<Runtime> {
    let agents = AgentSet::load(
        &[
            (
                "fanout.md".into(),
                "---\nname: fanout\nmodel: scripted:fanout\nagents: [leaf]\ncache: false\n---\nFan out.\n"
                    .into(),
            ),
            (
                "leaf.md".into(),
                "---\nname: leaf\nmodel: scripted:leaf\ncache: false\n---\nAnswer.\n".into(),
            ),
        ],
        &[],
    )
    .unwrap();
    let mut models = Registry::new();
    models.insert("scripted", Arc::new(ScriptedProvider::new(dir)));
    Runtime::new(
        backend,
        Arc::new(agents),
        models,
        ToolBox::new(),
        RuntimeConfig::default(),
    )
}

async fn claim(rt: &Runtime) -> Job {
    rt.backend
        .jobs
        .claim("default", Duration::from_secs(10))
        .await
        .unwrap()
        .expect("a job within 10 s")
}

async fn run(rt: &Runtime, job: &Job) {
    rt.process(job).await.unwrap();
    rt.backend.jobs.ack(job).await.unwrap();
}

fn cfg_of(server: &NatsServer) -> NatsConfig {
    NatsConfig {
        urls: vec![server.url()],
        ..NatsConfig::default()
    }
}

/// Scripts in `dir` for a root that delegates `children` one-turn children.
fn scripts(dir: &std::path::Path, children: usize) {
    std::fs::write(
        dir.join("fanout.yaml"),
        format!("turns:\n  - tool_calls:\n      - tool: call_agent\n        repeat: {children}\n        args: {{agent: leaf, mission: \"part {{{{ i }}}}\"}}\n  - answer: \"{{{{ results | length }}}} parts done\"\n"),
    )
    .unwrap();
    std::fs::write(dir.join("leaf.yaml"), "turns:\n  - answer: done\n").unwrap();
}

/// `backend` with its log port watched.
fn watched(mut backend: Backend) -> (Backend, Arc<Watched>) {
    let w = Arc::new(Watched {
        inner: backend.log.clone(),
        read: Mutex::new(vec![]),
        stale: Mutex::new(None),
    });
    backend.log = w.clone();
    (backend, w)
}

/// Submits the root on `rt` and runs its first turn there, then `ending` of its children;
/// the others are handed back to wait, still running. Returns the root, the root's wake-up
/// job (claimed, not run), the children that ended and those still running.
async fn until_the_root_wakes(
    rt: &Runtime,
    ending: usize,
) -> (SessionId, Job, Vec<SessionId>, Vec<SessionId>) {
    let root = rt
        .submit(Submission {
            agent: "fanout".into(),
            mission: "parts".into(),
            no_cache: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let job = claim(rt).await;
    assert_eq!(job.session, root);
    run(rt, &job).await;
    let (mut ended, mut running) = (vec![], vec![]);
    let wake = loop {
        let job = claim(rt).await;
        if job.session == root {
            break job;
        }
        if ended.len() < ending {
            run(rt, &job).await;
            ended.push(job.session);
        } else {
            rt.backend
                .jobs
                .retry(&job, Duration::from_secs(3))
                .await
                .unwrap();
            running.push(job.session);
        }
    };
    (root, wake, ended, running)
}

/// The children `root` has recorded as settled, in log order.
async fn settled(rt: &Runtime, root: &SessionId) -> Vec<SessionId> {
    rt.backend
        .read_all(root)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|r| match r.env.body {
            Event::ChildSettled(s) => Some(s.child),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_loaded_by_another_worker_reads_its_notices_not_every_child() {
    let dir = tempfile::tempdir().unwrap();
    scripts(dir.path(), 4);
    let server = NatsServer::start();
    let cfg = cfg_of(&server);
    let lease = Duration::from_secs(30);
    let a = runtime(
        NatsStore::connect(&cfg, lease).await.unwrap().backend(),
        dir.path(),
    );
    let (b_backend, watched) = watched(NatsStore::connect(&cfg, lease).await.unwrap().backend());
    let b = runtime(b_backend, dir.path());
    // Worker A runs the root's first turn (four delegations), then two of the children;
    // the other two are handed back to wait, still running.
    let (root, moved, ended, running) = until_the_root_wakes(&a, 2).await;
    assert_eq!(
        (ended.len(), running.len()),
        (2, 2),
        "{ended:?} {running:?}"
    );
    // The root's wake-up goes to worker B, which has never seen the root. (A claimed
    // it, and acks it: a queue takes acks only for the deliveries it holds.)
    b.process(&moved).await.unwrap();
    a.backend.jobs.ack(&moved).await.unwrap();
    let read = watched.read.lock().unwrap().clone();
    for child in &running {
        assert!(
            !read.contains(child),
            "worker B read the log of {child}, still running: {read:?}"
        );
    }
    // The ended children's ends came with their notices: worker B settles them without
    // reading their logs either.
    for child in &ended {
        assert!(
            !read.contains(child),
            "{child}'s end came with its notice, yet its log was read: {read:?}"
        );
    }
    let mut want = ended.clone();
    want.sort();
    let mut got = settled(&b, &root).await;
    got.sort();
    assert_eq!(got, want);

    // The two left run on either worker and the tree ends with all four parts.
    while !b
        .backend
        .log
        .last(&root)
        .await
        .unwrap()
        .is_some_and(|r| r.env.body.is_terminal())
    {
        let job = claim(&b).await;
        run(&b, &job).await;
    }
    let last = b.backend.log.last(&root).await.unwrap().unwrap();
    assert!(
        matches!(&last.env.body, Event::Completed(c) if c.answer.to_string().contains("4 parts done")),
        "{:?}",
        last.env.body
    );
}

/// A parent whose fold its worker kept reads the last records of its few children with
/// its notices, before it knows which have ended. A child whose record read so was not yet
/// its end (the read was served just before the child ended) is read again once its
/// notice is seen, and settled: the parent does not wait for ever on a child that ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_read_just_before_its_end_is_read_again_and_settled() {
    let dir = tempfile::tempdir().unwrap();
    scripts(dir.path(), 2);
    let server = NatsServer::start();
    let cfg = cfg_of(&server);
    let store = NatsStore::connect(&cfg, Duration::from_secs(30))
        .await
        .unwrap();
    let (backend, log) = watched(store.backend());
    let a = runtime(backend, dir.path());
    // One child ends (its notice posted, the root woken); the other is handed back.
    let (root, wake, ended, running) = until_the_root_wakes(&a, 1).await;
    let (ended, held) = (ended[0].clone(), running[0].clone());
    *log.stale.lock().unwrap() = Some(ended.clone());
    run(&a, &wake).await;
    assert!(
        log.stale.lock().unwrap().is_none(),
        "the ended child's last record was not read with the notices"
    );
    assert_eq!(
        settled(&a, &root).await,
        vec![ended],
        "{held} is still running"
    );
}
