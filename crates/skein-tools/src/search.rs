//! `search_files`: a substring or regular expression over the text of the workspace's
//! files. Written against the [`Workspace`](crate::Workspace) trait only, so it searches a
//! local directory and the object store alike. Bounded three ways: files scanned, matches
//! returned, bytes read of each file.

use async_trait::async_trait;
use regex::{Regex, RegexBuilder};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::SearchConfig;
use crate::files::args;
use crate::text::decode_prefix;
use crate::{Tool, ToolContext, ToolError};
use skein_core::text::clip_with_ellipsis;

/// A matching line is shown up to this many bytes.
const LINE_BYTES: usize = 240;
/// A compiled pattern may take this much memory.
const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// `search_files`.
pub struct SearchFiles {
    cfg: SearchConfig,
}

impl SearchFiles {
    pub fn new(cfg: SearchConfig) -> Self {
        Self { cfg }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SearchArgs {
    /// Text to find; a regular expression (Rust syntax) when `regex` is true.
    #[schemars(length(min = 1))]
    pub(crate) pattern: String,
    /// Treat `pattern` as a regular expression (default false).
    #[serde(default)]
    pub(crate) regex: bool,
    /// Directory to search under (default: the whole workspace).
    #[serde(default)]
    pub(crate) path: String,
    /// Default true.
    #[serde(default = "yes")]
    pub(crate) case_sensitive: bool,
    /// Stop after this many matching lines.
    #[serde(default)]
    #[schemars(range(min = 1))]
    pub(crate) max_matches: Option<usize>,
}

fn yes() -> bool {
    true
}

fn matcher(a: &SearchArgs) -> Result<Regex, ToolError> {
    let source = if a.regex {
        a.pattern.clone()
    } else {
        regex::escape(&a.pattern)
    };
    RegexBuilder::new(&source)
        .case_insensitive(!a.case_sensitive)
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map_err(|e| ToolError::InvalidArgs(format!("`pattern` is not a valid regex: {e}")))
}

#[async_trait]
impl Tool for SearchFiles {
    fn name(&self) -> &str {
        "search_files"
    }
    fn description(&self) -> &str {
        "Search the text of the workspace's files for a substring (or a regular expression \
         with `regex: true`). Prints matching lines as `path:line: text`."
    }
    fn parameters(&self) -> Value {
        let mut schema = crate::schema::derived::<SearchArgs>();
        // The cap is configured, so it is added here rather than declared on the struct.
        schema["properties"]["max_matches"]["maximum"] = json!(self.cfg.max_matches.max(1));
        schema
    }
    fn idempotent(&self) -> bool {
        true
    }
    async fn call(&self, ctx: &ToolContext, a: Value) -> Result<String, ToolError> {
        let a: SearchArgs = args(a)?;
        let re = matcher(&a)?;
        let limit = a
            .max_matches
            .unwrap_or(self.cfg.max_matches)
            .min(self.cfg.max_matches);
        let walk = ctx.workspace.walk(&a.path, self.cfg.max_files).await?;
        let mut lines = vec![];
        let (mut scanned, mut cut_files, mut stopped) = (0usize, 0usize, false);
        'files: for f in &walk.files {
            let Ok(part) = ctx
                .workspace
                .read_part(&f.name, 0, self.cfg.max_file_bytes)
                .await
            else {
                continue;
            };
            scanned += 1;
            if part.data.contains(&0) {
                continue; // binary
            }
            if (part.data.len() as u64) < part.size {
                cut_files += 1;
            }
            let (text, _) = decode_prefix(&part.data);
            for (i, line) in text.lines().enumerate() {
                if re.is_match(line) {
                    if lines.len() >= limit {
                        stopped = true;
                        break 'files;
                    }
                    lines.push(format!(
                        "{}:{}: {}",
                        f.name,
                        i + 1,
                        clip_with_ellipsis(line, LINE_BYTES)
                    ));
                }
            }
        }
        if lines.is_empty() {
            lines.push(format!("no matches ({scanned} files searched)"));
        }
        if stopped {
            lines.push(format!(
                "… [stopped at {limit} matches; narrow the pattern or the path]"
            ));
        }
        if walk.truncated {
            lines.push(format!(
                "… [only the first {} files were searched]",
                self.cfg.max_files
            ));
        }
        if cut_files > 0 {
            lines.push(format!(
                "… [only the first {} bytes of {cut_files} large file(s) were searched]",
                self.cfg.max_file_bytes
            ));
        }
        Ok(lines.join("\n"))
    }
}
