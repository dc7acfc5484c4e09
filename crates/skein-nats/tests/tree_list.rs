//! Each tree's list of sessions (stream `SKEIN_TREES`) against a real nats-server: what a
//! tree listing returns is the same whether its list is whole, missing or damaged, and a
//! list that is missing or damaged is written again from the log.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use skein_core::event::{genesis_hash, Cancelled};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_nats::{NatsConfig, NatsStore};
use skein_runtime::ports::{Durability, EventLog};
use skein_testnats::NatsServer;

async fn store_on(server: &NatsServer) -> Arc<NatsStore> {
    let cfg = NatsConfig {
        urls: vec![server.url()],
        replicas: 1,
        ..NatsConfig::default()
    };
    NatsStore::connect(&cfg, Duration::from_secs(1))
        .await
        .unwrap()
}

fn id(s: &str) -> SessionId {
    SessionId::parse(s).unwrap()
}

fn first_record(s: &SessionId) -> Record {
    let env = Envelope::new(
        s.clone(),
        1,
        1,
        genesis_hash(s),
        Event::Cancelled(Cancelled {
            reason: "r1".into(),
        }),
    );
    Record::decode(env.encode().unwrap()).unwrap()
}

/// Writes the first record of each session, all at once (as a step that delegates to
/// many children does).
async fn write(store: &NatsStore, sessions: &[SessionId]) {
    let writes = sessions.iter().map(|s| async move {
        let r = first_record(s);
        store
            .append(s, 0, std::slice::from_ref(&r), Durability::Ahead)
            .await
            .unwrap();
    });
    futures::future::join_all(writes).await;
}

/// The messages on a tree's list.
async fn list_messages(js: &async_nats::jetstream::Context, root: &SessionId) -> Vec<String> {
    let stream = js.get_stream("SKEIN_TREES").await.unwrap();
    let mut out = vec![];
    let mut seq = 0;
    loop {
        let next = stream
            .direct_get_next_for_subject(format!("skein.tree.{root}"), Some(seq + 1))
            .await;
        let Ok(m) = next else { break };
        seq = m.sequence;
        out.push(String::from_utf8_lossy(&m.payload).into_owned());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_is_listed_the_same_from_its_list_from_the_log_and_after_damage() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let js = store.js.clone();
    let root = id("t1");
    let other = id("t2");
    write(&store, &[root.clone(), other.clone()]).await;
    let children: Vec<SessionId> = (1..=40).map(|i| id(&format!("t1.a-{i}"))).collect();
    write(&store, &children).await;
    write(&store, &[id("t1.a-3.b-1"), id("t2.x-1")]).await;
    let mut want = vec![root.clone(), id("t1.a-3.b-1")];
    want.extend(children.iter().cloned());
    want.sort();

    assert_eq!(store.tree(&root).await.unwrap(), want);
    assert_eq!(
        store.tree(&other).await.unwrap(),
        vec![other.clone(), id("t2.x-1")]
    );
    // The mark first, before any child.
    let messages = list_messages(&js, &root).await;
    assert_eq!(messages[0], "t1");

    // A name whose record was never written (its writer stopped between the two) is
    // listed: the list, not the log's subjects, answered.
    js.publish("skein.tree.t1", Bytes::from_static(b"t1.gone-1"))
        .await
        .unwrap()
        .await
        .unwrap();
    let mut with_gone = want.clone();
    with_gone.push(id("t1.gone-1"));
    with_gone.sort();
    assert_eq!(store.tree(&root).await.unwrap(), with_gone);

    // Damage after the mark: listed from the log, then marked again.
    js.publish("skein.tree.t1", Bytes::from_static(b"\xff\xfe not a name"))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(store.tree(&root).await.unwrap(), want);
    let messages = list_messages(&js, &root).await;
    assert!(
        messages.last().unwrap().lines().any(|l| l == "t1"),
        "the list was not marked again: {messages:?}"
    );
    // From then on the list answers again (the name without records is back in it).
    assert_eq!(store.tree(&root).await.unwrap(), with_gone);

    // A name of another tree on this tree's list is damage too.
    js.publish("skein.tree.t2", Bytes::from_static(b"t1.a-1"))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(
        store.tree(&other).await.unwrap(),
        vec![other.clone(), id("t2.x-1")]
    );

    // The whole stream deleted: a new store makes it again, and the listings are the
    // log's, then the list's.
    js.delete_stream("SKEIN_TREES").await.unwrap();
    // Meanwhile a store that cannot read the lists lists from the log (the name written
    // without records is not there).
    assert_eq!(store.tree(&root).await.unwrap(), want);
    let reopened = store_on(&server).await;
    assert_eq!(reopened.tree(&root).await.unwrap(), want);
    assert_eq!(list_messages(&js, &root).await.len(), 1);
    // A child created after the rebuild is named in it.
    write(&reopened, &[id("t1.late-1")]).await;
    let mut later = want.clone();
    later.push(id("t1.late-1"));
    later.sort();
    assert_eq!(reopened.tree(&root).await.unwrap(), later);
    assert_eq!(list_messages(&js, &root).await.len(), 2);

    // A tree without a list (written before the index): its subject purged.
    js.get_stream("SKEIN_TREES")
        .await
        .unwrap()
        .purge()
        .filter("skein.tree.t2")
        .await
        .unwrap();
    assert_eq!(
        reopened.tree(&other).await.unwrap(),
        vec![other.clone(), id("t2.x-1")]
    );
    // No tree: nothing listed, nothing written.
    assert!(reopened.tree(&id("t9")).await.unwrap().is_empty());
    assert!(list_messages(&js, &id("t9")).await.is_empty());
}

/// A tree of the `fanout` agent submitted to `rt`.
async fn submit_fanout(rt: &skein_runtime::worker::Runtime) -> SessionId {
    rt.submit(skein_runtime::worker::Submission {
        agent: "fanout".into(),
        mission: "parts".into(),
        no_cache: true,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// A runtime on `backend` whose `fanout` agent delegates to three `leaf` children.
fn fanout_runtime(
    backend: skein_runtime::ports::Backend,
    dir: &std::path::Path,
) -> Arc<skein_runtime::worker::Runtime> {
    fanout_runtime_of(backend, dir, 3)
}

/// A runtime on `backend` whose `fanout` agent delegates to `width` `leaf` children.
fn fanout_runtime_of(
    backend: skein_runtime::ports::Backend,
    dir: &std::path::Path,
    width: usize,
) -> Arc<skein_runtime::worker::Runtime> {
    std::fs::write(
        dir.join("fanout.yaml"),
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        repeat: WIDTH\n        args: {agent: leaf, mission: \"part {{ i }}\"}\n  - answer: \"{{ results | length }} parts done\"\n"
            .replace("WIDTH", &width.to_string()),
    )
    .unwrap();
    std::fs::write(dir.join("leaf.yaml"), "turns:\n  - answer: done\n").unwrap();
    let agents = skein_core::AgentSet::load(
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
    let mut models = skein_llm::Registry::new();
    models.insert(
        "scripted",
        Arc::new(skein_llm::scripted::ScriptedProvider::new(dir)),
    );
    skein_runtime::worker::Runtime::new(
        backend,
        Arc::new(agents),
        models,
        skein_tools::ToolBox::new(),
        skein_runtime::worker::RuntimeConfig::default(),
    )
}

/// A session named in its tree's list whose first record was never written (its writer
/// stopped between the two) meets the runtime's readers of whole trees: a report, a
/// resume and a cancel pass over it, and nothing is written to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_named_but_never_written_is_passed_over_by_report_resume_and_cancel() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let rt = fanout_runtime(store.backend(), dir.path());
    let root = submit_fanout(&rt).await;
    // The root's first turn: three children created and recorded, none run.
    let job = rt
        .backend
        .jobs
        .claim("default", Duration::from_secs(10))
        .await
        .unwrap()
        .expect("the root's job");
    assert_eq!(job.session, root);
    rt.process(&job).await.unwrap();
    rt.backend.jobs.ack(&job).await.unwrap();
    let gone = SessionId::parse(&format!("{root}.leaf-99")).unwrap();
    name_only(&store, &root, &gone).await;
    let listed = store.tree(&root).await.unwrap();
    assert_eq!(
        listed.len(),
        5,
        "root, three children and the name: {listed:?}"
    );
    assert!(listed.contains(&gone));

    let folds = skein_runtime::inspect::tree_folds(&rt.backend, &root)
        .await
        .unwrap();
    let ids: Vec<&SessionId> = folds.iter().map(|(_, f)| &f.id).collect();
    assert_eq!(ids.len(), 4, "{ids:?}");
    assert!(!ids.contains(&&gone));
    let rows = skein_runtime::inspect::tree_rows(&rt.backend, &root)
        .await
        .unwrap();
    assert_eq!(rows.len(), 4);

    // A resume wakes the root and its three children, not the name.
    assert_eq!(rt.requeue_tree(&root).await.unwrap(), 4);
    // A cancel ends those four and writes nothing under the name.
    assert_eq!(
        skein_runtime::control::cancel(&rt, &root, "stop")
            .await
            .unwrap(),
        4
    );
    assert!(store.read(&gone, 1).await.unwrap().is_empty());
    for s in listed.iter().filter(|s| **s != gone) {
        let last = store.last(s).await.unwrap().unwrap();
        assert!(matches!(last.env.body, Event::Cancelled(_)), "{s}");
    }
}

/// While a worker of a release before the lists runs (it creates sessions without naming
/// them), no tree's list is marked complete, and no mark written before it was seen
/// vouches for its list: listings go by the log's subjects. Once it has stopped, a listing
/// marks the list again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_list_is_trusted_while_a_worker_of_an_earlier_release_runs() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let js = store.js.clone();
    // A tree marked before the older worker appears (a rollback, say).
    let before = id("p1");
    write(&store, std::slice::from_ref(&before)).await;
    assert_eq!(list_messages(&js, &before).await, vec!["p1".to_string()]);

    // An entry as an earlier release writes it: no `lists_trees`.
    let old = br#"{"worker":"old-1","at":1,"reads":1,"build":"0.0.9"}"#;
    let workers = js.get_key_value("skein_workers").await.unwrap();
    workers.put("old-1", Bytes::from_static(old)).await.unwrap();
    assert!(!store.live_workers().await.unwrap()[0].lists_trees);

    // Children the older worker made: a record each, no name.
    let unnamed = |s: SessionId| {
        let js = js.clone();
        async move {
            js.publish(
                format!("skein.events.{s}"),
                Bytes::from(skein_nats::frame::encode(&[first_record(&s)])),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    };
    unnamed(id("p1.a-1")).await;
    let root = id("m1");
    write(&store, std::slice::from_ref(&root)).await;
    unnamed(id("m1.a-1")).await;
    assert!(
        list_messages(&js, &root).await.is_empty(),
        "a mark was written"
    );
    let whole_before = vec![before.clone(), id("p1.a-1")];
    let whole = vec![root.clone(), id("m1.a-1")];
    assert_eq!(store.tree(&before).await.unwrap(), whole_before);
    assert_eq!(store.tree(&root).await.unwrap(), whole);
    // So does another process, which reads when the older worker was seen.
    let other = store_on(&server).await;
    assert_eq!(other.tree(&before).await.unwrap(), whole_before);
    assert!(
        list_messages(&js, &root).await.is_empty(),
        "a listing marked it"
    );

    // The older worker stops: the next reading of the live workers lets lists be marked.
    let mut gone: serde_json::Value = serde_json::from_slice(old).unwrap();
    gone["stopped"] = true.into();
    workers
        .put("old-1", Bytes::from(gone.to_string()))
        .await
        .unwrap();
    assert!(store.live_workers().await.unwrap().is_empty());
    assert_eq!(store.tree(&root).await.unwrap(), whole);
    assert_eq!(
        list_messages(&js, &root).await,
        vec!["m1.a-1\nm1".to_string()]
    );
    assert_eq!(store.tree(&before).await.unwrap(), whole_before);
    assert_eq!(
        list_messages(&js, &before).await.last().unwrap(),
        "p1.a-1\np1"
    );
    assert_eq!(store.tree(&root).await.unwrap(), whole);
}

/// Names `id` in the list of the tree of `root` and writes nothing to its log (as a
/// writer that stopped between the two leaves it).
async fn name_only(store: &NatsStore, root: &SessionId, id: &SessionId) {
    store
        .js
        .publish(format!("skein.tree.{root}"), Bytes::from(id.to_string()))
        .await
        .unwrap()
        .await
        .unwrap();
}

/// A client that hears the requests made to read the log's stream: consumers made on
/// it, and gets from it.
async fn watch_reads(
    server: &NatsServer,
) -> (
    async_nats::Client,
    impl futures::Stream<Item = async_nats::Message> + Unpin,
    async_nats::Subscriber,
) {
    let watcher = async_nats::connect(server.url()).await.unwrap();
    let made = futures::stream::select(
        watcher
            .subscribe("$JS.API.CONSUMER.CREATE.SKEIN_EVENTS")
            .await
            .unwrap(),
        watcher
            .subscribe("$JS.API.CONSUMER.CREATE.SKEIN_EVENTS.>")
            .await
            .unwrap(),
    );
    let gets = watcher
        .subscribe("$JS.API.STREAM.MSG.GET.SKEIN_EVENTS")
        .await
        .unwrap();
    watcher.flush().await.unwrap();
    (watcher, made, gets)
}

/// How many messages `sub` has had since it was last drained.
async fn drain(sub: &mut (impl futures::Stream + Unpin)) -> usize {
    let mut n = 0;
    while let Ok(Some(_)) =
        tokio::time::timeout(Duration::from_millis(100), futures::StreamExt::next(sub)).await
    {
        n += 1;
    }
    n
}

/// Each record's seq and hash.
fn hashes(records: &[Record]) -> Vec<(u64, String)> {
    records.iter().map(|r| (r.env.seq, r.hash())).collect()
}

/// Record `seq` of `s`, chained to `prev`, with a text of `bytes` bytes.
fn record_after(s: &SessionId, seq: u64, prev: String, bytes: usize) -> Record {
    let env = Envelope::new(
        s.clone(),
        seq,
        seq,
        prev,
        Event::Cancelled(Cancelled {
            reason: format!("{s} {seq} {}", "x".repeat(bytes)),
        }),
    );
    Record::decode(env.encode().unwrap()).unwrap()
}

/// A wide tree is read in one pass over its part of the stream, and what that gives is
/// what reading each log gives: every session's records in order, whichever messages
/// they came in, with the turns of siblings (and of a tree whose root's name begins with
/// this root's) interleaved between them; a session named but never written reads as
/// empty, a subset of the tree reads as that subset, and a reader that has written none
/// of it (another process) reads the same. A tree of a few sessions is read log by log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wide_tree_read_in_one_pass_is_its_logs_read_one_by_one() {
    let server = NatsServer::start();
    let store = store_on(&server).await;
    let root = id("wide");
    let other = id("widex");
    let mut sessions = vec![root.clone(), other.clone()];
    // Wide enough to be read in one pass on any server (on one before 2.10, from 256
    // sessions on).
    for n in 1..=300 {
        sessions.push(root.child("leaf", n));
        if n % 60 == 0 {
            sessions.push(root.child("leaf", n).child("sub", 1));
        }
    }
    // A wide subtree.
    let leaf7 = root.child("leaf", 7);
    for k in 1..=260 {
        sessions.push(leaf7.child("sub", k));
    }
    sessions.push(other.child("leaf", 1));
    // One session of the tree written before its root, as no runtime does.
    let early = root.child("early", 1);
    sessions.push(early.clone());
    // Four rounds of appends, each session's after its own last, every session in each
    // round (the first: the early one, then the root, then the rest); some appends carry
    // several records (one message), some a record alone.
    let mut last: std::collections::HashMap<SessionId, (u64, String)> = sessions
        .iter()
        .map(|s| (s.clone(), (0, genesis_hash(s))))
        .collect();
    for round in 0..4u64 {
        let now: Vec<&SessionId> = match round {
            0 => vec![&early, &root],
            _ => sessions.iter().collect(),
        };
        let later: Vec<&SessionId> = match round {
            0 => sessions
                .iter()
                .filter(|s| **s != early && **s != root)
                .collect(),
            _ => vec![],
        };
        for group in [now, later] {
            let appends = group.into_iter().map(|s| {
                let (seq, prev) = last[s].clone();
                let count = 1 + (round as usize + s.as_str().len()) % 3;
                let mut records = vec![];
                let mut prev = prev;
                for k in 0..count as u64 {
                    let r = record_after(s, seq + 1 + k, prev.clone(), 40 * (k as usize + 1));
                    prev = r.hash();
                    records.push(r);
                }
                (s.clone(), seq, records)
            });
            let appends: Vec<_> = appends.collect();
            let writes = appends.iter().map(|(s, seq, records)| {
                let store = store.clone();
                async move {
                    store
                        .append(s, *seq, records, Durability::Ahead)
                        .await
                        .unwrap();
                }
            });
            futures::future::join_all(writes).await;
            for (s, seq, records) in appends {
                let r = records.last().unwrap();
                last.insert(s, (seq + records.len() as u64, r.hash()));
            }
        }
    }
    let never = root.child("never", 1);
    name_only(&store, &root, &never).await;

    let ids = store.tree(&root).await.unwrap();
    assert_eq!(ids.len(), 1 + 300 + 5 + 260 + 1 + 1);
    assert!(ids.contains(&never) && !ids.contains(&other));
    let reader = store_on(&server).await;
    // The requests a read makes: consumers made on the log's stream, and gets from it.
    let (watcher, mut made, mut gets) = watch_reads(&server).await;
    let messages = {
        let mut events = store.js.get_stream("SKEIN_EVENTS").await.unwrap();
        events.info().await.unwrap().state.messages
    };
    // Each log as a read of it alone gives it (kept up to date below as records are added).
    let mut alone: std::collections::HashMap<SessionId, Vec<(u64, String)>> =
        std::collections::HashMap::new();
    for s in &ids {
        alone.insert(s.clone(), hashes(&reader.read(s, 1).await.unwrap()));
    }
    for st in [&reader, &store] {
        watcher.flush().await.unwrap();
        drain(&mut made).await;
        drain(&mut gets).await;
        let logs = st
            .read_tree(&root, &ids)
            .await
            .unwrap()
            .expect("a tree of 568 sessions is read in one pass");
        watcher.flush().await.unwrap();
        let (n_made, n_gets) = (drain(&mut made).await, drain(&mut gets).await);
        // One consumer; gets for the root's first message, the root's log, the early
        // session and the name never written, where a read of each log takes at least a
        // get per message (over a thousand here).
        assert_eq!(n_made, 1, "consumers made for one read");
        assert!(
            n_gets <= 16 && messages > 1000,
            "{n_gets} gets for a tree of {messages} messages"
        );
        assert_eq!(logs.len(), ids.len());
        for (s, log) in ids.iter().zip(&logs) {
            assert_eq!(hashes(log), alone[s], "{s}");
            if *s == never {
                assert!(log.is_empty());
            } else {
                assert_eq!(log.len() as u64, last[s].0, "{s}");
                assert_eq!(log.last().unwrap().hash(), last[s].1, "{s}");
            }
        }
        // Part of the tree (the root, the sessions of depth 2, and most leaves), in the order
        // asked.
        let part: Vec<SessionId> = ids
            .iter()
            .rev()
            .filter(|s| *s == &root || s.depth() == 2)
            .cloned()
            .collect();
        let mut wanted = part.clone();
        wanted.extend(ids.iter().filter(|s| s.depth() == 1).take(260).cloned());
        let logs = st.read_tree(&root, &wanted).await.unwrap().unwrap();
        for (s, log) in wanted.iter().zip(&logs) {
            assert_eq!(hashes(log), alone[s], "{s}");
        }
        // A subtree is read from its own top: one consumer, on that top's subjects.
        let sub: Vec<SessionId> = ids.iter().filter(|s| leaf7.contains(s)).cloned().collect();
        assert_eq!(sub.len(), 261);
        watcher.flush().await.unwrap();
        drain(&mut made).await;
        let logs = st.read_tree(&root, &sub).await.unwrap().unwrap();
        watcher.flush().await.unwrap();
        let filters: Vec<String> = std::iter::from_fn(|| {
            futures::FutureExt::now_or_never(futures::StreamExt::next(&mut made)).flatten()
        })
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
        assert_eq!(filters.len(), 1, "{filters:?}");
        assert!(
            filters[0].contains(&format!("\"skein.events.{leaf7}.>\"")),
            "{}",
            filters[0]
        );
        for (s, log) in sub.iter().zip(&logs) {
            assert_eq!(hashes(log), alone[s], "{s}");
        }
        // After the read, this store goes on from where it ended: an append at the
        // known end is taken, and a read sees it.
        let s = ids.iter().find(|s| s.depth() == 1).unwrap();
        let (seq, prev) = last[s].clone();
        let r = record_after(s, seq + 1, prev, 10);
        st.append(s, seq, std::slice::from_ref(&r), Durability::Ahead)
            .await
            .unwrap();
        last.insert(s.clone(), (seq + 1, r.hash()));
        assert_eq!(
            hashes(&st.read(s, seq + 1).await.unwrap()),
            hashes(std::slice::from_ref(&r))
        );
        if let Some(a) = alone.get_mut(s) {
            a.push((seq + 1, r.hash()));
        }
    }
    // A tree of a few sessions is read log by log.
    let few: Vec<SessionId> = ids.iter().take(5).cloned().collect();
    assert!(store.read_tree(&root, &few).await.unwrap().is_none());
}

/// A report of a wide tree run by the runtime (its rows and folds, as `skein tree`, the UI
/// and `replay --tree` read them) is the same whether its logs are read in one pass or one
/// by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wide_tree_reports_the_same_read_in_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start();
    let store = store_on(&server).await;
    // Sixteen children: the most one turn may make by default.
    let rt = fanout_runtime_of(store.backend(), dir.path(), 16);
    let root = submit_fanout(&rt).await;
    let (stop, handles) = rt.spawn_workers(vec!["default".into()], 24);
    let ended = async {
        loop {
            let last = store.last(&root).await.unwrap();
            if last.is_some_and(|r| matches!(r.env.body, Event::Completed(_))) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), ended)
        .await
        .expect("the tree completes");
    stop.send(true).unwrap();
    for h in handles {
        h.await.unwrap();
    }
    let ids = store.tree(&root).await.unwrap();
    assert_eq!(ids.len(), 17);
    // Read in one pass from 16 sessions on, on a server before 2.10 from 256.
    let version = store.client.server_info().version;
    let mut v = version.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    let since_2_10 = (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (2, 10);
    assert_eq!(
        store.read_tree(&root, &ids).await.unwrap().is_some(),
        since_2_10,
        "nats-server {version}"
    );

    let read = skein_runtime::inspect::tree_folds(&rt.backend, &root)
        .await
        .unwrap();
    let rows = skein_runtime::inspect::tree_rows(&rt.backend, &root)
        .await
        .unwrap();
    assert_eq!(read.len(), 17);
    let mut by_one = vec![];
    for id in &ids {
        let records = store.read(id, 1).await.unwrap();
        let f = skein_runtime::inspect::fold_records(id, &records).unwrap();
        let (got, folded) = read.iter().find(|(_, g)| g.id == *id).unwrap();
        assert_eq!(hashes(got), hashes(&records), "{id}");
        assert_eq!(folded.last_hash, f.last_hash, "{id}");
        by_one.push((records, f));
    }
    assert_eq!(
        serde_json::to_value(&rows).unwrap(),
        serde_json::to_value(skein_runtime::inspect::rows_of(&by_one)).unwrap()
    );
    assert_eq!(rows.len(), 17);
    assert!(rows.iter().all(|r| r.status == "completed"));
    // The logs as `replay --tree` and `skein watch` read them.
    let logs = skein_runtime::inspect::tree_logs(&rt.backend, &root, &ids)
        .await
        .unwrap();
    for ((id, log), (records, _)) in ids.iter().zip(&logs).zip(&by_one) {
        assert_eq!(hashes(log), hashes(records), "{id}");
    }
    // Nobody is asked anything in a tree that has ended.
    assert!(skein_runtime::hitl::inbox(&rt, std::slice::from_ref(&root))
        .await
        .unwrap()
        .is_empty());

    // A resume from another process (no fold kept) loads each session from the one pass:
    // a read of its tail (one get) rather than of its whole log (two or more).
    let other = tempfile::tempdir().unwrap();
    let fresh = fanout_runtime_of(store_on(&server).await.backend(), other.path(), 16);
    let (watcher, mut made, mut gets) = watch_reads(&server).await;
    // The finished children are woken (their parent may not have heard of them).
    assert_eq!(fresh.requeue_tree(&root).await.unwrap(), 16);
    watcher.flush().await.unwrap();
    let (n_made, n_gets) = (drain(&mut made).await, drain(&mut gets).await);
    if since_2_10 {
        assert_eq!(n_made, 1, "consumers made for a resume");
        // One for the root's first message, the root's log, and a tail each.
        assert!(n_gets < 2 * 17, "{n_gets} gets for a resume of 17 sessions");
    } else {
        assert_eq!(n_made, 0, "nats-server {version}");
        assert!(
            n_gets >= 2 * 17,
            "{n_gets} gets for a resume of 17 sessions"
        );
    }
}
