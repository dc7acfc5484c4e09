//! Property tests of the pure core: generated sessions are driven by `next` with random
//! model answers, tool outcomes and child outcomes; then
//! - every envelope survives encode → decode unchanged,
//! - folding the decoded log gives the same state,
//! - re-deciding from every prefix admits every recorded event,
//! - changing one decided event is caught at its seq.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use serde_json::json;
use skein_core::event::{
    genesis_hash, CacheHit, ChildSettled, Completed, Delegated, Failed, ModelCalled, ModelFailed,
    Outcome, Submitted, ToolCalled, ToolReturned,
};
use skein_core::replay::verify;
use skein_core::{
    AgentSet, Budget, Envelope, Event, Limits, ModelResponse, Record, SessionId, SessionState,
    Step, ToolCall, Usage,
};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn agents() -> AgentSet {
    let f = |name: &str, extra: &str| {
        (
            format!("{name}.md"),
            format!("---\nname: {name}\nmodel: scripted:{name}\n{extra}---\nYou are {name}.\n"),
        )
    };
    AgentSet::load(
        &[
            f("boss", "agents: [a, b]\ntools: [list_dir, read_file, write_file, ask_user, update_plan]\nlimits: {max_children_per_turn: 3, max_steps: 8}\n"),
            f("a", "agents: [b]\ntools: [list_dir]\n"),
            f("b", "recursive: true\nagents: [b]\n"),
        ],
        &[],
    )
    .expect("valid agents")
}

fn random_call(rng: &mut Rng, k: usize) -> ToolCall {
    let id = format!("c{}_{k}", rng.next() % 100000);
    let (name, args) = match rng.below(10) {
        9 => (
            "read_file",
            unreadable_args("{\"path\": x", "arguments are not valid JSON"),
        ),
        8 => {
            let t = format!("t{}", rng.below(4));
            let u = format!("t{}", rng.below(4));
            let ops = match rng.below(4) {
                0 => json!([{"op": "add", "task": {"id": t, "title": "T"}}]),
                1 => json!([{"op": "update", "task_id": t, "fields": {"status": "COMPLETED"}}]),
                2 => json!([{"op": "link_dep", "task_id": t, "depends_on": u}]),
                _ => json!([{"op": "unlink_dep", "task_id": t, "depends_on": u}]),
            };
            let args = if rng.below(3) == 0 {
                json!({"base_version": rng.below(3), "ops": ops})
            } else {
                json!({"ops": ops})
            };
            ("update_plan", args)
        }
        0..=2 => {
            let agent = ["a", "b", "ghost", "boss"][rng.below(4) as usize];
            let args = match rng.below(6) {
                0 => json!({"agent": agent}),
                1 => {
                    json!({"agent_definition": {"system_prompt": "p", "tools": ["list_dir"]}, "mission": "m"})
                }
                2 => {
                    json!({"agent_definition": {"system_prompt": "p", "tools": ["shell"]}, "mission": "m"})
                }
                3 => json!({"agent": agent, "mission": "m", "budget": {"tokens": rng.below(5000)}}),
                _ => json!({"agent": agent, "mission": format!("m{}", rng.below(3))}),
            };
            ("call_agent", args)
        }
        3 | 4 => ("list_dir", json!({"path": "."})),
        5 => ("read_file", json!({"path": "x"})),
        6 => match rng.below(4) {
            0 => ("shell", json!({"cmd": "ls"})),
            1 => ("write_file", json!({"path": "x", "content": "y"})),
            2 => (
                "ask_user",
                json!({"questions": ["which?", {"key": "v", "question": "version?"}]}),
            ),
            _ => ("ask_user", json!({"questions": []})),
        },
        _ => ("teleport", json!({})),
    };
    ToolCall {
        id,
        name: name.into(),
        args,
    }
}

/// The arguments a provider records for a call it could not read (`{_raw, _error}`).
fn unreadable_args(raw: &str, error: &str) -> serde_json::Value {
    json!({"_raw": raw, "_error": error})
}

/// Drives a session with random outside facts; returns its log.
fn simulate(seed: u64) -> (Vec<Envelope>, AgentSet, Limits) {
    let set = agents();
    let limits = Limits {
        max_depth: 2,
        max_steps: 8,
        max_children_per_turn: 4,
        ..Limits::default()
    };
    let def = set.get("boss").expect("boss").clone();
    let mut rng = Rng(seed | 1);
    let id = SessionId::root("sim").expect("id");
    let mut log: Vec<Envelope> = vec![];
    let mut state = SessionState::default();
    let push = |body: Event, log: &mut Vec<Envelope>, state: &mut SessionState| {
        let seq = log.len() as u64 + 1;
        let prev = log
            .last()
            .map(|e| skein_core::event::record_hash(&e.encode().expect("encode")))
            .unwrap_or_else(|| genesis_hash(&id));
        let env = Envelope::new(id.clone(), seq, 1000 + seq, prev, body);
        state.apply(&env);
        log.push(env);
    };
    let budget = if rng.below(3) == 0 {
        Some(rng.below(20_000))
    } else {
        None
    };
    push(
        Event::Submitted(Submitted {
            def_digest: def.digest.clone(),
            mission: "simulate".into(),
            inputs: serde_json::Value::Null,
            mission_hash: "h".into(),
            depth: rng.below(3) as u32,
            budget: Budget {
                tokens: budget,
                max_steps: None,
            },
            // A path through `a` makes delegating to `a` again an ancestry refusal.
            ancestry: [vec![], vec!["a".to_string()], vec!["b".to_string()]][rng.below(3) as usize]
                .clone(),
            ..Submitted::for_test("boss")
        }),
        &mut log,
        &mut state,
    );
    for _ in 0..200 {
        let step = state.next(&def, &limits, &set);
        match step {
            Step::CallModel { model, .. } => {
                if rng.below(10) == 0 {
                    let body = ModelFailed {
                        model: model.clone(),
                        error: "HTTP 503".into(),
                        retryable: rng.below(4) != 0,
                        attempt: state.failures.model_failures + 1,
                        worker: "w".into(),
                    };
                    push(Event::ModelFailed(body), &mut log, &mut state);
                    continue;
                }
                let calls: Vec<ToolCall> = if rng.below(4) == 0 {
                    vec![]
                } else {
                    (0..1 + rng.below(4) as usize)
                        .map(|k| random_call(&mut rng, k))
                        .collect()
                };
                let content = calls
                    .is_empty()
                    .then(|| format!("answer {}", rng.below(100)));
                push(
                    Event::ModelCalled(ModelCalled {
                        model,
                        request_digest: "d".into(),
                        response: ModelResponse {
                            content,
                            tool_calls: calls,
                            finish_reason: None,
                        },
                        usage: Usage {
                            input_tokens: rng.below(800),
                            output_tokens: rng.below(200),
                            cost: 0.0,
                            estimated: false,
                            ..Default::default()
                        },
                        latency_ms: 1,
                        worker: "w".into(),
                    }),
                    &mut log,
                    &mut state,
                );
            }
            Step::Refuse(rs) => {
                for r in rs {
                    push(
                        Event::ToolReturned(ToolReturned {
                            call: r.call,
                            output: r.error,
                            error: true,
                            ms: 0,
                            blob: None,
                            refused: None,
                        }),
                        &mut log,
                        &mut state,
                    );
                }
            }
            Step::Delegate(ds) => {
                for d in ds {
                    if rng.below(5) == 0 {
                        push(
                            Event::CacheHit(CacheHit {
                                call: d.call,
                                mission_hash: "mh".into(),
                                source: SessionId::root("src").expect("id"),
                                answer: "cached".into(),
                                saved: Usage::default(),
                                steps: 2,
                                key: None,
                            }),
                            &mut log,
                            &mut state,
                        );
                    } else {
                        push(
                            Event::Delegated(Delegated {
                                call: d.call,
                                child: d.child,
                                agent: d.agent,
                                mission_hash: "mh".into(),
                                allotted_tokens: d.budget.tokens,
                                kind: skein_core::event::DelegationKind::Started,
                                owns_tasks: vec![],
                                max_steps: None,
                            }),
                            &mut log,
                            &mut state,
                        );
                    }
                }
            }
            Step::RunTools(runs) => {
                let fresh: Vec<_> = runs.iter().filter(|r| !r.resumed).cloned().collect();
                for r in &fresh {
                    push(
                        Event::ToolCalled(ToolCalled {
                            call: r.call.clone(),
                            tool: r.tool.clone(),
                            args: r.args.clone(),
                            worker: "w".into(),
                        }),
                        &mut log,
                        &mut state,
                    );
                }
                // Sometimes the "worker crashes" here: the next step sees resumed runs.
                if !fresh.is_empty() && rng.below(4) == 0 {
                    continue;
                }
                for r in &runs {
                    push(
                        Event::ToolReturned(ToolReturned {
                            call: r.call.clone(),
                            output: "ok".into(),
                            error: rng.below(5) == 0,
                            ms: 1,
                            blob: None,
                            refused: None,
                        }),
                        &mut log,
                        &mut state,
                    );
                }
            }
            Step::AskUser(asks) => {
                for a in asks {
                    let body = skein_core::event::InputRequested {
                        call: Some(a.call),
                        questions: a.questions,
                        context: a.context,
                        defaults: a.defaults,
                        token_id: format!("t{}", rng.next()),
                    };
                    push(Event::InputRequested(body), &mut log, &mut state);
                }
            }
            Step::RequestApproval(v) => {
                for a in v {
                    let body = skein_core::event::ApprovalRequested {
                        call: a.call,
                        tool: a.tool,
                        preview: a.preview,
                        token_id: format!("a{}", rng.next()),
                    };
                    push(Event::ApprovalRequested(body), &mut log, &mut state);
                }
            }
            Step::Wait if !state.pauses.pending_inputs.is_empty() && rng.below(2) == 0 => {
                let p = state.pauses.pending_inputs[0].clone();
                let body = skein_core::event::InputProvided {
                    answers: json!({"q1": "yes", "v": "3.12"}),
                    token_id: p.token_id,
                    by: None,
                };
                push(Event::InputProvided(body), &mut log, &mut state);
            }
            Step::Wait if !state.pauses.pending_approvals.is_empty() => {
                let p = state.pauses.pending_approvals[0].clone();
                let body = skein_core::event::ApprovalGiven {
                    call: p.call,
                    approved: rng.below(2) == 0,
                    by: Some("tester".into()),
                    reason: None,
                    token_id: p.token_id,
                };
                push(Event::ApprovalGiven(body), &mut log, &mut state);
            }
            Step::Wait if state.outstanding_children().is_empty() => {
                let p = state.pauses.pending_inputs[0].clone();
                let body = skein_core::event::InputProvided {
                    answers: json!({}),
                    token_id: p.token_id,
                    by: None,
                };
                push(Event::InputProvided(body), &mut log, &mut state);
            }
            Step::Wait => {
                let out = state.outstanding_children();
                let (call, child) = out[rng.below(out.len() as u64) as usize].clone();
                let usage = Usage {
                    input_tokens: rng.below(500),
                    output_tokens: rng.below(100),
                    cost: 0.0,
                    estimated: false,
                    ..Default::default()
                };
                let outcome = if rng.below(4) == 0 {
                    Outcome::Failed {
                        error: "boom".into(),
                        usage,
                        steps: 1,
                    }
                } else {
                    Outcome::Completed {
                        answer: "child answer".into(),
                        patch: None,
                        usage,
                        steps: 3,
                        partial: false,
                    }
                };
                push(
                    Event::ChildSettled(ChildSettled {
                        call,
                        child,
                        outcome,
                    }),
                    &mut log,
                    &mut state,
                );
            }
            Step::Complete { answer } => {
                push(
                    Event::Completed(Completed {
                        answer,
                        usage_total: state.usage_total(),
                        steps: state.steps,
                        partial: false,
                    }),
                    &mut log,
                    &mut state,
                );
                break;
            }
            Step::Fail { error } => {
                push(
                    Event::Failed(Failed {
                        error,
                        usage_total: state.usage_total(),
                        steps: state.steps,
                        dead_letter: false,
                    }),
                    &mut log,
                    &mut state,
                );
                break;
            }
            Step::EditPlan(e) => push(e.into_event(), &mut log, &mut state),
            Step::Orchestrate(e) => push(*e, &mut log, &mut state),
            // The generated agents neither summarise nor ask follow-ups, and no generated
            // session was handed tasks.
            Step::Idle
            | Step::Summarize { .. }
            | Step::Clarify(_)
            | Step::ProposePatch(_)
            | Step::Broadcast(_) => break,
        }
    }
    (log, set, limits)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn encode_decode_is_identity_and_refold_matches(seed in any::<u64>()) {
        let (log, _, _) = simulate(seed);
        let mut decoded = vec![];
        for env in &log {
            let bytes = env.encode().expect("encode");
            let back = Envelope::decode(&bytes).expect("decode");
            prop_assert_eq!(&back, env);
            decoded.push(Record::decode(bytes).expect("record"));
        }
        let session = log[0].session.clone();
        skein_core::event::verify_chain(&session, &decoded).expect("chain");
        let a = SessionState::fold(&log);
        let b = SessionState::fold(decoded.iter().map(|r| &r.env));
        prop_assert_eq!(a, b);
    }

    #[test]
    fn refolding_reproduces_every_decision(seed in any::<u64>()) {
        let (log, set, limits) = simulate(seed);
        let def = set.get("boss").expect("boss");
        if let Err(d) = verify(&log, def, &limits, &set) {
            return Err(TestCaseError::fail(format!("seed {seed}: {d}")));
        }
    }

    #[test]
    fn a_changed_decision_is_caught_at_its_seq(seed in any::<u64>()) {
        let (mut log, set, limits) = simulate(seed);
        let def = set.get("boss").expect("boss");
        // Re-point the first delegation at a child the decision did not name.
        let Some(i) = log.iter().position(|e| matches!(e.body, Event::Delegated(_))) else {
            return Ok(());
        };
        if let Event::Delegated(d) = &mut log[i].body {
            d.child = d.child.child("forged", 99);
        }
        let err = verify(&log, def, &limits, &set).expect_err("must diverge");
        prop_assert_eq!(err.seq, log[i].seq);
    }
}

#[test]
fn unknown_event_kinds_are_kept_and_shown() {
    let id = SessionId::root("u").expect("id");
    let env = Envelope::new(
        id,
        2,
        5,
        "p".into(),
        Event::Unknown {
            kind: "TeamVote".into(),
            data: json!({"msg": "hi"}),
        },
    );
    let back = Envelope::decode(&env.encode().expect("encode")).expect("decode");
    assert_eq!(back, env);
    assert_eq!(back.body.kind(), "TeamVote");
    let mut s = SessionState::default();
    s.apply(&back);
    assert_eq!(s.unknown_events, 1);
}

/// Guards the properties above against passing vacuously: the simulator must reach every
/// kind of decision.
#[test]
fn the_simulator_exercises_every_step() {
    let mut kinds = std::collections::BTreeMap::new();
    let mut refusals = 0;
    for seed in 1..300u64 {
        let (log, _, _) = simulate(seed);
        for e in &log {
            *kinds.entry(e.body.kind().to_string()).or_insert(0) += 1;
            if let Event::ToolReturned(t) = &e.body {
                refusals += usize::from(t.error && t.ms == 0);
            }
        }
    }
    for k in [
        "Submitted",
        "ModelCalled",
        "ModelFailed",
        "ToolCalled",
        "ToolReturned",
        "Delegated",
        "CacheHit",
        "ChildSettled",
        "Completed",
        "Failed",
    ] {
        assert!(
            kinds.get(k).copied().unwrap_or(0) > 5,
            "{k} seen {:?} times",
            kinds.get(k)
        );
    }
    assert!(refusals > 20, "refusals: {refusals}");
}

/// A `next` that is not a function of the log (it depends on how often it was asked) is
/// caught by the verifier, at the seq where its decision first differs.
#[test]
fn a_non_deterministic_next_is_caught_with_the_diverging_seq() {
    let set = agents();
    let limits = Limits {
        max_depth: 2,
        max_steps: 8,
        max_children_per_turn: 4,
        ..Limits::default()
    };
    let def = set.get("boss").expect("boss").clone();
    let (log, _, _) = (1..500u64)
        .map(simulate)
        .find(|(l, _, _)| {
            l.iter()
                .filter(|e| matches!(e.body, Event::ModelCalled(_)))
                .count()
                >= 2
        })
        .expect("a session with two model turns");
    let mut asked = 0;
    let flaky = |s: &SessionState| {
        let step = s.next(&def, &limits, &set);
        match step {
            Step::CallModel {
                mut model,
                tool_names,
            } => {
                asked += 1;
                if asked == 2 {
                    model = "scripted:someone-else".into();
                }
                Step::CallModel { model, tool_names }
            }
            other => other,
        }
    };
    let err = skein_core::replay::verify_with(&log, flaky).expect_err("diverges");
    let second_call = log
        .iter()
        .filter(|e| matches!(e.body, Event::ModelCalled(_) | Event::ModelFailed(_)))
        .nth(1)
        .expect("second model event")
        .seq;
    assert_eq!(err.seq, second_call);
    assert_eq!(err.expected, "call_model");
}

/// Given a session whose model keeps sending tool calls that cannot be read, when each is
/// refused with a tool error, then after `max_unreadable_turns` such turns in a row the
/// session fails with the reason; a readable turn in between starts the count again.
#[test]
fn unreadable_tool_calls_are_refused_then_fail_the_session_after_the_limit() {
    let set = agents();
    let def = set.get("boss").expect("boss").clone();
    let limits = Limits::default();
    assert_eq!(limits.max_unreadable_turns, 3);
    let id = SessionId::root("unreadable").expect("id");
    let mut log: Vec<Envelope> = vec![];
    let mut state = SessionState::default();
    let mut push = |body: Event, state: &mut SessionState| {
        let seq = log.len() as u64 + 1;
        let prev = log
            .last()
            .map(|e| skein_core::event::record_hash(&e.encode().expect("encode")))
            .unwrap_or_else(|| genesis_hash(&id));
        let env = Envelope::new(id.clone(), seq, seq, prev, body);
        state.apply(&env);
        log.push(env);
    };
    push(
        Event::Submitted(Submitted {
            def_digest: def.digest.clone(),
            mission: "m".into(),
            inputs: serde_json::Value::Null,
            mission_hash: "h".into(),
            ..Submitted::for_test("boss")
        }),
        &mut state,
    );
    // One model turn with the given calls, then whatever `next` decides for them.
    let mut turn = |n: usize, args: serde_json::Value, state: &mut SessionState| -> Step {
        assert!(matches!(
            state.next(&def, &limits, &set),
            Step::CallModel { .. }
        ));
        let call = ToolCall {
            id: format!("c{n}"),
            name: "list_dir".into(),
            args,
        };
        push(
            Event::ModelCalled(ModelCalled {
                model: "scripted:boss".into(),
                request_digest: "d".into(),
                response: ModelResponse {
                    content: None,
                    tool_calls: vec![call],
                    finish_reason: None,
                },
                usage: Usage::default(),
                latency_ms: 1,
                worker: "w".into(),
            }),
            state,
        );
        let step = state.next(&def, &limits, &set);
        let body = match &step {
            Step::Refuse(rs) => ToolReturned {
                call: rs[0].call.clone(),
                output: rs[0].error.clone(),
                error: true,
                ms: 0,
                blob: None,
                refused: None,
            },
            Step::RunTools(rs) => {
                let called = ToolCalled {
                    call: rs[0].call.clone(),
                    tool: rs[0].tool.clone(),
                    args: rs[0].args.clone(),
                    worker: "w".into(),
                };
                push(Event::ToolCalled(called), state);
                ToolReturned {
                    call: rs[0].call.clone(),
                    output: "a.txt".into(),
                    error: false,
                    ms: 1,
                    blob: None,
                    refused: None,
                }
            }
            other => panic!("turn {n}: {other:?}"),
        };
        push(Event::ToolReturned(body), state);
        step
    };
    let bad = || unreadable_args("{\"path\": .", "arguments are not valid JSON");
    // Two unreadable turns: each refused with the reason, quoting what was sent.
    for n in 0..2 {
        match turn(n, bad(), &mut state) {
            Step::Refuse(rs) => {
                assert!(rs[0].error.contains("could not be read"), "{}", rs[0].error);
                assert!(rs[0].error.contains("{\"path\": ."), "{}", rs[0].error);
            }
            other => panic!("{other:?}"),
        }
    }
    // A readable turn resets the count.
    assert!(matches!(
        turn(2, json!({"path": "."}), &mut state),
        Step::RunTools(_)
    ));
    assert_eq!(state.failures.unreadable_turns, 0);
    for n in 3..6 {
        assert!(matches!(turn(n, bad(), &mut state), Step::Refuse(_)));
    }
    assert_eq!(state.failures.unreadable_turns, 3);
    match state.next(&def, &limits, &set) {
        Step::Fail { error } => {
            assert!(error.contains("3 turns in a row"), "{error}");
            assert!(error.contains("arguments are not valid JSON"), "{error}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    // The log re-derives every decision.
    verify(&log, &def, &limits, &set).expect("the log replays");
}

/// A seed the property test failed on: a turn refused for its budget, whose refusals are
/// recorded one at a time, must be refused whole at every prefix.
#[test]
fn refolding_reproduces_every_decision_seed_5354428758124604602() {
    let seed = 5354428758124604602;
    let (log, set, limits) = simulate(seed);
    let def = set.get("boss").expect("boss");
    if let Err(d) = verify(&log, def, &limits, &set) {
        panic!("seed {seed}: {d}");
    }
}
