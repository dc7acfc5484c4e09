//! Durations in agent files: read with the one grammar of `skein_core::duration`, and
//! refused at load when they are not durations.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use skein_core::agent::CacheSetting;
use skein_core::{duration, AgentDef, AgentSet};

fn def(cache: &str) -> String {
    format!("---\nname: w\nmodel: scripted:w\ncache: {cache}\n---\nWork.\n")
}

#[test]
fn a_compound_cache_ttl_is_read_whole() {
    let d = AgentDef::parse("w.md", &def("{ttl: 1h30m}")).unwrap();
    let Some(CacheSetting::Ttl { ttl }) = &d.front.cache else {
        panic!("{:?}", d.front.cache);
    };
    assert_eq!(duration::parse(ttl), Ok(Duration::from_secs(5400)));
    for ok in ["30s", "500ms", "2m", "1h", "1d", "1m 30s", "90"] {
        AgentDef::parse("w.md", &def(&format!("{{ttl: \"{ok}\"}}"))).unwrap();
    }
}

#[test]
fn a_cache_ttl_that_is_no_duration_is_refused_at_load() {
    for bad in ["soon", "1h30", "forever", "-5m", "1x"] {
        let e = AgentDef::parse("agents/w.md", &def(&format!("{{ttl: \"{bad}\"}}")))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("agents/w.md: cache.ttl: ")
                && e.contains(&format!("`{bad}` is not a duration")),
            "{bad}: {e}"
        );
        let set = AgentSet::load(
            &[("agents/w.md".into(), def(&format!("{{ttl: \"{bad}\"}}")))],
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(set.contains("cache.ttl"), "{set}");
    }
}
