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

/// A runtime on `backend` whose `fanout` agent delegates to three `leaf` children.
fn fanout_runtime(
    backend: skein_runtime::ports::Backend,
    dir: &std::path::Path,
) -> Arc<skein_runtime::worker::Runtime> {
    std::fs::write(
        dir.join("fanout.yaml"),
        "turns:\n  - tool_calls:\n      - tool: call_agent\n        repeat: 3\n        args: {agent: leaf, mission: \"part {{ i }}\"}\n  - answer: \"{{ results | length }} parts done\"\n",
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
    let root = rt
        .submit(skein_runtime::worker::Submission {
            agent: "fanout".into(),
            mission: "parts".into(),
            no_cache: true,
            ..Default::default()
        })
        .await
        .unwrap();
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
    store
        .js
        .publish(format!("skein.tree.{root}"), Bytes::from(gone.to_string()))
        .await
        .unwrap()
        .await
        .unwrap();
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
