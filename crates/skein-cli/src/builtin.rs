//! What the binary carries so that it works without a checkout: the demo's configuration,
//! agents and scripts (the files under `config/` of the repository, compiled in), and the
//! starting project `skein init` writes.
//!
//! Where a command finds its configuration, first match wins:
//! 1. `--config FILE` (or `SKEIN_CONFIG`): that file, its directories relative to it;
//! 2. `config/skein.toml` under the current directory;
//! 3. a `config/agents` directory under the current directory, with the built-in defaults
//!    (`config/agents`, `config/scripts`);
//! 4. otherwise the built-in demo: the repository's `config/skein.toml`, agents and scripts
//!    as compiled into the binary. `SKEIN__AGENTS_DIR` / `SKEIN__SCRIPTS_DIR` still point
//!    either at a directory.

use std::collections::BTreeMap;

/// The demo's `skein.toml`.
pub const CONFIG: &str = include_str!("../../../config/skein.toml");

/// The demo's agent definitions, by file name.
pub const AGENTS: &[(&str, &str)] = &[
    (
        "analyst.md",
        include_str!("../../../config/agents/analyst.md"),
    ),
    (
        "orchestrator.md",
        include_str!("../../../config/agents/orchestrator.md"),
    ),
    (
        "planner.md",
        include_str!("../../../config/agents/planner.md"),
    ),
    (
        "researcher.md",
        include_str!("../../../config/agents/researcher.md"),
    ),
    (
        "writer.md",
        include_str!("../../../config/agents/writer.md"),
    ),
];

/// The demo's scripts for the `scripted` model, by file name.
pub const SCRIPTS: &[(&str, &str)] = &[
    (
        "analyst.yaml",
        include_str!("../../../config/scripts/analyst.yaml"),
    ),
    (
        "orchestrator.yaml",
        include_str!("../../../config/scripts/orchestrator.yaml"),
    ),
    (
        "planner.yaml",
        include_str!("../../../config/scripts/planner.yaml"),
    ),
    (
        "researcher.yaml",
        include_str!("../../../config/scripts/researcher.yaml"),
    ),
    (
        "writer.yaml",
        include_str!("../../../config/scripts/writer.yaml"),
    ),
];

/// How built-in files are named in messages and in `skein agents check`.
pub const ORIGIN: &str = "(built in)";

/// The built-in agent definitions as (origin, text), the shape read from a directory.
pub fn agent_files() -> Vec<(String, String)> {
    AGENTS
        .iter()
        .map(|(name, text)| (format!("{ORIGIN}/agents/{name}"), (*text).to_string()))
        .collect()
}

/// The built-in scripts, keyed by the name a `scripted:NAME` model gives.
pub fn scripts() -> BTreeMap<String, String> {
    SCRIPTS
        .iter()
        .map(|(file, text)| {
            let name = file.strip_suffix(".yaml").unwrap_or(file);
            (name.to_string(), (*text).to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file of the repository's demo is compiled in, and nothing else: a file added
    /// under `config/agents` or `config/scripts` must be added here too.
    #[test]
    fn the_built_in_set_is_the_repository_demo() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
        for (dir, set) in [("agents", AGENTS), ("scripts", SCRIPTS)] {
            let mut on_disk: Vec<String> = std::fs::read_dir(root.join(dir))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            on_disk.sort();
            let carried: Vec<String> = set.iter().map(|(n, _)| n.to_string()).collect();
            assert_eq!(on_disk, carried, "config/{dir}");
        }
    }
}
