//! Seeds from real runs: the demo agents and `fuzzer` run on an embedded store, and their
//! event records, audit exports and tool calls written as inputs.

use super::*;

/// Real runs on an embedded store: their records, exports and tool calls.
pub(super) async fn runs(corpus: &Path) -> Result<()> {
    let tmp = tempfile::tempdir().map_err(other)?;
    let scripts = tmp.path().join("scripts");
    std::fs::create_dir_all(&scripts).map_err(other)?;
    for (name, data) in crate::runner::load_corpus(&repo_root().join("config/scripts"))? {
        std::fs::write(scripts.join(name), data).map_err(other)?;
    }
    std::fs::write(scripts.join("fuzzer.yaml"), FUZZER_SCRIPT).map_err(other)?;
    std::fs::write(scripts.join("chatty.yaml"), CHATTY_SCRIPT).map_err(other)?;
    let ws = tmp.path().join("ws");
    let store = SledStore::open(&tmp.path().join("data"), &ws).map_err(other)?;
    let agents = skein_core::AgentSet::load(&agent_files(), &[]).map_err(other)?;
    let models = skein_llm::registry_from_config(&Default::default(), &scripts).map_err(other)?;
    let tools = skein_tools::ToolBox::builtin(&skein_tools::ToolsConfig::default());
    let cfg = RuntimeConfig {
        worker_id: "seed-worker".into(),
        token_secret: Secret(TEST_SECRET.to_vec()),
        ..RuntimeConfig::default()
    };
    let rt = Runtime::new(store.backend(), Arc::new(agents), models, tools, cfg);
    let submit = |agent: &str, mission: &str, id: &str| Submission {
        agent: agent.into(),
        mission: mission.into(),
        id: Some(id.into()),
        context: None,
        inputs: Value::Null,
        budget: None,
        no_cache: true,
        traceparent: None,
        priority: None,
    };

    let brief = rt
        .submit(submit(
            "orchestrator",
            "Brief me on event sourcing",
            "seed-brief",
        ))
        .await
        .map_err(other)?;
    rt.run_tree(&brief, 8).await.map_err(other)?;
    let plan = rt
        .submit(submit("planner", "Plan a migration to queues", "seed-plan"))
        .await
        .map_err(other)?;
    rt.run_tree(&plan, 8).await.map_err(other)?;

    // The fuzzer's tree: a workspace to look at, then approval, answer, follow-up.
    let fz = rt
        .submit(submit(
            "fuzzer",
            "Compare three queue designs",
            "seed-fuzzer",
        ))
        .await
        .map_err(other)?;
    let root_ws = ws.join(fz.as_str());
    std::fs::create_dir_all(&root_ws).map_err(other)?;
    std::fs::write(root_ws.join("notes.md"), "# Notes\nthree queue designs\n").map_err(other)?;
    let mut tokens: BTreeMap<String, String> = BTreeMap::new();
    for round in 0..6 {
        let f = rt.run_tree(&fz, 8).await.map_err(other)?;
        if f.state.status.is_terminal() {
            break;
        }
        let inbox = hitl::inbox(&rt, std::slice::from_ref(&fz))
            .await
            .map_err(other)?;
        let Some(item) = inbox.first() else {
            return Err(other(format!(
                "the fuzzer's seed run stopped without a question (round {round}, {})",
                f.state.status.as_str()
            )));
        };
        tokens.insert(format!("run-{}-{round}", item.kind), item.token.clone());
        if item.kind == skein_runtime::hitl::InboxKind::Approval {
            hitl::decide_approval(&rt, &item.token, true, None, Some("seed".into()))
                .await
                .map_err(other)?;
        } else {
            let answers = json!({"version": "3.12", "q2": "no"});
            write(
                corpus,
                "answers",
                &format!("run-round-{round}"),
                &serde_json::to_vec(&json!({"token": item.token, "answers": answers}))
                    .map_err(other)?,
            )?;
            hitl::answer(&rt, &item.token, answers, Some("seed".into()))
                .await
                .map_err(other)?;
        }
    }
    for (n, t) in &tokens {
        write(corpus, "token", n, t.as_bytes())?;
    }

    for root in [&brief, &plan, &fz] {
        let mut export = vec![];
        skein_runtime::audit::export(&rt.backend, root, &mut export)
            .await
            .map_err(other)?;
        let name = root.as_str().trim_start_matches("seed-");
        write(corpus, "audit", &format!("{name}.jsonl"), &export)?;
        for id in rt.backend.log.tree(root).await.map_err(other)? {
            let records = rt.backend.log.read(&id, 1).await.map_err(other)?;
            let label = id.display().replace('/', "_");
            let all: Vec<Vec<u8>> = records.iter().map(|r| r.bytes.clone()).collect();
            write(corpus, "event", &format!("log-{label}"), &event::join(&all))?;
            for r in &records {
                let kind = r.env.body.kind();
                let one = corpus.join("event").join(format!("one-{kind}"));
                if !one.exists() {
                    write(corpus, "event", &format!("one-{kind}"), &r.bytes)?;
                }
                if let Event::ToolCalled(t) = &r.env.body {
                    let call = json!({"tool": t.tool, "args": t.args});
                    write(
                        corpus,
                        "tool_args",
                        &format!("run-{label}-{}", t.call),
                        &serde_json::to_vec(&call).map_err(other)?,
                    )?;
                }
            }
        }
    }
    // Logs a reader must refuse or keep as they are: out of order, cut short, and a
    // body of a kind a later version may write.
    let fz_log: Vec<Vec<u8>> = rt
        .backend
        .log
        .read(&fz, 1)
        .await
        .map_err(other)?
        .iter()
        .map(|r| r.bytes.clone())
        .collect();
    if fz_log.len() > 4 {
        // As the JetStream log stores a turn: records appended together in one message.
        let mut messages = vec![fz_log[0].clone()];
        for turn in fz_log[1..].chunks(3) {
            let parts: Vec<&[u8]> = turn.iter().map(Vec::as_slice).collect();
            messages.push(match parts.as_slice() {
                [one] => one.to_vec(),
                _ => skein_nats::frame::encode_parts(&parts),
            });
        }
        write(
            corpus,
            "event",
            "log-fuzzer-in-messages",
            &event::join(&messages),
        )?;
        let mut reordered = fz_log.clone();
        reordered.swap(2, 3);
        write(corpus, "event", "bad-reordered", &event::join(&reordered))?;
        let cut = &fz_log[1][..fz_log[1].len() / 2];
        write(
            corpus,
            "event",
            "bad-truncated",
            &event::join(&[fz_log[0].clone(), cut.to_vec()]),
        )?;
    }
    let future = skein_core::Envelope::new(
        fz.clone(),
        24,
        1_700_000_000_000,
        "0".repeat(64),
        Event::Unknown {
            kind: "FutureEvent".into(),
            data: json!({"field": [1, 2, 3], "nested": {"a": null}}),
        },
    )
    .encode()
    .map_err(other)?;
    write(corpus, "event", "one-unknown-kind", &future)?;
    // A model server's token counts near the top of u64, twice.
    let huge = |seq: u64| {
        skein_core::Envelope::new(
            fz.clone(),
            seq,
            1_700_000_000_000 + seq,
            "0".repeat(64),
            Event::ModelCalled(skein_core::event::ModelCalled {
                model: "scripted:fuzzer".into(),
                request_digest: String::new(),
                response: skein_core::ModelResponse {
                    content: Some("big".into()),
                    tool_calls: vec![],
                    finish_reason: Some("stop".into()),
                },
                usage: skein_core::Usage {
                    input_tokens: u64::MAX - 1,
                    output_tokens: u64::MAX / 2,
                    cost: 0.0,
                    estimated: false,
                    ..Default::default()
                },
                latency_ms: 1,
                worker: "seed-worker".into(),
            }),
        )
        .encode()
    };
    if let Some(first) = fz_log.first() {
        let log = vec![
            first.clone(),
            huge(2).map_err(other)?,
            huge(3).map_err(other)?,
        ];
        write(corpus, "event", "huge-usage", &event::join(&log))?;
    }

    // A session at the top of the depth range that delegates: the child's depth must not
    // overflow (the fuzzer found `depth + 1` panicking on such a log).
    let brief_log = rt.backend.log.read(&brief, 1).await.map_err(other)?;
    if let [first, second, ..] = brief_log.as_slice() {
        let mut env = skein_core::Envelope::decode(&first.bytes).map_err(other)?;
        if let Event::Submitted(s) = &mut env.body {
            s.depth = u32::MAX;
        }
        let log = vec![env.encode().map_err(other)?, second.bytes.clone()];
        write(corpus, "event", "deepest-delegates", &event::join(&log))?;
    }

    // A tampered export: two lines swapped and one altered.
    let brief_export = std::fs::read(corpus.join("audit/brief.jsonl")).map_err(other)?;
    let text = String::from_utf8_lossy(&brief_export);
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.len() > 3 {
        lines.swap(1, 2);
        lines[0] = lines[0].replacen("\"seq\":1", "\"seq\":9", 1);
    }
    write(
        corpus,
        "audit",
        "tampered.jsonl",
        (lines.join("\n") + "\n").as_bytes(),
    )?;
    store.flush().await.map_err(other)?;
    Ok(())
}
