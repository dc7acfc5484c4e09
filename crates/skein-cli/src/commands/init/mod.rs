//! `skein init [DIR]`: a starting project that `skein agents check` passes and `skein run`
//! runs offline, with the way to a real model written into it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct InitArgs {
    /// Where to write the project (created if missing; default: the current directory).
    #[arg(default_value = ".")]
    pub dir: PathBuf,
}

/// The files of a new project, relative to its directory.
const FILES: &[(&str, &str)] = &[
    ("config/skein.toml", include_str!("skein.toml")),
    ("config/agents/assistant.md", include_str!("assistant.md")),
    (
        "config/scripts/assistant.yaml",
        include_str!("assistant.yaml"),
    ),
    ("README.md", include_str!("README.md")),
    (".gitignore", "/.skein\n"),
];

/// Writes the starting project into `dir`; refuses, writing nothing, when any of its files
/// exists already.
pub fn write_project(dir: &Path) -> Result<Vec<PathBuf>> {
    let taken: Vec<String> = FILES
        .iter()
        .map(|(rel, _)| dir.join(rel))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    anyhow::ensure!(
        taken.is_empty(),
        "{} already holds {}; nothing was written (choose an empty directory: `skein init DIR`)",
        dir.display(),
        taken.join(", ")
    );
    let mut written = vec![];
    for (rel, text) in FILES {
        let p = dir.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?;
        written.push(p);
    }
    Ok(written)
}

pub fn init(a: InitArgs) -> Result<ExitCode> {
    let written = write_project(&a.dir)?;
    for p in &written {
        crate::outln!("wrote {}", p.display())?;
    }
    let cd = if a.dir == Path::new(".") {
        String::new()
    } else {
        format!("cd {} && ", a.dir.display())
    };
    crate::outln!(
        "\nNext:\n  {cd}skein agents check && skein run \"Summarise the workspace\"\n\n\
         The agent `assistant` answers from a script (config/scripts/assistant.yaml), offline.\n\
         For a real model: export OPENAI_API_KEY and set `model: openai:gpt-4o-mini` in\n\
         config/agents/assistant.md (or ANTHROPIC_API_KEY and `anthropic:MODEL`; a local\n\
         OpenAI-compatible server goes under [models.providers.local] in config/skein.toml),\n\
         or try one run with `skein run --model openai:gpt-4o-mini \"…\"`."
    )?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_project_passes_its_own_checks_and_is_never_written_over() {
        let dir = tempfile::tempdir().unwrap();
        let written = write_project(dir.path()).unwrap();
        assert_eq!(written.len(), FILES.len());
        let cfg = crate::config::load(Some(&dir.path().join("config/skein.toml"))).unwrap();
        let files = crate::app::read_agent_files(&cfg.agents_dir).unwrap();
        let set = skein_core::AgentSet::load(&files, &[]).unwrap();
        assert_eq!(set.agents.keys().collect::<Vec<_>>(), ["assistant"]);
        skein_llm::scripted::ScriptedProvider::new(&cfg.scripts_dir)
            .load("assistant")
            .unwrap();

        std::fs::write(dir.path().join("README.md"), "mine").unwrap();
        std::fs::remove_file(dir.path().join("config/skein.toml")).unwrap();
        let e = write_project(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("README.md") && e.contains("nothing was written"),
            "{e}"
        );
        assert!(!dir.path().join("config/skein.toml").exists());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("README.md")).unwrap(),
            "mine"
        );
    }
}
