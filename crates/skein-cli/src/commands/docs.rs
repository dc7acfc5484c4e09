//! `skein completions SHELL` and `skein man`: shell completions and manual pages, generated
//! from the same definition of the command line that parses it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory};
use clap_complete::Shell;

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    pub shell: Shell,
}

#[derive(Args, Debug)]
pub struct ManArgs {
    /// Write `skein.1` and one page per subcommand (`skein-run.1`, …) into this directory
    /// instead of printing `skein.1`.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

pub fn completions(a: CompletionsArgs) -> Result<ExitCode> {
    let mut cmd = crate::Cli::command();
    let mut buf = Vec::new();
    clap_complete::generate(a.shell, &mut cmd, "skein", &mut buf);
    crate::out!("{}", String::from_utf8_lossy(&buf))?;
    Ok(ExitCode::SUCCESS)
}

pub fn man(a: ManArgs) -> Result<ExitCode> {
    let mut cmd = crate::Cli::command();
    cmd.build();
    match a.dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            clap_mangen::generate_to(cmd, &dir)
                .with_context(|| format!("cannot write the pages into {}", dir.display()))?;
            crate::outln!("wrote the manual pages into {}", dir.display())?;
        }
        None => {
            let mut buf = Vec::new();
            clap_mangen::Man::new(cmd).render(&mut buf)?;
            crate::out!("{}", String::from_utf8_lossy(&buf))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_and_pages_cover_the_deferred_arguments() {
        let mut cmd = crate::Cli::command();
        let mut buf = Vec::new();
        clap_complete::generate(Shell::Bash, &mut cmd, "skein", &mut buf);
        let bash = String::from_utf8(buf).unwrap();
        // `--no-cache` belongs to `run`, whose arguments are added only when built.
        assert!(
            bash.contains("--no-cache") && bash.contains("completions"),
            "bash"
        );

        let dir = tempfile::tempdir().unwrap();
        let mut cmd = crate::Cli::command();
        cmd.build();
        clap_mangen::generate_to(cmd, dir.path()).unwrap();
        let run = std::fs::read_to_string(dir.path().join("skein-run.1")).unwrap();
        assert!(run.contains("no\\-cache"), "{run}");
    }
}
