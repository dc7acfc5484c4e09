//! Durations in `skein.toml` and agent files, through the real binary: compound forms are
//! read everywhere, and a value that is no duration stops the command at load with the key
//! and the value named.

mod common;

use common::*;

fn with_config(extra: &str) -> Sandbox {
    let sb = Sandbox::new();
    let path = sb.config();
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str(extra);
    std::fs::write(&path, text).unwrap();
    sb.agent("solo", "", "turns:\n  - answer: \"done\"\n");
    sb
}

fn refused(sb: &Sandbox, args: &[&str]) -> String {
    let mut c = skein(&sb.config(), &sb.data());
    c.args(args);
    let out = c.output().unwrap();
    assert!(
        !out.status.success(),
        "{args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn compound_durations_are_accepted_in_every_section() {
    let sb = with_config(
        "[runtime]\nlease = \"1m30s\"\n[cache]\nttl = \"1h30m\"\n\
         [tools.http]\ntimeout = \"1m 30s\"\n[tools.shell]\ntimeout = \"2m30s\"\n\
         [models.providers.openai]\ntimeout = \"2m30s\"\nconnect_timeout = \"1s500ms\"\n\
         [nats]\nduplicate_window = \"2m30s\"\nevents_max_age = \"30d\"\ncache_max_age = 0\n",
    );
    sb.agent(
        "cached",
        "cache: {ttl: 1h30m}\n",
        "turns:\n  - answer: \"kept\"\n",
    );
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["run", "--agent", "cached", "--json", "go"]);
    let out = json_of(&run_ok(c));
    assert_eq!(out["answer"], "kept", "{out}");
    let mut c = skein(&sb.config(), &sb.data());
    c.args(["agents", "check"]);
    run_ok(c);
}

#[test]
fn a_bad_duration_in_the_config_file_is_named_at_load() {
    for (section, key, shown) in [
        ("[runtime]\nlease = \"1m30\"\n", "runtime.lease", "1m30"),
        ("[cache]\nttl = \"forever\"\n", "cache.ttl", "forever"),
        ("[tools.http]\ntimeout = \"soon\"\n", "timeout", "soon"),
        ("[tools.shell]\ntimeout = \"-5s\"\n", "timeout", "-5s"),
        (
            "[models.providers.openai]\nconnect_timeout = \"2 fortnights\"\n",
            "connect_timeout",
            "2 fortnights",
        ),
        (
            "[nats]\nevents_max_age = \"1y2\"\n",
            "events_max_age",
            "1y2",
        ),
        (
            "[nats]\nduplicate_window = \"2x\"\n",
            "duplicate_window",
            "2x",
        ),
    ] {
        let sb = with_config(section);
        // A command that needs neither tools, models nor NATS still reads the whole file.
        let err = refused(&sb, &["sessions"]);
        assert!(
            err.contains(key) && err.contains(&format!("`{shown}` is not a duration")),
            "{section}: {err}"
        );
    }
}

#[test]
fn a_bad_cache_ttl_in_an_agent_file_is_named_by_agents_check() {
    let sb = with_config("");
    sb.agent("w", "cache: {ttl: 1h30}\n", "turns:\n  - answer: \"x\"\n");
    let err = refused(&sb, &["agents", "check"]);
    assert!(
        err.contains("w.md: cache.ttl: `1h30` is not a duration"),
        "{err}"
    );
    let err = refused(&sb, &["run", "--agent", "solo", "go"]);
    assert!(err.contains("cache.ttl"), "{err}");
}
