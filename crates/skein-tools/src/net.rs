//! The address guard of `http_fetch`: which destinations a model may reach. Host names are
//! resolved here, every address is checked, and only checked addresses are connected to,
//! so DNS cannot hand the client a different answer after the check.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use reqwest::Url;

use crate::config::{Cidr, HttpConfig};

const METADATA: &str = "a cloud metadata address";

/// Why `ip` is not a public address, or `None` when it is one.
pub fn blocked_reason(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_reason(v4),
        IpAddr::V6(v6) => v6_reason(v6),
    }
}

fn v4_reason(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, d] = ip.octets();
    Some(match (a, b, c, d) {
        // AWS, GCP, Azure, OpenStack, …; Alibaba Cloud's sits inside the CGNAT range.
        (169, 254, 169, 254) | (100, 100, 100, 200) => METADATA,
        (0, ..) => "an unspecified address (0.0.0.0/8)",
        (127, ..) => "a loopback address",
        (10, ..) => "a private address (10.0.0.0/8)",
        (172, 16..=31, ..) => "a private address (172.16.0.0/12)",
        (192, 168, ..) => "a private address (192.168.0.0/16)",
        (100, 64..=127, ..) => "a shared CGNAT address (100.64.0.0/10)",
        (169, 254, ..) => "a link-local address (169.254.0.0/16)",
        (192, 0, 0, _) => "an IETF protocol address (192.0.0.0/24)",
        (192, 0, 2, _) | (198, 51, 100, _) | (203, 0, 113, _) => "a documentation address",
        (198, 18..=19, ..) => "a benchmarking address (198.18.0.0/15)",
        (255, 255, 255, 255) => "the broadcast address",
        (224..=239, ..) => "a multicast address",
        (240..=255, ..) => "a reserved address (240.0.0.0/4)",
        _ => return None,
    })
}

fn embedded_v4(s: &[u16; 8], hi: usize) -> Ipv4Addr {
    let [a, b] = s[hi].to_be_bytes();
    let [c, d] = s[hi + 1].to_be_bytes();
    Ipv4Addr::new(a, b, c, d)
}

fn v6_reason(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if s == [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254] {
        return Some(METADATA);
    }
    if ip.is_unspecified() {
        return Some("an unspecified address (::)");
    }
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    // IPv4 inside IPv6: mapped (::ffff:a.b.c.d), compatible (::a.b.c.d), NAT64, 6to4.
    if s[..5] == [0; 5] && (s[5] == 0xffff || s[5] == 0) {
        return v4_reason(embedded_v4(&s, 6));
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return v4_reason(embedded_v4(&s, 6));
    }
    if s[0] == 0x2002 {
        return v4_reason(embedded_v4(&s, 1));
    }
    Some(match s[0] {
        0x64 if s[1] == 0xff9b && s[2] == 1 => "a local NAT64 address (64:ff9b:1::/48)",
        0x2001 if s[1] == 0 => "a Teredo tunnel address (2001::/32)",
        0x2001 if s[1] == 0xdb8 => "a documentation address (2001:db8::/32)",
        0x100 if s[1..4] == [0, 0, 0] => "a discard-only address (100::/64)",
        x if x & 0xfe00 == 0xfc00 => "a private unique-local address (fc00::/7)",
        x if x & 0xffc0 == 0xfe80 => "a link-local address (fe80::/10)",
        x if x & 0xffc0 == 0xfec0 => "a site-local address (fec0::/10)",
        x if x & 0xff00 == 0xff00 => "a multicast address",
        _ => return None,
    })
}

/// The rules of `tools.http`: the public internet, plus what the allowlists open.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    allow_hosts: Vec<String>,
    allow_cidrs: Vec<Cidr>,
}

fn bare_host(h: &str) -> String {
    h.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

impl Guard {
    pub fn new(cfg: &HttpConfig) -> Self {
        Self {
            allow_hosts: cfg.allow_hosts.iter().map(|h| bare_host(h)).collect(),
            allow_cidrs: cfg.allow_cidrs.clone(),
        }
    }

    fn host_allowed(&self, host: &str) -> bool {
        let host = bare_host(host);
        self.allow_hosts.contains(&host)
    }

    fn cidr_allowed(&self, ip: IpAddr) -> bool {
        let mapped = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4),
            IpAddr::V4(_) => None,
        };
        self.allow_cidrs
            .iter()
            .any(|c| c.contains(ip) || mapped.is_some_and(|m| c.contains(m)))
    }

    /// Whether an `allow_cidrs` entry is exactly `ip` (a bare address, or `/32`, `/128`).
    fn cidr_names(&self, ip: IpAddr) -> bool {
        let mapped = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4),
            IpAddr::V4(_) => None,
        };
        self.allow_cidrs.iter().any(|c| {
            c.0.prefix_len() == c.0.max_prefix_len()
                && (c.0.addr() == ip || mapped.is_some_and(|m| c.0.addr() == m))
        })
    }

    /// Whether `ip`, reached under the name `host`, may be connected to; the reason when not.
    pub fn check_ip(&self, host: &str, ip: IpAddr) -> Result<(), &'static str> {
        let Some(reason) = blocked_reason(ip) else {
            return Ok(());
        };
        // The metadata service is opened only by an `allow_cidrs` entry naming its address:
        // not by a host name, and not by a wider range that happens to hold it (allowing
        // 100.64.0.0/10 or 169.254.0.0/16 must not hand out cloud credentials).
        if reason == METADATA {
            return if self.cidr_names(ip) {
                Ok(())
            } else {
                Err(reason)
            };
        }
        if self.cidr_allowed(ip) || self.host_allowed(host) {
            return Ok(());
        }
        Err(reason)
    }

    /// Resolves the URL's host and checks every address it has. The addresses returned
    /// are the ones to connect to; the message of an error says what was refused and why.
    pub async fn resolve(&self, url: &Url) -> Result<Vec<SocketAddr>, GuardError> {
        let host = url
            .host_str()
            .ok_or_else(|| GuardError::Invalid(format!("`{url}` has no host")))?;
        let port = url
            .port_or_known_default()
            .ok_or_else(|| GuardError::Invalid(format!("`{url}` has no port")))?;
        let literal = bare_host(host).parse::<IpAddr>().ok();
        let addrs: Vec<SocketAddr> = match literal {
            Some(ip) => vec![SocketAddr::new(ip, port)],
            None => tokio::net::lookup_host((host, port))
                .await
                .map_err(|e| GuardError::Unresolved(format!("cannot resolve `{host}`: {e}")))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(GuardError::Unresolved(format!("`{host}` has no addresses")));
        }
        for a in &addrs {
            if let Err(reason) = self.check_ip(host, a.ip()) {
                let what = if literal.is_some() {
                    format!("{} is {reason}", a.ip())
                } else {
                    format!("`{host}` resolves to {}, {reason}", a.ip())
                };
                return Err(GuardError::Refused(format!(
                    "{what}; private, loopback, link-local and metadata addresses are refused \
                     unless allowed in tools.http.allow_hosts or tools.http.allow_cidrs"
                )));
            }
        }
        Ok(addrs)
    }
}

/// Why the guard did not hand out addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuardError {
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Unresolved(String),
    #[error("{0}")]
    Invalid(String),
}
