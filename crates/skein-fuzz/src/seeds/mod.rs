//! Writes the seed corpus: real inputs of every target. Event records, audit exports and
//! tool calls come from real runs of the demo agents and of `fuzzer` (which writes a
//! file after approval, asks a question, delegates and asks a follow-up) on an embedded
//! store; tokens are signed with the test secret; the rest are examples of each format,
//! valid and not.
//!
//! `cargo run -p skein-fuzz -- --write-seeds` rewrites the corpus. Inputs that crash a
//! parser still being fixed are kept out of it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Value};
use skein_core::token::{sign, Claims};
use skein_core::{Event, SessionId};
use skein_runtime::hitl::{self, Secret};
use skein_runtime::worker::{Runtime, RuntimeConfig, Submission};
use skein_sled::SledStore;

use crate::fixtures::{agent_files, paused_questions, paused_token, TEST_SECRET};
use crate::targets::{event, submission};
use crate::{Error, Result};

mod runs;

use runs::runs;

/// The repository's root (where `config/` is).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The script of `fuzzer` in the seed run: tools, an approval, a question, a delegation
/// and a follow-up question to it.
const FUZZER_SCRIPT: &str = r##"description: the seed run of the fuzzer agent
turns:
  - say: "Looking at the workspace first."
    tool_calls:
      - tool: list_dir
        args: {path: "."}
      - tool: search_files
        args: {pattern: "queue", case_sensitive: false}
      - tool: read_file
        args: {path: "notes.md"}
      - tool: write_file
        args: {path: "out/summary.md", content: "# Summary\n{{ mission }}\n"}
  - tool_calls:
      - tool: ask_user
        args:
          questions: [{key: version, question: "Which Python version?"}, "Anything else?"]
          context: "setting up the project"
          proposed_defaults: {version: "3.12"}
  - tool_calls:
      - tool: call_agent
        args: {agent: chatty, mission: "Summarize the notes for Python {{ results[0].answers.version }}"}
  - tool_calls:
      - tool: ask_clarification
        args: {session_id: "{{ results[0].session_id }}", question: "And in one line?"}
  - answer: "Done: {{ results[0].result }}"
"##;

const CHATTY_SCRIPT: &str = r#"turns:
  - answer: "The notes compare three queue designs."
  - answer: "Three queues, compared."
"#;

/// A script using every construct: conditions, repeats, loops over results.
const FEATURE_SCRIPT: &str = r#"description: every construct of the format
latency_ms: 0
turns:
  - choose:
      - when: "inputs.n > 1"
        say: "fanning out"
        tool_calls:
          - tool: call_agent
            repeat: "{{ inputs.n }}"
            args: {agent: researcher, mission: "part {{ i }} of {{ mission }}"}
      - tool_calls:
          - tool: call_agent
            args: {agent: researcher, mission: "{{ mission }}"}
  - tool_calls:
      - tool: update_plan
        args:
          ops:
            - {op: add, task: {id: t1, title: "first"}}
  - answer: "{% for r in all_results %}{{ loop.index }}: {{ r.result | default('') }}\n{% endfor %}"
"#;

fn write(dir: &Path, target: &str, name: &str, data: &[u8]) -> Result<()> {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).map_err(Error::io(format!("creating {}", d.display())))?;
    let f = d.join(name);
    std::fs::write(&f, data).map_err(Error::io(format!("writing {}", f.display())))
}

fn other(e: impl std::fmt::Display) -> Error {
    Error::Other(e.to_string())
}

/// Seeds whose name starts with this are inputs that once crashed a target: kept when
/// the corpus is written again.
pub const REGRESSION_PREFIX: &str = "regress-";

/// Writes every target's seeds under `corpus`, replacing what is there except the
/// regression inputs.
pub fn write_all(corpus: &Path) -> Result<()> {
    for t in crate::targets::ALL {
        let d = corpus.join(t.name);
        for (name, _) in crate::runner::load_corpus(&d)? {
            if !name.starts_with(REGRESSION_PREFIX) {
                let f = d.join(&name);
                std::fs::remove_file(&f).map_err(Error::io(format!("removing {}", f.display())))?;
            }
        }
    }
    ids(corpus)?;
    submissions(corpus)?;
    agents(corpus)?;
    scripts(corpus)?;
    tokens_and_answers(corpus)?;
    tool_calls(corpus)?;
    model_responses(corpus)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(other)?;
    rt.block_on(runs(corpus))
}

fn ids(dir: &Path) -> Result<()> {
    let ids = [
        ("ulid", "01jd8x4m2k9q7w3e5r6t8y0u1i"),
        ("key", "nightly-report_2024-06-01"),
        ("child", "01jd8x4m2k9q7w3e5r6t8y0u1i.researcher-2"),
        ("grandchild-slashed", "01jd8x/researcher-2/writer-1"),
        (
            "max-token",
            "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz01",
        ),
        (
            "too-long-ascii",
            "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz012",
        ),
        ("space", "Has Space"),
        ("subject", "a.>"),
        ("empty-token", "abc..x-1"),
        ("not-a-child", "abc.notachild"),
        ("padded", "  01jd8x/writer-1\n"),
        ("upper", "01JD8X"),
        ("unicode-short", "café"),
    ];
    for (n, id) in ids {
        write(dir, "id", n, id.as_bytes())?;
    }
    Ok(())
}

fn submissions(dir: &Path) -> Result<()> {
    let valid = json!({
        "agent": "orchestrator",
        "mission": "Brief me on event sourcing",
        "id": "brief-2024-06",
        "context": "for a team new to it",
        "inputs": {"audience": "engineers", "n": 3},
        "budget": {"tokens": 50000},
        "no_cache": false
    });
    let minimal = json!({"agent": "writer", "mission": "Write a haiku about queues"});
    type Case<'a> = (&'a str, Vec<(String, String)>, Vec<u8>);
    let cases: Vec<Case> = vec![
        (
            "json-full",
            vec![],
            serde_json::to_vec(&valid).map_err(other)?,
        ),
        (
            "json-minimal",
            vec![],
            serde_json::to_vec(&minimal).map_err(other)?,
        ),
        (
            "json-msg-id",
            vec![("Nats-Msg-Id".into(), "nightly-1".into())],
            serde_json::to_vec(&minimal).map_err(other)?,
        ),
        (
            "msgpack-full",
            vec![("Content-Type".into(), "application/msgpack".into())],
            rmp_serde::to_vec_named(&valid).map_err(other)?,
        ),
        (
            "msgpack-msg-id",
            vec![
                ("Nats-Msg-Id".into(), "nightly-2".into()),
                ("Content-Type".into(), "application/msgpack".into()),
            ],
            rmp_serde::to_vec_named(&minimal).map_err(other)?,
        ),
        (
            "unknown-agent",
            vec![],
            br#"{"agent": "nobody", "mission": "x"}"#.to_vec(),
        ),
        (
            "empty-mission",
            vec![],
            br#"{"agent": "writer", "mission": "  "}"#.to_vec(),
        ),
        (
            "inputs-not-object",
            vec![],
            br#"{"agent": "writer", "mission": "x", "inputs": [1, 2]}"#.to_vec(),
        ),
        (
            "bad-id",
            vec![],
            br#"{"agent": "writer", "mission": "x", "id": "Not Valid"}"#.to_vec(),
        ),
        (
            "bad-msg-id",
            vec![("Nats-Msg-Id".into(), "a.b".into())],
            serde_json::to_vec(&minimal).map_err(other)?,
        ),
        ("not-json", vec![], b"agent=writer&mission=x".to_vec()),
        (
            "msgpack-declared-json-sent",
            vec![("Content-Type".into(), "application/msgpack".into())],
            serde_json::to_vec(&minimal).map_err(other)?,
        ),
    ];
    for (name, headers, payload) in cases {
        write(
            dir,
            "submission",
            name,
            &submission::join(&headers, &payload),
        )?;
    }
    Ok(())
}

fn agents(dir: &Path) -> Result<()> {
    for (origin, text) in agent_files() {
        let name = Path::new(&origin)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or(origin.clone());
        write(dir, "agent", &name, text.as_bytes())?;
    }
    let extra = [
        (
            "team.md",
            "---\nname: team-lead\ndescription: runs a team\nmodel: openai:gpt-4o-mini\n\
             temperature: 0.2\nmax_tokens: 2000\nteam:\n  members: [researcher, writer]\n  \
             supervisor: writer\n  member_max_turns: 3\n  supervisor_max_turns: 2\n\
             advisors: [analyst]\npool: gpu\n---\nYou lead.\n",
        ),
        (
            "summarizing.md",
            "---\nname: summarizer\nmodel: anthropic:claude-sonnet-4\nsummarize:\n  max_chars: 400\n  \
             model: scripted:writer\ncache: false\nrequires_approval: [write_file]\n\
             idempotent_tools: [read_file]\ntools: [read_file, write_file]\nstrategy: concise\n\
             limits:\n  max_steps: 4\n  max_children_per_turn: 2\n  max_tokens: 10000\n---\nBe brief.\n",
        ),
        (
            "crlf.md",
            "---\r\nname: crlf\r\nmodel: scripted:writer\r\n---\r\nWindows line ends.\r\n",
        ),
        ("no-front-matter.md", "name: x\nmodel: scripted:x\n"),
        (
            "unknown-field.md",
            "---\nname: odd\nmodel: scripted:odd\ncolour: blue\n---\n",
        ),
        (
            "bad-model.md",
            "---\nname: nomodel\nmodel: gpt\n---\nNo provider.\n",
        ),
        (
            "unknown-refs.md",
            "---\nname: dangling\nmodel: scripted:x\nagents: [ghost]\ntools: [teleport]\n\
             handoff: nowhere\n---\n",
        ),
        (
            "anchors.md",
            "---\nname: anchored\nmodel: scripted:x\ndescription: &d the same text\n\
             tools: [read_file]\nidempotent_tools: [read_file]\n---\n",
        ),
    ];
    for (n, t) in extra {
        write(dir, "agent", n, t.as_bytes())?;
    }
    Ok(())
}

fn scripts(dir: &Path) -> Result<()> {
    let scripts_dir = repo_root().join("config/scripts");
    for (name, data) in crate::runner::load_corpus(&scripts_dir)? {
        write(dir, "script", &name, &data)?;
    }
    write(dir, "script", "fuzzer.yaml", FUZZER_SCRIPT.as_bytes())?;
    write(dir, "script", "chatty.yaml", CHATTY_SCRIPT.as_bytes())?;
    write(dir, "script", "features.yaml", FEATURE_SCRIPT.as_bytes())?;
    write(
        dir,
        "script",
        "no-turns.yaml",
        b"description: nothing\nturns: []\n",
    )?;
    write(
        dir,
        "script",
        "bad-template.yaml",
        b"turns:\n  - answer: \"{{ mission \"\n",
    )?;
    Ok(())
}

fn tokens_and_answers(dir: &Path) -> Result<()> {
    let token = paused_token();
    let approval = match SessionId::parse("01jd8x.researcher-1") {
        Ok(session) => sign(
            TEST_SECRET,
            &Claims {
                session,
                seq: 7,
                nonce: "0123456789abcdef01234567".into(),
                kind: skein_core::token::TokenKind::Approval,
            },
        ),
        Err(e) => return Err(other(e)),
    };
    let forged = sign(
        b"some-other-key-entirely",
        &Claims {
            session: SessionId::root(crate::fixtures::PAUSED_ROOT).map_err(other)?,
            seq: crate::fixtures::PAUSED_SEQ,
            nonce: crate::fixtures::PAUSED_TOKEN_ID.into(),
            kind: skein_core::token::TokenKind::Input,
        },
    );
    for (n, t) in [
        ("input", token.as_str()),
        ("approval", approval.as_str()),
        ("forged", forged.as_str()),
        ("wrong-version", "skt2.7b7d.00"),
        ("not-hex", "skt1.zz.yy"),
        ("two-parts", "skt1.00"),
    ] {
        write(dir, "token", n, t.as_bytes())?;
    }
    let questions = paused_questions();
    let answers = [
        (
            "complete",
            json!({"token": token, "answers": {"version": "3.12", "license": "MIT", "q3": "no"}}),
        ),
        (
            "missing-one",
            json!({"token": token, "answers": {"version": "3.12"}}),
        ),
        ("not-object", json!({"token": token, "answers": ["3.12"]})),
        (
            "approval-token",
            json!({"token": approval, "answers": {"version": "3.12"}}),
        ),
        (
            "forged",
            json!({"token": forged, "answers": {"version": "3.12", "license": "MIT", "q3": "-"}}),
        ),
        (
            "extra-field",
            json!({"token": token, "answers": {}, "by": "someone"}),
        ),
        (
            "questions-as-answers",
            json!({"token": token, "answers": questions}),
        ),
    ];
    for (n, v) in answers {
        write(dir, "answers", n, &serde_json::to_vec(&v).map_err(other)?)?;
    }
    Ok(())
}

fn tool_calls(dir: &Path) -> Result<()> {
    let resume = sign(
        TEST_SECRET,
        &Claims {
            session: SessionId::parse("fuzz-tools.researcher-2").map_err(other)?,
            seq: 3,
            nonce: "a1a1a1a1a1a1a1a1a1a1a1a1".into(),
            kind: skein_core::token::TokenKind::Input,
        },
    );
    let calls = [
        (
            "read-file",
            json!({"tool": "read_file", "args": {"path": "notes.md"}}),
        ),
        (
            "read-file-offset",
            json!({"tool": "read_file", "args": {"path": "data/report.txt", "offset": 100}}),
        ),
        (
            "write-file",
            json!({"tool": "write_file", "args": {"path": "out/a.md", "content": "# A\n"}}),
        ),
        (
            "list-dir",
            json!({"tool": "list_dir", "args": {"path": "data"}}),
        ),
        ("list-root-null", json!({"tool": "list_dir", "args": null})),
        (
            "search-regex",
            json!({"tool": "search_files", "args": {"pattern": "line (one|two)", "regex": true, "path": "data", "case_sensitive": false, "max_matches": 5}}),
        ),
        (
            "search-text",
            json!({"tool": "search_files", "args": {"pattern": "queues"}}),
        ),
        (
            "http-fetch",
            json!({"tool": "http_fetch", "args": {"url": "https://example.com/a?b=c", "method": "POST", "headers": {"accept": "text/plain"}, "body": "x"}}),
        ),
        (
            "shell",
            json!({"tool": "shell", "args": {"command": "ls -la"}}),
        ),
        (
            "call-agent",
            json!({"tool": "call_agent", "args": {"agent": "writer", "mission": "write it", "context": "c", "inputs": {"k": 1}, "budget": {"tokens": 1000}}}),
        ),
        (
            "call-agent-custom",
            json!({"tool": "call_agent", "args": {"mission": "m", "agent_definition": {"system_prompt": "be brief", "tools": ["read_file"]}}}),
        ),
        (
            "call-agent-resume",
            json!({"tool": "call_agent", "args": {"resume_token": resume, "answers": {"depth": "shallow"}}}),
        ),
        (
            "ask-user",
            json!({"tool": "ask_user", "args": {"questions": [{"key": "v", "question": "Which?"}, "Why?"], "context": "c", "proposed_defaults": {"v": "1"}}}),
        ),
        (
            "ask-clarification",
            json!({"tool": "ask_clarification", "args": {"session_id": "fuzz-tools/chatty-1", "question": "More?"}}),
        ),
        (
            "update-plan",
            json!({"tool": "update_plan", "args": {"ops": [{"op": "add", "task": {"id": "t1", "title": "first"}}, {"op": "add", "task": {"id": "t2", "title": "second", "depends_on": ["t1"]}}]}}),
        ),
        (
            "propose-patch",
            json!({"tool": "propose_patch", "args": {"base_version": 1, "ops": [{"op": "update", "id": "t1", "status": "done"}]}}),
        ),
        (
            "handoff",
            json!({"tool": "handoff_to", "args": {"agent": "writer", "mission": "finish"}}),
        ),
        (
            "team-broadcast",
            json!({"tool": "team_broadcast", "args": {"message": "hello"}}),
        ),
        (
            "unreadable",
            json!({"tool": "read_file", "args": {"_raw": "{path: x", "_error": "expected value"}}),
        ),
        ("unknown-tool", json!({"tool": "teleport", "args": {}})),
        (
            "one-turn",
            json!([
                {"tool": "update_plan", "args": {"ops": [{"op": "add", "task": {"id": "t9", "title": "t"}}]}},
                {"tool": "call_agent", "args": {"agent": "researcher", "mission": "m", "owns_tasks": ["t9"]}},
                {"tool": "read_file", "args": {"path": "notes.md"}}
            ]),
        ),
    ];
    for (n, v) in calls {
        write(dir, "tool_args", n, &serde_json::to_vec(&v).map_err(other)?)?;
    }
    Ok(())
}

fn model_responses(dir: &Path) -> Result<()> {
    let fixtures = repo_root().join("crates/skein-llm/tests/fixtures");
    for (name, data) in crate::runner::load_corpus(&fixtures)? {
        if name.ends_with(".json") {
            write(dir, "model_response", &name, &data)?;
        }
    }
    let json_mode = json!({
        "choices": [{"message": {"role": "assistant", "content": "```json\n{\"tool_calls\": [{\"name\": \"read_file\", \"arguments\": {\"path\": \"notes.md\"}}]}\n```"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5}
    });
    write(
        dir,
        "model_response",
        "json-mode-text.json",
        &serde_json::to_vec_pretty(&json_mode).map_err(other)?,
    )?;
    for (name, data) in crate::targets::model_stream::seeds()? {
        write(dir, "model_stream", &name, &data)?;
    }
    for (name, data) in crate::targets::mcp_message::seeds() {
        write(dir, "mcp_message", &name, &data)?;
    }
    let error = json!({"error": {"type": "overloaded_error", "message": "Overloaded"}});
    write(
        dir,
        "model_response",
        "error.json",
        &serde_json::to_vec(&error).map_err(other)?,
    )
}
