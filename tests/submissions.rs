//! Submissions under a chosen id on the embedded backend: the same submission again is a
//! no-op that gives the same answer; a different one under a taken id is refused by name.

mod common;

use common::*;

fn run(sb: &Sandbox, args: &[&str]) -> std::process::Output {
    skein(&sb.config(), &sb.data()).args(args).output().unwrap()
}

/// Every event of the root `id`, as JSON lines.
fn log_of(sb: &Sandbox, id: &str) -> String {
    let out = run(sb, &["events", id, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_different_submission_under_a_taken_id_is_refused_and_the_same_one_is_a_no_op() {
    let sb = Sandbox::new();
    sb.agent("echo", "", "turns:\n  - answer: \"echo: {{ mission }}\"\n")
        .agent(
            "other",
            "",
            "turns:\n  - answer: \"other: {{ mission }}\"\n",
        );
    let first = run(
        &sb,
        &[
            "run",
            "--agent",
            "echo",
            "--id",
            "job-7",
            "--context",
            "ctx",
            "--json",
            "first",
        ],
    );
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert_eq!(json_of(&first)["answer"], "echo: first");
    let before = log_of(&sb, "job-7");

    // The same submission again: the old tree's answer, nothing new in its log. Inputs
    // left out and given as `{}` are the same request, and so are no priority and 0.
    for extra in [&[][..], &["--inputs", "{}"][..], &["--priority", "0"][..]] {
        let mut args = vec![
            "run",
            "--agent",
            "echo",
            "--id",
            "job-7",
            "--context",
            "ctx",
        ];
        args.extend_from_slice(extra);
        args.extend(["--json", "first"]);
        let again = run(&sb, &args);
        assert!(
            again.status.success(),
            "{}",
            String::from_utf8_lossy(&again.stderr)
        );
        assert_eq!(json_of(&again)["answer"], "echo: first");
        assert_eq!(log_of(&sb, "job-7"), before, "a repeated submission wrote");
    }

    // Anything else under that id is refused with a reason naming the id and what differs.
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "--agent",
                "echo",
                "--context",
                "ctx",
                "--priority",
                "5",
                "first",
            ],
            "priority 0, not 5",
        ),
        (
            &["--agent", "echo", "--context", "ctx", "second"],
            "another mission",
        ),
        (
            &["--agent", "other", "--context", "ctx", "first"],
            "agent `echo`, not `other`",
        ),
        (
            &["--agent", "echo", "--context", "more", "first"],
            "another context",
        ),
        (&["--agent", "echo", "first"], "another context"),
        (
            &[
                "--agent",
                "echo",
                "--context",
                "ctx",
                "--inputs",
                "{\"k\": 1}",
                "first",
            ],
            "other inputs",
        ),
    ];
    for (args, differs) in cases {
        let mut all = vec!["run", "--id", "job-7", "--json"];
        all.extend_from_slice(args);
        let out = run(&sb, &all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted: {err}");
        assert_ne!(out.status.code(), Some(101), "a panic: {err}");
        assert!(
            err.contains("session id `job-7` is already taken by a different submission"),
            "{args:?}: {err}"
        );
        assert!(err.contains(differs), "{args:?}: {err}");
        assert!(
            out.stdout.is_empty(),
            "the old tree's answer was printed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert_eq!(log_of(&sb, "job-7"), before, "a refused submission wrote");
    }
    let roots = json_of(&run_ok({
        let mut c = skein(&sb.config(), &sb.data());
        c.args(["sessions", "--json"]);
        c
    }));
    assert_eq!(roots.as_array().unwrap().len(), 1, "{roots}");
}
