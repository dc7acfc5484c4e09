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
