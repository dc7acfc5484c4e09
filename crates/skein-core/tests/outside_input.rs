//! Given/when/then over events for the limits on what a model or a submitter may send:
//! tool calls per turn, mission parts of a delegation, and the approval preview.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use skein_core::event::{
    genesis_hash, record_hash, ApprovalRequested, ModelCalled, Submitted, ToolCalled, ToolReturned,
};
use skein_core::replay::verify;
use skein_core::{
    AgentSet, Envelope, Event, Limits, ModelResponse, SessionId, SessionState, Step, ToolCall,
    Usage,
};

fn agents(extra: &str) -> AgentSet {
    let f = |name: &str, extra: &str| {
        (
            format!("{name}.md"),
            format!("---\nname: {name}\nmodel: scripted:{name}\n{extra}---\nYou are {name}.\n"),
        )
    };
    AgentSet::load(
        &[
            f(
                "boss",
                &format!("agents: [helper]\ntools: [list_dir, shell, update_plan]\n{extra}"),
            ),
            f("helper", ""),
        ],
        &[],
    )
    .unwrap()
}

/// A log under construction, folded as it grows.
struct Given {
    id: SessionId,
    log: Vec<Envelope>,
    state: SessionState,
}

impl Given {
    fn submitted(set: &AgentSet) -> Self {
        let mut g = Given {
            id: SessionId::root("lim").unwrap(),
            log: vec![],
            state: SessionState::default(),
        };
        g.push(Event::Submitted(Submitted {
            def_digest: set.get("boss").unwrap().digest.clone(),
            mission: "work".into(),
            mission_hash: "h".into(),
            ..Submitted::for_test("boss")
        }));
        g
    }

    fn push(&mut self, body: Event) {
        let seq = self.log.len() as u64 + 1;
        let prev = self
            .log
            .last()
            .map(|e| record_hash(&e.encode().unwrap()))
            .unwrap_or_else(|| genesis_hash(&self.id));
        let env = Envelope::new(self.id.clone(), seq, 1000 + seq, prev, body);
        self.state.apply(&env);
        self.log.push(env);
    }

    fn model_calls(&mut self, calls: Vec<ToolCall>) {
        self.push(Event::ModelCalled(ModelCalled {
            model: "scripted:boss".into(),
            request_digest: "d".into(),
            response: ModelResponse {
                content: None,
                tool_calls: calls,
                finish_reason: None,
            },
            usage: Usage::default(),
            latency_ms: 1,
            worker: "w".into(),
        }));
    }

    fn model_answers(&mut self, text: &str) {
        self.push(Event::ModelCalled(ModelCalled {
            model: "scripted:boss".into(),
            request_digest: "d".into(),
            response: ModelResponse {
                content: Some(text.into()),
                tool_calls: vec![],
                finish_reason: None,
            },
            usage: Usage::default(),
            latency_ms: 1,
            worker: "w".into(),
        }));
    }
}

fn call(i: usize, name: &str, args: Value) -> ToolCall {
    ToolCall {
        id: format!("c{i}"),
        name: name.into(),
        args,
    }
}

#[test]
fn calls_past_the_per_turn_limit_are_refused_and_never_run_and_the_log_replays() {
    let set = agents("");
    let def = set.get("boss").unwrap().clone();
    let limits = Limits {
        max_tool_calls_per_turn: 5,
        ..Limits::default()
    };
    let mut g = Given::submitted(&set);
    // 200 calls in one turn; the 3rd is a plan edit, the 150th another.
    let calls = (0..200)
        .map(|i| match i {
            2 | 149 => call(
                i,
                "update_plan",
                json!({"ops": [{"op": "add", "task": {"id": format!("t{i}"), "title": "T"}}]}),
            ),
            _ => call(i, "list_dir", json!({"path": "."})),
        })
        .collect();
    g.model_calls(calls);

    // The first plan edit is within the limit and goes first, as ever.
    let Step::EditPlan(e) = g.state.next(&def, &limits, &set) else {
        panic!("expected the plan edit first")
    };
    assert_eq!(e.call, "c2");
    g.push(e.into_event());

    // Then every call past the fifth is refused, the far plan edit included.
    let Step::Refuse(refusals) = g.state.next(&def, &limits, &set) else {
        panic!("expected refusals")
    };
    assert_eq!(refusals.len(), 195);
    assert_eq!(refusals[0].call, "c5");
    assert!(refusals.iter().any(|r| r.call == "c149"));
    let r = &refusals[0];
    assert!(
        r.error.contains("200 tool calls")
            && r.error.contains("at most 5")
            && r.error.contains("max_tool_calls_per_turn")
            && r.error.contains("number 6"),
        "{}",
        r.error
    );
    for r in refusals {
        g.push(Event::ToolReturned(ToolReturned {
            call: r.call,
            output: r.error,
            error: true,
            ms: 0,
            blob: None,
            refused: None,
        }));
    }

    // Only the calls within the limit run.
    let Step::RunTools(runs) = g.state.next(&def, &limits, &set) else {
        panic!("expected runs")
    };
    let ran: Vec<&str> = runs.iter().map(|r| r.call.as_str()).collect();
    assert_eq!(ran, ["c0", "c1", "c3", "c4"]);
    for r in &runs {
        g.push(Event::ToolCalled(ToolCalled {
            call: r.call.clone(),
            tool: r.tool.clone(),
            args: r.args.clone(),
            worker: "w".into(),
        }));
    }
    for r in &runs {
        g.push(Event::ToolReturned(ToolReturned {
            call: r.call.clone(),
            output: "[]".into(),
            error: false,
            ms: 1,
            blob: None,
            refused: None,
        }));
    }
    // The model reads the refusals as tool errors on its next turn.
    assert!(matches!(
        g.state.next(&def, &limits, &set),
        Step::CallModel { .. }
    ));
    let request = g.state.model_request(&def);
    let refused_shown = request
        .messages
        .iter()
        .filter(|m| matches!(m, skein_core::Message::Tool { is_error: true, content, .. } if content.contains("max_tool_calls_per_turn")))
        .count();
    assert_eq!(refused_shown, 195);
    g.model_answers("done");
    let Step::Complete { answer } = g.state.next(&def, &limits, &set) else {
        panic!("expected completion")
    };
    g.push(Event::Completed(skein_core::event::Completed {
        answer,
        usage_total: Usage::default(),
        steps: 2,
        partial: false,
    }));

    // Replay re-derives every decision, the refusals included.
    verify(&g.log, &def, &limits, &set).unwrap();
    // Under a limit that would have let them run, the same log does not verify.
    let looser = Limits {
        max_tool_calls_per_turn: 500,
        ..Limits::default()
    };
    assert!(verify(&g.log, &def, &looser, &set).is_err());
}

#[test]
fn the_default_limit_is_64_and_front_matter_sets_its_own() {
    assert_eq!(Limits::default().max_tool_calls_per_turn, 64);
    let set = agents("limits: {max_tool_calls_per_turn: 2}\n");
    let def = set.get("boss").unwrap().clone();
    let mut g = Given::submitted(&set);
    g.model_calls(
        (0..3)
            .map(|i| call(i, "list_dir", json!({"path": "."})))
            .collect(),
    );
    let Step::Refuse(r) = g.state.next(&def, &Limits::default(), &set) else {
        panic!("expected a refusal")
    };
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].call, "c2");
    assert!(r[0].error.contains("at most 2"), "{}", r[0].error);

    // 64 calls under the default limit all run.
    let set = agents("");
    let def = set.get("boss").unwrap().clone();
    let mut g = Given::submitted(&set);
    g.model_calls(
        (0..64)
            .map(|i| call(i, "list_dir", json!({"path": "."})))
            .collect(),
    );
    let Step::RunTools(runs) = g.state.next(&def, &Limits::default(), &set) else {
        panic!("expected runs")
    };
    assert_eq!(runs.len(), 64);
}

#[test]
fn a_delegation_with_an_oversized_context_or_inputs_is_refused_with_the_figures() {
    let set = agents("");
    let def = set.get("boss").unwrap().clone();
    let limits = Limits::default();
    let big = "c".repeat(skein_core::limits::MAX_CONTEXT_BYTES + 1);
    let mut g = Given::submitted(&set);
    g.model_calls(vec![
        call(
            0,
            "call_agent",
            json!({"agent": "helper", "mission": "m", "context": big}),
        ),
        call(
            1,
            "call_agent",
            json!({"agent": "helper", "mission": "m", "inputs": {"x": "i".repeat(300 * 1024)}}),
        ),
        call(
            2,
            "call_agent",
            json!({"agent": "helper", "mission": "m".repeat(64 * 1024 + 1)}),
        ),
        call(
            3,
            "call_agent",
            json!({"agent": "helper", "mission": "fine"}),
        ),
        call(
            4,
            "call_agent",
            json!({"mission": "m", "agent_definition": {
                "system_prompt": "p".repeat(skein_core::agent::MAX_DEFINITION_BYTES),
                "tools": ["list_dir"],
            }}),
        ),
    ]);
    let Step::Refuse(r) = g.state.next(&def, &limits, &set) else {
        panic!("expected refusals")
    };
    assert_eq!(r.len(), 4, "{r:?}");
    // A custom agent whose definition would be over the size of an agent file.
    assert_eq!(r[3].call, "c4");
    assert!(
        r[3].error.contains("agent_definition refused") && r[3].error.contains("at most 262144"),
        "{}",
        r[3].error
    );
    assert!(
        r[0].error.contains("context is 262145 bytes"),
        "{}",
        r[0].error
    );
    assert!(r[1].error.contains("inputs are"), "{}", r[1].error);
    assert!(
        r[2].error.contains("mission is 65537 bytes"),
        "{}",
        r[2].error
    );
    for x in r {
        g.push(Event::ToolReturned(ToolReturned {
            call: x.call,
            output: x.error,
            error: true,
            ms: 0,
            blob: None,
            refused: None,
        }));
    }
    let Step::Delegate(d) = g.state.next(&def, &limits, &set) else {
        panic!("the call within the limits is delegated")
    };
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].call, "c3");
}

#[test]
fn the_approval_preview_holds_every_byte_of_the_arguments() {
    let set = agents("");
    let def = set.get("boss").unwrap().clone();
    let limits = Limits::default();
    let command = format!("echo {}; touch X", "A".repeat(600));
    let args = json!({"command": command});
    let mut g = Given::submitted(&set);
    g.model_calls(vec![call(0, "shell", args.clone())]);
    let Step::RequestApproval(v) = g.state.next(&def, &limits, &set) else {
        panic!("shell waits for approval")
    };
    assert_eq!(v.len(), 1);
    assert!(v[0].preview.ends_with("; touch X\"}"), "{}", v[0].preview);
    let shown: Value = serde_json::from_str(&v[0].preview).unwrap();
    assert_eq!(shown, args, "the preview is the arguments, whole");
    g.push(Event::ApprovalRequested(ApprovalRequested {
        call: v[0].call.clone(),
        tool: v[0].tool.clone(),
        preview: v[0].preview.clone(),
        token_id: "t1".into(),
    }));
    verify(&g.log, &def, &limits, &set).unwrap();
}
