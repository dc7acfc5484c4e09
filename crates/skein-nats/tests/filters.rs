//! Filtered pages of the index of roots on a real server: each kind of filter (status
//! open and ended, agent, mission text, time range, and together), walked page by page
//! with its cursor, lists exactly the roots the filter picks from the logs, newest first;
//! enough roots that pages read blocks through a consumer, and roots that ended long
//! after the others started (so the order roots ended in is not their start order).
//! Walked three times: reading whole ranges of the index through its packed blocks (with
//! agents and missions too long for a block to keep whole), again once the blocks are
//! deleted (they are packed again) or damaged, and without blocks (ranges of 1,000).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use skein_core::event::{genesis_hash, Cancelled, Completed, Submitted};
use skein_core::{Envelope, Event, Record, SessionId};
use skein_nats::{NatsConfig, NatsStore, ROOT_BLOCKS};
use skein_runtime::ports::roots::{RootFilter, RootSummary};
use skein_runtime::ports::{Durability, EventLog};
use skein_testnats::NatsServer;

const ROOTS: u64 = 300;
const T0: u64 = 1_700_000_000_000;
/// Roots that stay open while the others are written, then end last: more than a
/// small page holds, so that a page of ended roots must read past them.
const LATE: std::ops::Range<u64> = 10..14;

fn record(id: &SessionId, seq: u64, at: u64, prev: String, body: Event) -> Record {
    Record::decode(
        Envelope::new(id.clone(), seq, at, prev, body)
            .encode()
            .unwrap(),
    )
    .unwrap()
}

fn completed() -> Event {
    Event::Completed(Completed {
        answer: "done".into(),
        usage_total: Default::default(),
        steps: 1,
        partial: false,
    })
}

/// Roots a packed block of the index holds in this test.
const BLOCK: u64 = 16;

/// An agent name longer than a block keeps whole; two of them share what it keeps.
fn long_agent(tail: &str) -> String {
    format!("{}{tail}", "agent-".repeat(70))
}

/// Root `i`'s first records: a few of a rare agent, a few of long agents, a few with a
/// rare mission (some of them long, the rare text past what a block keeps), a few
/// cancelled, a few left open, the rest completed.
fn first_records(id: &SessionId, i: u64) -> Vec<Record> {
    let at = T0 + i * 1000;
    let agent = match i % 101 {
        _ if i % 97 == 5 => "rare".to_string(),
        6 => long_agent("a"),
        7 => long_agent("b"),
        _ => "common".to_string(),
    };
    let mission = if i % 89 == 3 {
        format!("find the Needle {i}")
    } else if i % 83 == 4 {
        format!("{}, then the needle {i}", "a long mission ".repeat(40))
    } else {
        format!("history tree {i}")
    };
    let sub = record(
        id,
        1,
        at,
        genesis_hash(id),
        Event::Submitted(Submitted {
            mission,
            ..Submitted::for_test(&agent)
        }),
    );
    let prev = sub.hash();
    let mut out = vec![sub];
    if i % 50 == 7 || LATE.contains(&i) {
        return out;
    }
    let end = if i % 71 == 2 {
        Event::Cancelled(Cancelled {
            reason: "stopped".into(),
        })
    } else {
        completed()
    };
    out.push(record(id, 2, at + 500, prev, end));
    out
}

/// A store on `server` whose index packs blocks of [`BLOCK`] roots.
async fn store_of_blocks(server: &NatsServer) -> std::sync::Arc<NatsStore> {
    let store = NatsStore::connect(&cfg_of(server), Duration::from_secs(1))
        .await
        .unwrap();
    store.set_index_block_roots(BLOCK);
    store
}

fn cfg_of(server: &NatsServer) -> NatsConfig {
    NatsConfig {
        urls: vec![server.url()],
        ..NatsConfig::default()
    }
}

/// Roots `<prefix>00000`… with [`first_records`], one after the other.
async fn write_roots(store: &NatsStore, prefix: &str, n: u64) -> Vec<(SessionId, Vec<Record>)> {
    let mut logs = vec![];
    for i in 0..n {
        let id = SessionId::root(&format!("{prefix}{i:05}")).unwrap();
        let records = first_records(&id, i);
        store
            .append(&id, 0, &records, Durability::Now)
            .await
            .unwrap();
        logs.push((id, records));
    }
    logs
}

/// Every page of `filter`, `limit` at a time, following the cursors.
async fn walk(store: &NatsStore, filter: &RootFilter, limit: usize) -> Vec<String> {
    let (mut seen, mut cursor) = (vec![], None::<String>);
    for _ in 0..1000 {
        let page = store
            .roots_page(filter, limit, cursor.as_deref())
            .await
            .unwrap();
        seen.extend(page.roots.into_iter().map(|s| s.root));
        match page.next {
            Some(c) => cursor = Some(c),
            None => return seen,
        }
    }
    panic!("pages without end for {filter:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_filter_lists_what_the_logs_say_page_by_page() {
    let server = NatsServer::start();
    let store = store_of_blocks(&server).await;
    let mut logs = write_roots(&store, "f", ROOTS).await;
    // The late roots end after all the others.
    for i in LATE {
        let (late, records) = &mut logs[i as usize];
        let end = record(
            late,
            2,
            T0 + ROOTS * 1000 + i * 1000,
            records[0].hash(),
            completed(),
        );
        store
            .append(late, 1, std::slice::from_ref(&end), Durability::Now)
            .await
            .unwrap();
        records.push(end);
    }

    let mut summaries: Vec<RootSummary> = logs
        .iter()
        .map(|(id, r)| RootSummary::of(id, r).unwrap())
        .collect();
    summaries.sort_by_key(|s| std::cmp::Reverse(s.position()));
    let open_status = summaries
        .iter()
        .find(|s| !s.is_finished())
        .map(|s| s.status.clone())
        .unwrap();

    let f = RootFilter::default;
    let filters = [
        f(),
        RootFilter {
            agent: Some("rare".into()),
            ..f()
        },
        RootFilter {
            text: Some("NEEDLE".into()),
            ..f()
        },
        RootFilter {
            status: Some("cancelled".into()),
            ..f()
        },
        RootFilter {
            status: Some("completed".into()),
            ..f()
        },
        RootFilter {
            status: Some(open_status),
            ..f()
        },
        RootFilter {
            since: Some(T0 + 40_000),
            until: Some(T0 + 45_000),
            ..f()
        },
        RootFilter {
            since: Some(T0 + 295_000),
            ..f()
        },
        RootFilter {
            until: Some(T0 + 3_000),
            ..f()
        },
        RootFilter {
            status: Some("completed".into()),
            agent: Some("common".into()),
            text: Some("tree".into()),
            since: Some(T0 + 8_000),
            until: Some(T0 + 200_000),
        },
        RootFilter {
            status: Some("completed".into()),
            since: Some(T0 + 290_000),
            ..f()
        },
        RootFilter {
            status: Some("completed".into()),
            since: Some(T0 + 9_000),
            until: Some(T0 + 14_000),
            ..f()
        },
        RootFilter {
            agent: Some("nobody".into()),
            ..f()
        },
        RootFilter {
            agent: Some(long_agent("a")),
            ..f()
        },
        RootFilter {
            text: Some("THE NEEDLE".into()),
            ..f()
        },
        RootFilter {
            status: Some("cancelled".into()),
            text: Some("needle".into()),
            ..f()
        },
        RootFilter {
            status: Some("completed".into()),
            agent: Some("rare".into()),
            ..f()
        },
        RootFilter {
            status: Some("failed".into()),
            ..f()
        },
    ];
    check(&store, &filters, &summaries).await;
    let blocks = store.js.get_stream(ROOT_BLOCKS).await.unwrap();
    let packed = blocks.get_info().await.unwrap().state.messages;
    assert!(
        packed >= ROOTS / BLOCK,
        "the full ranges of starts are packed: {packed}"
    );

    // Deleted: a process that opens the store makes the stream again, and its pages
    // pack the blocks again from the index.
    store.js.delete_stream(ROOT_BLOCKS).await.unwrap();
    let again = NatsStore::connect(&cfg_of(&server), Duration::from_secs(1))
        .await
        .unwrap();
    again.set_index_block_roots(BLOCK);
    check(&again, &filters, &summaries).await;
    let mut blocks = again.js.get_stream(ROOT_BLOCKS).await.unwrap();
    assert!(blocks.info().await.unwrap().state.messages >= ROOTS / BLOCK);

    // Damaged: a block that does not decode, or that covers other sequences.
    let starts = blocks
        .get_last_raw_message_by_subject("skein.rootblock.starts.1")
        .await
        .unwrap()
        .payload;
    for (subject, payload) in [
        ("skein.rootblock.starts.0", Bytes::from_static(b"{not json")),
        ("skein.rootblock.states.0", Bytes::from_static(b"[]")),
        ("skein.rootblock.starts.2", starts),
    ] {
        again
            .js
            .publish(subject, payload)
            .await
            .unwrap()
            .await
            .unwrap();
    }
    check(&again, &filters, &summaries).await;
    for subject in ["skein.rootblock.starts.0", "skein.rootblock.starts.2"] {
        let made = blocks
            .get_last_raw_message_by_subject(subject)
            .await
            .unwrap()
            .payload;
        let v: serde_json::Value = serde_json::from_slice(&made).unwrap();
        assert_eq!(
            v["first"],
            1 + BLOCK * subject.ends_with('2') as u64 * 2,
            "{subject}"
        );
    }

    // Ranges larger than the store: no block is used.
    again.set_index_block_roots(1_000);
    check(&again, &filters, &summaries).await;
    // The summaries of an ended-status page are the logs' own.
    let page = store
        .roots_page(
            &RootFilter {
                status: Some("completed".into()),
                ..f()
            },
            1,
            None,
        )
        .await
        .unwrap();
    assert_eq!(page.roots[0], summaries[0], "the newest completed root");
}

/// Walks every filter's pages, a few and many at a time, against what the logs say.
async fn check(store: &NatsStore, filters: &[RootFilter], summaries: &[RootSummary]) {
    for filter in filters {
        let norm = filter.normalized();
        let want: Vec<String> = summaries
            .iter()
            .filter(|s| norm.matches(s))
            .map(|s| s.root.clone())
            .collect();
        // Three a page: fewer than the late roots, which end after every other.
        let small = if norm.status.as_deref() == Some("completed") {
            3
        } else {
            7
        };
        for limit in [small, 1000] {
            assert_eq!(
                walk(store, filter, limit).await,
                want,
                "{filter:?}, {limit} a page"
            );
        }
    }
}

/// Retention removes the oldest roots: the packed blocks of the ranges they emptied are
/// dropped, a range that still holds a root keeps its block, and every filter still lists
/// what the remaining logs say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_blocks_of_ranges_retention_emptied_are_dropped() {
    let server = NatsServer::start();
    let store = store_of_blocks(&server).await;
    let logs = write_roots(&store, "g", 4 * BLOCK).await;
    let rare = RootFilter {
        agent: Some("rare".into()),
        ..RootFilter::default()
    };
    // A rare filter packs every full range that is missing its block.
    walk(&store, &rare, 5).await;
    let blocks = |prefix: &'static str| {
        let js = store.js.clone();
        async move {
            let st = js.get_stream(ROOT_BLOCKS).await.unwrap();
            let subjects = st.info_with_subjects(format!("{prefix}*")).await.unwrap();
            let mut ks: Vec<u64> = futures::StreamExt::collect::<Vec<_>>(subjects)
                .await
                .into_iter()
                .map(|x| x.unwrap().0[prefix.len()..].parse().unwrap())
                .collect();
            ks.sort();
            ks
        }
    };
    assert_eq!(blocks("skein.rootblock.starts.").await, vec![0, 1, 2, 3]);
    let states_before = blocks("skein.rootblock.states.").await;
    assert!(states_before.contains(&0), "{states_before:?}");

    // The oldest 40 roots removed: the starts of ranges 0 and 1 (1-32) are all gone,
    // range 2 (33-48) keeps eight.
    for (id, _) in &logs[..40] {
        store.remove_tree(id).await.unwrap().expect("removed");
    }
    let dropped = store.drop_emptied_blocks().await.unwrap();
    assert_eq!(blocks("skein.rootblock.starts.").await, vec![2, 3]);
    // The ended roots' states: those of the removed roots are gone, so the ranges before
    // the first state left are empty.
    let first_state = store
        .js
        .get_stream("SKEIN_ROOT_STATE")
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap()
        .state
        .first_sequence;
    let states = blocks("skein.rootblock.states.").await;
    let kept: Vec<u64> = states_before
        .iter()
        .copied()
        .filter(|k| (k + 1) * BLOCK >= first_state)
        .collect();
    assert_eq!(states, kept, "first state left at {first_state}");
    assert!(states.len() < states_before.len());
    assert_eq!(dropped, 2 + (states_before.len() - states.len()) as u64);
    assert_eq!(
        store.drop_emptied_blocks().await.unwrap(),
        0,
        "dropped twice"
    );

    let mut summaries: Vec<RootSummary> = logs[40..]
        .iter()
        .map(|(id, r)| RootSummary::of(id, r).unwrap())
        .collect();
    summaries.sort_by_key(|s| std::cmp::Reverse(s.position()));
    let f = RootFilter::default;
    let filters = [
        f(),
        rare,
        RootFilter {
            text: Some("NEEDLE".into()),
            ..f()
        },
        RootFilter {
            status: Some("completed".into()),
            ..f()
        },
    ];
    check(&store, &filters, &summaries).await;
}
