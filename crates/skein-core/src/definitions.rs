//! A version of the definitions that shape a run, as a cluster holds them: every agent
//! file and every script of the `scripted` model, by name, and the settings a tree's
//! decisions depend on (`[limits]`, `[models] default_provider`) when they were pushed. A version is immutable and
//! named by its digest, the blake3 of its canonical encoding (maps sorted by name, fields
//! named), so the same files always make the same version, wherever they are pushed from.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::agent::AgentSet;
use crate::limits::Limits;
use crate::{Error, Result};

/// The format of an encoded version; a reader refuses one it does not know.
pub const DEFINITIONS_FORMAT: u16 = 1;

/// One version of the definitions: agent files and scripts, by their names relative to
/// the directory they were pushed from (`writer.md`, `planner/agent.md`, `writer.yaml`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Definitions {
    pub format: u16,
    pub agents: BTreeMap<String, String>,
    #[serde(default)]
    pub scripts: BTreeMap<String, String>,
    /// The `[limits]` every tree pinned to this version decides under (None: each
    /// worker's own). Absent from a version pushed without it, whose digest stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
    /// `[models] default_provider`: the provider of a bare model name in this version's
    /// agents (None: each worker's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_provider: Option<String>,
}

impl Definitions {
    pub fn new(agents: BTreeMap<String, String>, scripts: BTreeMap<String, String>) -> Self {
        Self {
            format: DEFINITIONS_FORMAT,
            agents,
            scripts,
            limits: None,
            default_provider: None,
        }
    }

    /// Where this version holds one of `secrets`, or text shaped like a provider's API key
    /// or a private key (values no definition may carry: keys stay in each worker's
    /// environment): the files and settings, by name. Values shorter than 8 characters
    /// are not looked for.
    pub fn secrets_in(&self, secrets: &[String]) -> Vec<String> {
        let secrets: Vec<&str> = secrets
            .iter()
            .map(|s| s.trim())
            .filter(|s| s.len() >= 8)
            .collect();
        let holds = |text: &str| secrets.iter().any(|s| text.contains(s)) || key_shaped(text);
        let mut out: Vec<String> = self
            .agents
            .iter()
            .chain(&self.scripts)
            .filter(|(_, t)| holds(t))
            .map(|(n, _)| n.clone())
            .collect();
        if let Some(l) = &self.limits {
            if holds(&serde_json::to_string(l).unwrap_or_default()) {
                out.push("[limits]".into());
            }
        }
        if self.default_provider.as_deref().is_some_and(holds) {
            out.push("[models] default_provider".into());
        }
        out
    }

    /// The canonical bytes of this version (what is stored, and what its digest hashes).
    pub fn encode(&self) -> Result<Vec<u8>> {
        rmp_serde::to_vec_named(self).map_err(|e| Error::Encode(e.to_string()))
    }

    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let d: Self = rmp_serde::from_slice(bytes)
            .map_err(|e| Error::Decode(format!("a definitions version: {e}")))?;
        if d.format > DEFINITIONS_FORMAT {
            return Err(Error::Decode(format!(
                "a definitions version of format {}, newer than this build reads ({})",
                d.format, DEFINITIONS_FORMAT
            )));
        }
        Ok(d)
    }

    /// The version's name: hex blake3 of [`Definitions::encode`].
    pub fn digest(&self) -> Result<String> {
        Ok(blake3::hash(&self.encode()?).to_hex().to_string())
    }

    /// The agent set this version holds, validated as a whole (unknown references,
    /// cycles, a name twice): what `skein agents push` refuses a version for.
    pub fn agent_set(&self, extra_tools: &[String]) -> Result<AgentSet> {
        if self.agents.is_empty() {
            return Err(Error::AgentSet(vec![
                "no agent definitions (*.md) to push".into()
            ]));
        }
        let files: Vec<(String, String)> = self
            .agents
            .iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        AgentSet::load(&files, extra_tools)
    }

    /// What changed from `older` to `self`, file by file, sorted: `+ name` added,
    /// `- name` removed, `~ name` changed.
    pub fn diff(&self, older: &Definitions) -> Vec<String> {
        let mut out = vec![];
        for (kind, new, old) in [
            ("agent", &self.agents, &older.agents),
            ("script", &self.scripts, &older.scripts),
        ] {
            let names: BTreeSet<&String> = new.keys().chain(old.keys()).collect();
            for n in names {
                match (old.get(n), new.get(n)) {
                    (None, Some(_)) => out.push(format!("+ {kind} {n}")),
                    (Some(_), None) => out.push(format!("- {kind} {n}")),
                    (Some(a), Some(b)) if a != b => out.push(format!("~ {kind} {n}")),
                    _ => {}
                }
            }
        }
        if self.limits != older.limits {
            out.push("~ [limits]".into());
        }
        if self.default_provider != older.default_provider {
            out.push("~ [models] default_provider".into());
        }
        out
    }
}

/// Whether `text` holds something shaped like a key: a private key block, or a word that
/// starts as the API keys of common providers do and goes on for 20 or more key
/// characters.
fn key_shaped(text: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "sk-",
        "sk_live_",
        "ghp_",
        "github_pat_",
        "xoxb-",
        "AKIA",
        "AIza",
    ];
    if text.contains("PRIVATE KEY-----") {
        return true;
    }
    let key_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    text.split(|c: char| !key_char(c)).any(|word| {
        PREFIXES.iter().any(|p| {
            word.strip_prefix(p)
                .is_some_and(|rest| rest.len() >= 20 && rest.chars().any(|c| c.is_ascii_digit()))
        })
    })
}

/// The short form of a version's digest shown to people (its first 12 hex digits).
pub fn short(digest: &str) -> &str {
    digest.get(..12).unwrap_or(digest)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn agent(name: &str, calls: &[&str]) -> String {
        let tools = if calls.is_empty() {
            String::new()
        } else {
            format!("tools: [call_agent]\nagents: [{}]\n", calls.join(", "))
        };
        format!("---\nname: {name}\ndescription: d\nmodel: scripted:{name}\n{tools}---\nprompt\n")
    }

    fn defs(files: &[(&str, String)]) -> Definitions {
        Definitions::new(
            files
                .iter()
                .map(|(n, t)| (n.to_string(), t.clone()))
                .collect(),
            BTreeMap::new(),
        )
    }

    #[test]
    fn the_same_files_make_the_same_version_and_any_change_another() {
        let a = defs(&[("a.md", agent("a", &[])), ("b.md", agent("b", &[]))]);
        let again = defs(&[("b.md", agent("b", &[])), ("a.md", agent("a", &[]))]);
        assert_eq!(a.digest().unwrap(), again.digest().unwrap());
        let round = Definitions::decode(&a.encode().unwrap()).unwrap();
        assert_eq!(round, a);
        let mut changed = a.clone();
        changed.scripts.insert("a.yaml".into(), "turns: []".into());
        assert_ne!(a.digest().unwrap(), changed.digest().unwrap());
        assert_eq!(changed.diff(&a), ["+ script a.yaml"]);
        let b2 = defs(&[("a.md", agent("a", &[])), ("c.md", agent("c", &[]))]);
        assert_eq!(b2.diff(&a), ["- agent b.md", "+ agent c.md"]);
    }

    #[test]
    fn a_version_with_a_cycle_or_an_unknown_agent_is_refused_with_the_reason() {
        let ok = defs(&[("a.md", agent("a", &["b"])), ("b.md", agent("b", &[]))]);
        assert_eq!(ok.agent_set(&[]).unwrap().agents.len(), 2);
        let unknown = defs(&[("a.md", agent("a", &["nobody"]))]);
        let e = unknown.agent_set(&[]).unwrap_err().to_string();
        assert!(e.contains("nobody"), "{e}");
        let cycle = defs(&[("a.md", agent("a", &["b"])), ("b.md", agent("b", &["a"]))]);
        let e = cycle.agent_set(&[]).unwrap_err().to_string();
        assert!(e.contains("cycle") || e.contains("a → b"), "{e}");
        let e = defs(&[]).agent_set(&[]).unwrap_err().to_string();
        assert!(e.contains("no agent definitions"), "{e}");
    }

    #[test]
    fn the_settings_pushed_with_a_version_are_part_of_it_and_no_secret_is() {
        let plain = defs(&[("a.md", agent("a", &[]))]);
        let mut with = plain.clone();
        with.limits = Some(Limits {
            max_depth: 1,
            ..Limits::default()
        });
        with.default_provider = Some("openai".into());
        assert_ne!(plain.digest().unwrap(), with.digest().unwrap());
        assert_eq!(Definitions::decode(&with.encode().unwrap()).unwrap(), with);
        assert_eq!(
            with.diff(&plain),
            ["~ [limits]", "~ [models] default_provider"]
        );
        let key = "a-value-from-the-environment-1".to_string();
        assert!(with.secrets_in(std::slice::from_ref(&key)).is_empty());
        let mut leaky = with.clone();
        leaky
            .agents
            .insert("b.md".into(), format!("{}use {key}\n", agent("b", &[])));
        assert_eq!(leaky.secrets_in(&[key, "short".into()]), ["b.md"]);
        // A key of a known shape is found without being known.
        let mut shaped = with.clone();
        shaped.scripts.insert(
            "a.yaml".into(),
            "turns:\n  - answer: \"sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t\"\n".into(),
        );
        assert_eq!(shaped.secrets_in(&[]), ["a.yaml"]);
        // Words that only start like one are not.
        let mut plain_words = with.clone();
        plain_words.scripts.insert(
            "a.yaml".into(),
            "turns:\n  - answer: sk-learn and AKIA\n".into(),
        );
        assert!(plain_words.secrets_in(&[]).is_empty());
    }

    #[test]
    fn a_version_of_a_later_format_is_refused() {
        let mut d = defs(&[("a.md", agent("a", &[]))]);
        d.format = DEFINITIONS_FORMAT + 1;
        let e = Definitions::decode(&d.encode().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("newer than this build reads"), "{e}");
    }
}
