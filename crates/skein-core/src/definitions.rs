//! A version of the definitions that shape a run, as a cluster holds them: every agent
//! file and every script of the `scripted` model, by name. A version is immutable and
//! named by its digest, the blake3 of its canonical encoding (maps sorted by name, fields
//! named), so the same files always make the same version, wherever they are pushed from.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::agent::AgentSet;
use crate::{Error, Result};

/// The format of an encoded version; a reader refuses one it does not know.
pub const DEFINITIONS_FORMAT: u16 = 1;

/// One version of the definitions: agent files and scripts, by their names relative to
/// the directory they were pushed from (`writer.md`, `planner/agent.md`, `writer.yaml`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Definitions {
    pub format: u16,
    pub agents: BTreeMap<String, String>,
    #[serde(default)]
    pub scripts: BTreeMap<String, String>,
}

impl Definitions {
    pub fn new(agents: BTreeMap<String, String>, scripts: BTreeMap<String, String>) -> Self {
        Self {
            format: DEFINITIONS_FORMAT,
            agents,
            scripts,
        }
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
        out
    }
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
    fn a_version_of_a_later_format_is_refused() {
        let mut d = defs(&[("a.md", agent("a", &[]))]);
        d.format = DEFINITIONS_FORMAT + 1;
        let e = Definitions::decode(&d.encode().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("newer than this build reads"), "{e}");
    }
}
