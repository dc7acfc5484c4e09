//! Property tests of the plan merge: for any sequence of patches from the owner and from
//! sub-agents it handed tasks to, recording the accepted ones as `PatchApplied` (and the
//! grants as `Delegated {owns_tasks}`) and folding that log — after an encode/decode round
//! trip — gives exactly the plan the merges produced, and renders to the same bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use serde_json::json;
use skein_core::event::{genesis_hash, Delegated, PatchApplied, PatchRejected, Submitted};
use skein_core::plan::{Author, Patch, Plan, UnlinkPolicy};
use skein_core::{Envelope, Event, SessionId, SessionState};

/// One generated action: a grant to child 1 or 2, or a patch by the owner or a child.
#[derive(Debug, Clone)]
enum Action {
    Grant {
        child: u8,
        task: u8,
    },
    Patch {
        who: u8,
        base: BaseKind,
        ops: Vec<Op>,
    },
}

#[derive(Debug, Clone, Copy)]
enum BaseKind {
    Current,
    Stale,
    Missing,
}

#[derive(Debug, Clone)]
enum Op {
    Add(u8, Option<u8>),
    Sub(u8, u8),
    Status(u8, u8),
    Link(u8, u8),
    Unlink(u8, u8),
}

fn op_json(op: &Op) -> serde_json::Value {
    let t = |n: u8| format!("t{n}");
    let status = ["PENDING", "IN_PROGRESS", "COMPLETED", "FAILED", "BLOCKED"];
    match op {
        Op::Add(n, dep) => {
            let mut task = json!({"id": t(*n), "title": format!("Task {n}")});
            if let Some(d) = dep {
                task["depends_on"] = json!([t(*d)]);
            }
            json!({"op": "add", "task": task})
        }
        Op::Sub(p, n) => {
            json!({"op": "add_subtask", "parent_id": t(*p), "task": {"id": format!("t{p}.{n}"), "title": "Sub"}})
        }
        Op::Status(n, s) => {
            json!({"op": "update", "task_id": t(*n), "fields": {"status": status[*s as usize % 5], "notes": format!("note {s}")}})
        }
        Op::Link(a, b) => json!({"op": "link_dep", "task_id": t(*a), "depends_on": t(*b)}),
        Op::Unlink(a, b) => json!({"op": "unlink_dep", "task_id": t(*a), "depends_on": t(*b)}),
    }
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..6, proptest::option::of(0u8..6)).prop_map(|(n, d)| Op::Add(n, d)),
        (0u8..6, 0u8..3).prop_map(|(p, n)| Op::Sub(p, n)),
        (0u8..6, 0u8..5).prop_map(|(n, s)| Op::Status(n, s)),
        (0u8..6, 0u8..6).prop_map(|(a, b)| Op::Link(a, b)),
        (0u8..6, 0u8..6).prop_map(|(a, b)| Op::Unlink(a, b)),
    ]
}

fn action_strategy() -> impl Strategy<Value = Action> {
    prop_oneof![
        1 => (1u8..3, 0u8..6).prop_map(|(child, task)| Action::Grant { child, task }),
        4 => (
            0u8..3,
            prop_oneof![
                3 => Just(BaseKind::Current),
                1 => Just(BaseKind::Stale),
                1 => Just(BaseKind::Missing),
            ],
            proptest::collection::vec(op_strategy(), 1..4)
        )
            .prop_map(|(who, base, ops)| Action::Patch { who, base, ops }),
    ]
}

struct Log {
    root: SessionId,
    envs: Vec<Envelope>,
}

impl Log {
    fn push(&mut self, body: Event) {
        let seq = self.envs.len() as u64 + 1;
        let prev = self
            .envs
            .last()
            .map(|e| skein_core::event::record_hash(&e.encode().expect("encode")))
            .unwrap_or_else(|| genesis_hash(&self.root));
        self.envs
            .push(Envelope::new(self.root.clone(), seq, seq, prev, body));
    }
}

fn run(actions: &[Action], policy: UnlinkPolicy) -> (Plan, Vec<Envelope>, u32) {
    let root = SessionId::root("plan").expect("id");
    let children = [root.child("analyst", 1), root.child("analyst", 2)];
    let mut log = Log {
        root: root.clone(),
        envs: vec![],
    };
    log.push(Event::Submitted(Submitted {
        def_digest: "d".into(),
        mission: "plan".into(),
        inputs: serde_json::Value::Null,
        mission_hash: "h".into(),
        ..Submitted::for_test("orchestrator")
    }));
    let mut plan = Plan::default();
    let mut rejected = 0;
    for (i, a) in actions.iter().enumerate() {
        match a {
            Action::Grant { child, task } => {
                let id = format!("t{task}");
                if plan.get(&id).is_none() {
                    continue;
                }
                let c = &children[*child as usize - 1];
                plan.grant(std::slice::from_ref(&id), "analyst", &c.to_string());
                log.push(Event::Delegated(Delegated {
                    call: format!("c{i}"),
                    child: c.clone(),
                    agent: "analyst".into(),
                    mission_hash: "m".into(),
                    allotted_tokens: None,
                    kind: skein_core::event::DelegationKind::Started,
                    owns_tasks: vec![id],
                    max_steps: None,
                }));
            }
            Action::Patch { who, base, ops } => {
                let from = match who {
                    0 => "self".to_string(),
                    n => children[*n as usize - 1].to_string(),
                };
                let agent = if *who == 0 { "orchestrator" } else { "analyst" };
                let base_version = match base {
                    BaseKind::Current => Some(plan.version),
                    BaseKind::Stale => Some(plan.version + 1),
                    BaseKind::Missing => None,
                };
                let patch = Patch::from_args(&json!({
                    "base_version": base_version,
                    "ops": ops.iter().map(op_json).collect::<Vec<_>>(),
                }))
                .expect("generated patches parse");
                match plan.merge(Author::of(&from, agent), &patch, policy) {
                    Ok(next) => {
                        plan = next;
                        log.push(Event::PatchApplied(PatchApplied {
                            from,
                            agent: agent.into(),
                            call: None,
                            base_version,
                            ops: patch.ops,
                            version: plan.version,
                        }));
                    }
                    Err(reason) => {
                        rejected += 1;
                        log.push(Event::PatchRejected(PatchRejected {
                            from,
                            agent: agent.into(),
                            call: None,
                            base_version,
                            reason,
                        }));
                    }
                }
            }
        }
    }
    (plan, log.envs, rejected)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn folding_the_log_gives_the_merged_plan(
        actions in proptest::collection::vec(action_strategy(), 1..40),
        policy in prop_oneof![Just(UnlinkPolicy::Owner), Just(UnlinkPolicy::Any), Just(UnlinkPolicy::Never)],
    ) {
        let (plan, envs, rejected) = run(&actions, policy);
        // Through the wire format, as a worker reads it.
        let decoded: Vec<Envelope> = envs
            .iter()
            .map(|e| Envelope::decode(&e.encode().expect("encode")).expect("decode"))
            .collect();
        let state = SessionState::fold(&decoded);
        prop_assert_eq!(&state.planning.plan, &plan);
        prop_assert_eq!(state.planning.patches_rejected, rejected);
        prop_assert!(plan.find_cycle().is_none());
        let md = plan.render_markdown();
        prop_assert_eq!(&state.planning.plan.render_markdown(), &md);
        // The same actions again: the same bytes.
        let (again, _, _) = run(&actions, policy);
        prop_assert_eq!(again.render_markdown(), md);
    }
}

#[test]
fn the_generator_reaches_accepted_and_rejected_patches_of_every_kind() {
    // Guards the property above against a generator that only ever produces rejections.
    let actions = vec![
        Action::Patch {
            who: 0,
            base: BaseKind::Current,
            ops: vec![Op::Add(0, None), Op::Add(1, Some(0))],
        },
        Action::Grant { child: 1, task: 1 },
        Action::Patch {
            who: 1,
            base: BaseKind::Current,
            ops: vec![Op::Status(1, 2), Op::Sub(1, 0)],
        },
        Action::Patch {
            who: 2,
            base: BaseKind::Current,
            ops: vec![Op::Status(1, 3)],
        },
        Action::Patch {
            who: 1,
            base: BaseKind::Stale,
            ops: vec![Op::Status(1, 1)],
        },
    ];
    let (plan, envs, rejected) = run(&actions, UnlinkPolicy::Owner);
    assert_eq!(plan.version, 2);
    assert_eq!(rejected, 2);
    assert_eq!(SessionState::fold(&envs).planning.plan, plan);
    assert!(plan
        .render_markdown()
        .contains("[x] **t1** Task 1 (COMPLETED)"));
}
