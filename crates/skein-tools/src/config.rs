//! Settings of the built-in tools: the `[tools]` table of `skein.toml`. Every field has a
//! default, so an empty table (or none) gives the safe configuration: files capped,
//! `http_fetch` on but refusing private addresses, `shell` off.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `[tools]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {
    pub files: FilesConfig,
    pub search: SearchConfig,
    pub http: HttpConfig,
    pub shell: ShellConfig,
}

/// `[tools.files]`: `read_file`, `write_file`, `list_dir`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilesConfig {
    /// Bytes `read_file` returns at most; a longer file is cut with a note.
    pub max_read_bytes: usize,
    /// Bytes `write_file` accepts at most; a longer content is refused.
    pub max_write_bytes: usize,
    /// Entries `list_dir` shows at most.
    pub max_list_entries: usize,
    /// Bytes all files of one tree's workspace may hold together; a `write_file` that
    /// would take the tree past it is refused.
    pub max_workspace_bytes: u64,
}

impl Default for FilesConfig {
    fn default() -> Self {
        Self {
            max_read_bytes: 256 * 1024,
            max_write_bytes: 1024 * 1024,
            max_list_entries: 1000,
            max_workspace_bytes: 256 * 1024 * 1024,
        }
    }
}

/// `[tools.search]`: `search_files`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SearchConfig {
    /// Files one search looks at at most.
    pub max_files: usize,
    /// Matching lines one search returns at most (a call may ask for fewer).
    pub max_matches: usize,
    /// Bytes of each file that are searched; the rest is skipped.
    pub max_file_bytes: usize,
}

impl Default for SearchConfig {
    fn default() -> Self {
        Self {
            max_files: 2000,
            max_matches: 200,
            max_file_bytes: 1024 * 1024,
        }
    }
}

/// `[tools.http]`: `http_fetch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Offer `http_fetch` at all.
    pub enabled: bool,
    /// Time for the whole fetch, redirects included (`"30s"`, `"500ms"`, `"1m30s"`, or
    /// seconds).
    #[serde(with = "skein_core::duration::serde")]
    pub timeout: Duration,
    /// Body bytes kept at most; the rest is cut with a note.
    pub max_response_bytes: usize,
    /// Redirects followed at most; each target is checked again.
    pub max_redirects: usize,
    /// Host names (or IP literals) that may be fetched whatever they resolve to, cloud
    /// metadata addresses excepted. Exact match, case-insensitive.
    pub allow_hosts: Vec<String>,
    /// Address ranges that may be fetched although private (`"127.0.0.1/32"`,
    /// `"10.1.0.0/16"`, or a single address).
    pub allow_cidrs: Vec<Cidr>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            timeout: Duration::from_secs(30),
            max_response_bytes: 1024 * 1024,
            max_redirects: 5,
            allow_hosts: vec![],
            allow_cidrs: vec![],
        }
    }
}

/// `[tools.shell]`: `shell`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShellConfig {
    /// Offer `shell` at all. Off by default; every call still needs approval.
    pub enabled: bool,
    /// Time a command may run before its whole process group is killed.
    #[serde(with = "skein_core::duration::serde")]
    pub timeout: Duration,
    /// Bytes kept of stdout and of stderr, each.
    pub max_output_bytes: usize,
}

impl Default for ShellConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            timeout: Duration::from_secs(60),
            max_output_bytes: 64 * 1024,
        }
    }
}

/// An address range of `allow_cidrs`; a bare address means just that address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr(pub IpNet);

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&ip)
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Ok(net) = s.parse::<IpNet>() {
            return Ok(Self(net.trunc()));
        }
        s.parse::<IpAddr>()
            .map(|ip| Self(IpNet::from(ip)))
            .map_err(|_| format!("`{s}` is neither an address range (a.b.c.d/n) nor an address"))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
