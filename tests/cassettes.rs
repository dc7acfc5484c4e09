//! The real-model suite's recordings, replayed: each tree of `tests/real_model.rs` runs
//! again, the real binary against a server that answers as llama-cpp-python answered,
//! after checking every request against the schema that server publishes for its
//! requests. A request the real server would refuse (an assistant message with
//! `content: null`, say) is refused here too.

mod common;

use common::wire::{self, Cassette, Replay};
use serde_json::json;

#[test]
fn the_saved_schema_refuses_what_the_real_server_refused() {
    let v = wire::request_validator();
    let call = json!([{"id": "t1_1", "type": "function",
                       "function": {"name": "list_dir", "arguments": "{}"}}]);
    let with = |content: serde_json::Value| {
        json!({"model": "m", "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": content, "tool_calls": call},
            {"role": "tool", "tool_call_id": "t1_1", "content": "notes.md"},
        ]})
    };
    // llama-cpp-python 0.3.36 answered this with HTTP 422 ("messages.1.content: Input
    // should be a valid string").
    let bad = wire::violations(&v, &with(serde_json::Value::Null));
    assert!(!bad.is_empty(), "content: null must break the schema");
    assert!(wire::violations(&v, &with(json!(""))).is_empty());
    // A tool message without its call id breaks it too.
    let no_id = json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]});
    assert!(!wire::violations(&v, &no_id).is_empty());
}

#[test]
fn recorded_trees_replay_against_the_servers_request_checks() {
    for tree in wire::TREES {
        let path = wire::cassette_dir().join(format!("{}.json", tree.name));
        let cassette = Cassette::load(&path);
        let replay = Replay::start(&cassette);
        let data = tempfile::tempdir().expect("data");
        let (out, outcome) = wire::run_tree(tree, &replay.url, data.path());
        let refused = replay.refused.lock().expect("refused").clone();
        assert!(
            refused.is_empty(),
            "tree {}: requests the real server would refuse: {refused:#?}",
            tree.name
        );
        let unknown = replay.unknown.lock().expect("unknown").clone();
        assert!(
            unknown.is_empty(),
            "tree {}: requests unlike any recorded one (the requests changed: record again \
             with `bash tests/real_model/run.sh --record`): {unknown:#?}",
            tree.name
        );
        assert_eq!(outcome, cassette.outcome, "tree {}", tree.name);
        assert_eq!(
            replay.used(),
            cassette.interactions.len(),
            "tree {}: not every recorded answer was asked for",
            tree.name
        );
        wire::check_tree(tree, &out, data.path());
    }
}
