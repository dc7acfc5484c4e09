//! The address guard of `http_fetch`: which destinations a model may reach. Host names are
//! resolved here, every address is checked, and only checked addresses are connected to,
//! so DNS cannot hand the client a different answer after the check.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use iprfc::{
    Ipv6Net, RFC1122, RFC2765, RFC3056, RFC4038, RFC4291, RFC4380, RFC6052, RFC6666, RFC6890,
};
use reqwest::Url;

use crate::config::{Cidr, HttpConfig};

const METADATA: &str = "a cloud metadata address";

/// Cloud metadata services: AWS, GCP, Azure, OpenStack, … (`169.254.169.254`), Alibaba
/// Cloud (`100.100.100.200`, inside the CGNAT range) and AWS over IPv6 (`fd00:ec2::254`).
/// Not a registry matter: each address also sits in a range refused anyway, but only an
/// `allow_cidrs` entry naming it opens it (see [`Guard::check_ip`]).
const METADATA_V4: [Ipv4Addr; 2] = [
    Ipv4Addr::new(169, 254, 169, 254),
    Ipv4Addr::new(100, 100, 100, 200),
];
const METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254);

/// The local-use NAT64 prefix of RFC 8215, a row of the IANA IPv6 special-purpose
/// registry (checked against it in the tests); a site places the IPv4 address at any of
/// the RFC 6052 prefix lengths inside it.
const LOCAL_NAT64: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0), 48);

/// Why `ip` is not a public address, or `None` when it is one.
///
/// The ranges are those of the IANA IPv4 and IPv6 special-purpose address registries
/// (`iprfc`'s snapshot of them), plus multicast and the deprecated site-local block.
/// An IPv6 address that carries an IPv4 address (mapped, translated, compatible, NAT64,
/// 6to4, Teredo) is judged by the IPv4 address it carries, since that is where the
/// packets end up.
pub fn blocked_reason(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_reason(v4),
        IpAddr::V6(v6) => v6_reason(v6),
    }
}

/// A test for a class of addresses, and the reason given for refusing it.
type Class<A> = (fn(A) -> bool, &'static str);

fn v4_reason(ip: Ipv4Addr) -> Option<&'static str> {
    if METADATA_V4.contains(&ip) {
        return Some(METADATA);
    }
    let classes: [Class<Ipv4Addr>; 10] = [
        (iprfc::is_loopback_ipv4_addr, "a loopback address"),
        (iprfc::is_private_ipv4_addr, "a private address (RFC 1918)"),
        (
            iprfc::is_shared_ipv4_addr,
            "a shared CGNAT address (100.64.0.0/10)",
        ),
        (
            iprfc::is_link_local_ipv4_addr,
            "a link-local address (169.254.0.0/16)",
        ),
        (iprfc::is_documentation_ipv4_addr, "a documentation address"),
        (
            iprfc::is_benchmark_ipv4_addr,
            "a benchmarking address (198.18.0.0/15)",
        ),
        (iprfc::is_multicast_ipv4_addr, "a multicast address"),
        (iprfc::is_broadcast_ipv4_addr, "the broadcast address"),
        // RFC 1122's other block, loopback being caught above.
        (
            |ip| RFC1122.contains(&ip),
            "an unspecified address (0.0.0.0/8)",
        ),
        (
            |ip| RFC6890.contains(&ip),
            "a special-purpose address (IANA IPv4 registry)",
        ),
    ];
    classes
        .iter()
        .find(|(is, _)| is(ip))
        .map(|(_, reason)| *reason)
}

fn v4_at(b: &[u8; 16], at: [usize; 4]) -> Ipv4Addr {
    Ipv4Addr::new(b[at[0]], b[at[1]], b[at[2]], b[at[3]])
}

/// The IPv4 addresses an IPv6 address carries, with the name of the form, and whether
/// the form is refused whatever it carries (Teredo and local-use NAT64 are not globally
/// reachable). Empty for an address that carries none.
pub fn embedded_ipv4(ip: Ipv6Addr) -> (Vec<(&'static str, Ipv4Addr)>, bool) {
    let b = ip.octets();
    let low = v4_at(&b, [12, 13, 14, 15]);
    if RFC4038.contains(&ip) {
        return (vec![("IPv4-mapped", low)], false);
    }
    if RFC2765.contains(&ip) {
        return (vec![("IPv4-translated", low)], false);
    }
    if RFC4291
        .ipv6_nets()
        .iter()
        .any(|n| n.prefix_len() == 96 && n.contains(&ip))
    {
        return (vec![("IPv4-compatible", low)], false);
    }
    if RFC6052.contains(&ip) {
        return (vec![("NAT64", low)], false);
    }
    if LOCAL_NAT64.contains(&ip) {
        // RFC 6052 §2.2: the IPv4 bits follow a /48, /56, /64 or /96 prefix, skipping
        // bits 64..72.
        // A reading that starts with 0 is the zero padding of another placement.
        let at = [
            [6, 7, 9, 10],
            [7, 9, 10, 11],
            [9, 10, 11, 12],
            [12, 13, 14, 15],
        ];
        let all = at
            .iter()
            .map(|a| ("local-use NAT64", v4_at(&b, *a)))
            .filter(|(_, v4)| v4.octets()[0] != 0);
        return (all.collect(), true);
    }
    if RFC3056.contains(&ip) {
        return (vec![("6to4", v4_at(&b, [2, 3, 4, 5]))], false);
    }
    if RFC4380.contains(&ip) {
        // RFC 4380 §4: the server's address, then the client's with every bit flipped.
        let client = Ipv4Addr::from(!u32::from(low));
        return (
            vec![
                ("Teredo server", v4_at(&b, [4, 5, 6, 7])),
                ("Teredo client", client),
            ],
            true,
        );
    }
    (vec![], false)
}

/// The carried IPv4 address that is refused, with its form and why: a metadata address
/// first (only an entry naming it may open it), else the first refused one.
fn carried_reason(
    carried: &[(&'static str, Ipv4Addr)],
) -> Option<(&'static str, Ipv4Addr, &'static str)> {
    let refused = carried
        .iter()
        .filter_map(|&(form, v4)| v4_reason(v4).map(|r| (form, v4, r)));
    let mut first = None;
    for hit in refused {
        if hit.2 == METADATA {
            return Some(hit);
        }
        first = first.or(Some(hit));
    }
    first
}

fn v6_reason(ip: Ipv6Addr) -> Option<&'static str> {
    if ip == METADATA_V6 {
        return Some(METADATA);
    }
    if ip.is_unspecified() {
        return Some("an unspecified address (::)");
    }
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    let (carried, refused_anyway) = embedded_ipv4(ip);
    if let Some((_, _, reason)) = carried_reason(&carried) {
        return Some(reason);
    }
    if !carried.is_empty() && !refused_anyway {
        return None;
    }
    let classes: [Class<Ipv6Addr>; 8] = [
        (
            iprfc::is_unique_local_ipv6_addr,
            "a private unique-local address (fc00::/7)",
        ),
        (
            iprfc::is_link_local_ipv6_addr,
            "a link-local address (fe80::/10)",
        ),
        (iprfc::is_multicast_ipv6_addr, "a multicast address"),
        (iprfc::is_documentation_ipv6_addr, "a documentation address"),
        (
            |ip| RFC6666.contains(&ip),
            "a discard-only address (100::/64)",
        ),
        (
            |ip| RFC4380.contains(&ip),
            "a Teredo tunnel address (2001::/32)",
        ),
        (
            |ip| LOCAL_NAT64.contains(&ip),
            "a local-use NAT64 address (64:ff9b:1::/48)",
        ),
        (
            |ip| RFC4291.contains(&ip),
            "a reserved address (RFC 4291: site-local fec0::/10)",
        ),
    ];
    if let Some((_, reason)) = classes.iter().find(|(is, _)| is(ip)) {
        return Some(reason);
    }
    RFC6890
        .contains(&ip)
        .then_some("a special-purpose address (IANA IPv6 registry)")
}

/// The IPv4 addresses an IPv6 address stands for, where it is judged by them alone (not
/// Teredo or local-use NAT64): an allowlist entry for the IPv4 address covers it too.
fn carried_ipv4(ip: IpAddr) -> Vec<IpAddr> {
    match ip {
        IpAddr::V6(v6) => match embedded_ipv4(v6) {
            (carried, false) => carried.into_iter().map(|(_, v4)| IpAddr::V4(v4)).collect(),
            (_, true) => vec![],
        },
        IpAddr::V4(_) => vec![],
    }
}

/// `ip` as an error message shows it: an IPv6 address with the IPv4 address it carries.
fn shown(ip: IpAddr) -> String {
    let IpAddr::V6(v6) = ip else {
        return ip.to_string();
    };
    match carried_reason(&embedded_ipv4(v6).0) {
        Some((form, v4, _)) => format!("{ip} (the {form} form of {v4})"),
        None => ip.to_string(),
    }
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
        let carried = carried_ipv4(ip);
        self.allow_cidrs
            .iter()
            .any(|c| c.contains(ip) || carried.iter().any(|m| c.contains(*m)))
    }

    /// Whether an `allow_cidrs` entry is exactly `ip` (a bare address, or `/32`, `/128`).
    fn cidr_names(&self, ip: IpAddr) -> bool {
        let carried = carried_ipv4(ip);
        self.allow_cidrs.iter().any(|c| {
            c.0.prefix_len() == c.0.max_prefix_len()
                && (c.0.addr() == ip || carried.contains(&c.0.addr()))
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
                    format!("{} is {reason}", shown(a.ip()))
                } else {
                    format!("`{host}` resolves to {}, {reason}", shown(a.ip()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_nat64_prefix_is_the_registry_row() {
        assert!(RFC6890.ipv6_nets().contains(&LOCAL_NAT64));
    }
}
