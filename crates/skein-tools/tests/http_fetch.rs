//! `http_fetch` against real sockets: a tiny HTTP server on 127.0.0.1, the SSRF guard in
//! front of it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::{err, ok, Sandbox};
use serde_json::{json, Value};
use skein_tools::net::{blocked_reason, Guard};
use skein_tools::{HttpConfig, ToolBox, ToolError, ToolsConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

async fn read_request(sock: &mut TcpStream) -> Option<Request> {
    let mut buf = vec![];
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, path) = (first.next()?.to_string(), first.next()?.to_string());
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(Request {
        method,
        path,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn response(status: &str, extra: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
        body.len()
    )
}

fn route(r: &Request, port: u16) -> String {
    let header = |name: &str| {
        r.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    match r.path.as_str() {
        "/hello" => response("200 OK", "", "hello from test"),
        "/echo" => response(
            "200 OK",
            "",
            &format!(
                "method={} body={} x-test={}",
                r.method,
                r.body,
                header("x-test")
            ),
        ),
        "/big" => response("200 OK", "", &"a".repeat(5000)),
        "/to-hello" => response("302 Found", "location: /hello\r\n", ""),
        "/to-private" => response("302 Found", "location: http://10.0.0.1/\r\n", ""),
        "/to-metadata" => response(
            "301 Moved Permanently",
            "location: http://169.254.169.254/latest/meta-data/\r\n",
            "",
        ),
        "/to-localhost" => response(
            "302 Found",
            &format!("location: http://localhost:{port}/hello\r\n"),
            "",
        ),
        "/see-other" => response("303 See Other", "location: /echo\r\n", ""),
        "/loop" => response("302 Found", "location: /loop\r\n", ""),
        _ => response("404 Not Found", "", "no such page"),
    }
}

/// Serves [`route`] on 127.0.0.1 until the test ends.
async fn server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                if let Some(req) = read_request(&mut sock).await {
                    let _ = sock.write_all(route(&req, addr.port()).as_bytes()).await;
                    let _ = sock.shutdown().await;
                }
            });
        }
    });
    addr
}

fn tools(http: HttpConfig) -> ToolBox {
    ToolBox::builtin(&ToolsConfig {
        http,
        ..ToolsConfig::default()
    })
}

fn allow_loopback_cidr() -> ToolBox {
    tools(HttpConfig {
        allow_cidrs: vec!["127.0.0.1/32".parse().unwrap()],
        ..HttpConfig::default()
    })
}

fn refused(e: ToolError) -> String {
    match e {
        ToolError::Refused(m) => m,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn fetch_err(tb: &ToolBox, args: Value) -> ToolError {
    let s = Sandbox::new();
    err(tb, &s.ctx, "http_fetch", args).await
}

async fn fetch_ok(tb: &ToolBox, args: Value) -> String {
    let s = Sandbox::new();
    ok(tb, &s.ctx, "http_fetch", args).await
}

#[tokio::test]
async fn loopback_is_refused_before_any_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let m = refused(
        fetch_err(
            &tools(HttpConfig::default()),
            json!({"url": format!("http://127.0.0.1:{port}/")}),
        )
        .await,
    );
    assert!(m.contains("127.0.0.1 is a loopback address"), "{m}");
    assert!(m.contains("tools.http.allow_cidrs"), "{m}");
    // Nothing ever knocked.
    let knocked = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(knocked.is_err(), "the refused fetch connected anyway");
}

#[tokio::test]
async fn private_link_local_and_metadata_addresses_are_refused() {
    let tb = tools(HttpConfig::default());
    for (url, why) in [
        ("http://10.0.0.1/", "10.0.0.1 is a private address"),
        ("http://172.16.5.4/", "a private address (RFC 1918)"),
        ("http://192.168.1.1/", "a private address (RFC 1918)"),
        ("http://100.64.0.1/", "CGNAT"),
        (
            "http://169.254.169.254/latest/meta-data/",
            "169.254.169.254 is a cloud metadata address",
        ),
        (
            "http://100.100.100.200/latest/meta-data/",
            "100.100.100.200 is a cloud metadata address",
        ),
        ("http://169.254.1.1/", "link-local"),
        ("http://0.0.0.0:8080/", "unspecified"),
        ("http://224.0.0.1/", "multicast"),
        ("http://255.255.255.255/", "broadcast"),
        ("http://[::1]/", "loopback"),
        ("http://[fe80::1]/", "link-local"),
        ("http://[fc00::1]/", "unique-local"),
        ("http://[fd00:ec2::254]/", "cloud metadata"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://[::ffff:10.1.2.3]/", "private"),
        // 2130706433 is 127.0.0.1 written as one number; the URL parser normalises it.
        ("http://2130706433/", "127.0.0.1 is a loopback address"),
        ("http://0x7f.1/", "loopback"),
    ] {
        let m = refused(fetch_err(&tb, json!({"url": url})).await);
        assert!(m.contains(why), "{url}: {m}");
    }
}

#[tokio::test]
async fn an_ipv6_spelling_of_loopback_is_refused_before_any_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let tb = tools(HttpConfig::default());
    for host in [
        "::ffff:0:7f00:1",
        "::ffff:127.0.0.1",
        "::127.0.0.1",
        "64:ff9b::7f00:1",
        "64:ff9b:1::7f00:1",
        "2002:7f00:1::",
        "2001:0:7f00:1::",
    ] {
        let url = format!("http://[{host}]:{port}/");
        let m = refused(fetch_err(&tb, json!({ "url": url })).await);
        assert!(
            m.contains("127.0.0.1") && m.contains("a loopback address"),
            "{host}: {m}"
        );
    }
    let knocked = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(knocked.is_err(), "a refused fetch connected anyway");
}

#[test]
fn ipv6_forms_carrying_ipv4_are_judged_by_the_ipv4_address() {
    let blocked = |s: &str| blocked_reason(s.parse::<IpAddr>().unwrap());
    for (ip, word) in [
        // ::ffff:0:0:0/96, IPv4-translated (SIIT).
        ("::ffff:0:7f00:1", "loopback"),
        ("::ffff:0:c0a8:101", "private"),
        ("::ffff:0:a9fe:a9fe", "metadata"),
        // ::ffff:0:0/96, IPv4-mapped.
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:172.16.0.1", "private"),
        ("::ffff:169.254.169.254", "metadata"),
        // ::/96, IPv4-compatible.
        ("::127.0.0.1", "loopback"),
        ("::10.0.0.1", "private"),
        ("::169.254.169.254", "metadata"),
        // 64:ff9b::/96, NAT64.
        ("64:ff9b::127.0.0.1", "loopback"),
        ("64:ff9b::192.168.0.1", "private"),
        ("64:ff9b::169.254.169.254", "metadata"),
        // 64:ff9b:1::/48, local-use NAT64: the address after a /96 …
        ("64:ff9b:1::7f00:1", "loopback"),
        ("64:ff9b:1::a00:1", "private"),
        ("64:ff9b:1::a9fe:a9fe", "metadata"),
        // … and after a /48, /56 and /64 (RFC 6052 skips bits 64..72).
        ("64:ff9b:1:7f00:0:100::", "loopback"),
        ("64:ff9b:1:a9:fe:a9fe::", "metadata"),
        ("64:ff9b:1:0:c0:a801:100:0", "private"),
        // 2002::/16, 6to4.
        ("2002:7f00:1::1", "loopback"),
        ("2002:a00:1::", "private"),
        ("2002:a9fe:a9fe::1", "metadata"),
        // 2001::/32, Teredo: the server's address, and the client's with its bits flipped.
        ("2001:0:7f00:1::1", "loopback"),
        ("2001:0:808:808::f5ff:fffe", "private"),
        ("2001:0:808:808::5601:5601", "metadata"),
        ("2001:0:a9fe:a9fe::", "metadata"),
    ] {
        let r = blocked(ip).unwrap_or_else(|| panic!("{ip} passed"));
        assert!(r.contains(word), "{ip}: {r}");
    }
    // Public addresses in the translating forms stay public …
    for public in [
        "::ffff:8.8.8.8",
        "::ffff:0:808:808",
        "64:ff9b::1.1.1.1",
        "2002:808:808::1",
    ] {
        assert_eq!(blocked(public), None, "{public}");
    }
    // … but Teredo and local-use NAT64 are not globally reachable whatever they carry.
    assert!(blocked("2001:0:808:808::f7f7:f7f7").is_some_and(|r| r.contains("Teredo")));
    assert!(blocked("64:ff9b:1::808:808").is_some_and(|r| r.contains("NAT64")));
}

#[test]
fn an_allowlisted_ipv4_address_covers_its_ipv6_spellings() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let g = Guard::new(&HttpConfig {
        allow_cidrs: vec![
            "127.0.0.1/32".parse().unwrap(),
            "169.254.169.254".parse().unwrap(),
        ],
        ..HttpConfig::default()
    });
    for spelling in ["::ffff:0:7f00:1", "64:ff9b::7f00:1", "2002:a9fe:a9fe::"] {
        assert_eq!(g.check_ip("x", ip(spelling)), Ok(()), "{spelling}");
    }
    // Not through a tunnel that is refused in itself.
    assert!(g.check_ip("x", ip("2001:0:7f00:1::")).is_err());
    // A wide range never opens a metadata address, in any spelling.
    let wide = Guard::new(&HttpConfig {
        allow_cidrs: vec!["169.254.0.0/16".parse().unwrap(), "::/0".parse().unwrap()],
        ..HttpConfig::default()
    });
    for spelling in [
        "::ffff:0:a9fe:a9fe",
        "64:ff9b::a9fe:a9fe",
        "2002:a9fe:a9fe::1",
    ] {
        let e = wide.check_ip("x", ip(spelling)).unwrap_err();
        assert!(e.contains("metadata"), "{spelling}: {e}");
    }
}

#[tokio::test]
async fn a_name_resolving_to_loopback_is_refused() {
    let m = refused(
        fetch_err(
            &tools(HttpConfig::default()),
            json!({"url": "http://localhost:9/"}),
        )
        .await,
    );
    assert!(m.contains("`localhost` resolves to"), "{m}");
    assert!(m.contains("a loopback address"), "{m}");
}

#[tokio::test]
async fn an_allowlisted_server_is_fetched() {
    let addr = server().await;
    let out = fetch_ok(
        &allow_loopback_cidr(),
        json!({"url": format!("http://{addr}/hello")}),
    )
    .await;
    assert_eq!(
        out,
        "HTTP 200 OK\ncontent-type: text/plain\ncontent-length: 15\n\nhello from test"
    );
    // By host name in allow_hosts instead of a range.
    let by_host = tools(HttpConfig {
        allow_hosts: vec!["127.0.0.1".into()],
        ..HttpConfig::default()
    });
    let out = fetch_ok(&by_host, json!({"url": format!("http://{addr}/hello")})).await;
    assert!(out.ends_with("hello from test"), "{out}");
    let by_name = tools(HttpConfig {
        allow_hosts: vec!["LocalHost".into()],
        ..HttpConfig::default()
    });
    let out = fetch_ok(
        &by_name,
        json!({"url": format!("http://localhost:{}/hello", addr.port())}),
    )
    .await;
    assert!(out.ends_with("hello from test"), "{out}");
    // A status that is not 2xx is still a result, not a tool error.
    let out = fetch_ok(
        &allow_loopback_cidr(),
        json!({"url": format!("http://{addr}/nope")}),
    )
    .await;
    assert!(out.starts_with("HTTP 404 Not Found\n"), "{out}");
}

#[tokio::test]
async fn a_redirect_to_a_private_address_is_refused() {
    let addr = server().await;
    let m = refused(
        fetch_err(
            &allow_loopback_cidr(),
            json!({"url": format!("http://{addr}/to-private")}),
        )
        .await,
    );
    assert!(
        m.starts_with("redirect to `http://10.0.0.1/` refused: 10.0.0.1 is a private address"),
        "{m}"
    );
}

#[tokio::test]
async fn a_redirect_to_metadata_is_refused_even_for_an_allowed_host() {
    let addr = server().await;
    let tb = tools(HttpConfig {
        allow_cidrs: vec!["127.0.0.1/32".parse().unwrap()],
        allow_hosts: vec!["169.254.169.254".into()],
        ..HttpConfig::default()
    });
    let m = refused(fetch_err(&tb, json!({"url": format!("http://{addr}/to-metadata")})).await);
    assert!(m.contains("cloud metadata address"), "{m}");
}

#[tokio::test]
async fn each_redirect_is_resolved_and_checked_again() {
    let addr = server().await;
    // 127.0.0.1 is allowed by name; `localhost` is another name and is checked afresh.
    let tb = tools(HttpConfig {
        allow_hosts: vec!["127.0.0.1".into()],
        ..HttpConfig::default()
    });
    let m = refused(fetch_err(&tb, json!({"url": format!("http://{addr}/to-localhost")})).await);
    assert!(m.starts_with("redirect to `http://localhost:"), "{m}");
    assert!(m.contains("`localhost` resolves to"), "{m}");
}

#[tokio::test]
async fn allowed_redirects_are_followed_up_to_the_limit() {
    let addr = server().await;
    let out = fetch_ok(
        &allow_loopback_cidr(),
        json!({"url": format!("http://{addr}/to-hello")}),
    )
    .await;
    assert!(
        out.starts_with(&format!("HTTP 200 OK\nurl: http://{addr}/hello\n")),
        "{out}"
    );
    assert!(out.ends_with("hello from test"));
    let e = fetch_err(
        &allow_loopback_cidr(),
        json!({"url": format!("http://{addr}/loop")}),
    )
    .await;
    assert!(
        matches!(&e, ToolError::Failed(m) if m.contains("more than 5 redirects")),
        "{e:?}"
    );
}

#[tokio::test]
async fn post_sends_body_and_headers_and_303_turns_into_get() {
    let addr = server().await;
    let tb = allow_loopback_cidr();
    let out = fetch_ok(
        &tb,
        json!({"url": format!("http://{addr}/echo"), "method": "POST", "body": "ping", "headers": {"X-Test": "yes"}}),
    )
    .await;
    assert!(out.ends_with("method=POST body=ping x-test=yes"), "{out}");
    let out = fetch_ok(
        &tb,
        json!({"url": format!("http://{addr}/see-other"), "method": "POST", "body": "ping"}),
    )
    .await;
    assert!(out.ends_with("method=GET body= x-test="), "{out}");
}

#[tokio::test]
async fn the_body_is_cut_at_the_cap() {
    let addr = server().await;
    let tb = tools(HttpConfig {
        allow_cidrs: vec!["127.0.0.1".parse().unwrap()],
        max_response_bytes: 100,
        ..HttpConfig::default()
    });
    let out = fetch_ok(&tb, json!({"url": format!("http://{addr}/big")})).await;
    let body = out.split("\n\n").nth(1).unwrap();
    assert!(body.starts_with(&"a".repeat(100)), "{out}");
    assert!(!body.starts_with(&"a".repeat(101)), "{out}");
    assert!(
        out.ends_with("… [truncated: the first 100 bytes of the body shown]"),
        "{out}"
    );
}

#[tokio::test]
async fn a_silent_server_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = vec![];
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock); // never answers
        }
    });
    let tb = tools(HttpConfig {
        allow_cidrs: vec!["127.0.0.1/32".parse().unwrap()],
        timeout: Duration::from_millis(300),
        ..HttpConfig::default()
    });
    let e = fetch_err(&tb, json!({"url": format!("http://{addr}/")})).await;
    // The configured limit is the one that ended the call.
    assert!(
        matches!(e, ToolError::Timeout(d) if d == Duration::from_millis(300)),
        "{e:?}"
    );
}

#[tokio::test]
async fn other_schemes_and_bad_requests_are_refused() {
    let tb = tools(HttpConfig::default());
    let m = refused(fetch_err(&tb, json!({"url": "file:///etc/passwd"})).await);
    assert!(m.contains("scheme `file` is refused"), "{m}");
    let m = refused(fetch_err(&tb, json!({"url": "ftp://example.com/"})).await);
    assert!(m.contains("scheme `ftp`"), "{m}");
    let e = fetch_err(&tb, json!({"url": "not a url"})).await;
    assert!(
        matches!(&e, ToolError::InvalidArgs(m) if m.contains("not a valid URL")),
        "{e:?}"
    );
    let e = fetch_err(
        &tb,
        json!({"url": "http://example.com/", "headers": {"Host": "internal"}}),
    )
    .await;
    assert!(
        matches!(&e, ToolError::InvalidArgs(m) if m.contains("`headers.Host` may not be set")),
        "{e:?}"
    );
    let e = fetch_err(&tb, json!({"url": "http://example.com/", "body": "x"})).await;
    assert!(
        matches!(&e, ToolError::InvalidArgs(m) if m.contains("only with method POST")),
        "{e:?}"
    );
    let e = fetch_err(
        &tb,
        json!({"url": "http://example.com/", "method": "DELETE"}),
    )
    .await;
    assert!(
        matches!(&e, ToolError::InvalidArgs(m) if m.contains("`method` must be one of")),
        "{e:?}"
    );
}

#[test]
fn the_address_classes() {
    let blocked = |s: &str| blocked_reason(s.parse::<IpAddr>().unwrap());
    for public in [
        "8.8.8.8",
        "1.1.1.1",
        "172.32.0.1",
        "100.128.0.1",
        "2606:4700::1111",
        "2a00:1450::1",
    ] {
        assert_eq!(blocked(public), None, "{public}");
    }
    for (ip, word) in [
        ("127.1.2.3", "loopback"),
        ("10.255.255.255", "private"),
        ("172.31.255.255", "private"),
        ("192.168.0.1", "private"),
        ("100.127.255.255", "CGNAT"),
        ("169.254.0.1", "link-local"),
        ("169.254.169.254", "metadata"),
        ("0.0.0.0", "unspecified"),
        ("239.255.255.250", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("::", "unspecified"),
        ("::1", "loopback"),
        ("fd12:3456::1", "unique-local"),
        ("fe80::abcd", "link-local"),
        ("ff02::1", "multicast"),
        ("fd00:ec2::254", "metadata"),
        ("::ffff:169.254.169.254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("::ffff:100.100.100.200", "metadata"),
        ("64:ff9b::6464:64c8", "metadata"),
        ("64:ff9b::a00:1", "private"),
        ("2002:c0a8:101::1", "private"),
    ] {
        let r = blocked(ip).unwrap_or_else(|| panic!("{ip} passed"));
        assert!(r.contains(word), "{ip}: {r}");
    }
    // Alibaba Cloud's metadata address sits in the CGNAT range; its neighbours do not
    // count as metadata.
    assert_eq!(
        blocked("100.100.100.100").map(|r| r.contains("CGNAT")),
        Some(true)
    );
}

#[test]
fn only_an_entry_naming_a_metadata_address_opens_it() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let metadata = ["169.254.169.254", "100.100.100.200", "fd00:ec2::254"];
    // Wide ranges that hold the metadata addresses, and the addresses as host names.
    let wide = Guard::new(&HttpConfig {
        allow_cidrs: [
            "169.254.0.0/16",
            "100.64.0.0/10",
            "fd00::/8",
            "0.0.0.0/0",
            "::/0",
        ]
        .iter()
        .map(|c| c.parse().unwrap())
        .collect(),
        allow_hosts: metadata.iter().map(|h| h.to_string()).collect(),
        ..HttpConfig::default()
    });
    for m in metadata {
        let e = wide.check_ip(m, ip(m)).unwrap_err();
        assert!(e.contains("metadata"), "{m}: {e}");
    }
    let mapped = wide
        .check_ip("x", ip("::ffff:100.100.100.200"))
        .unwrap_err();
    assert!(mapped.contains("metadata"), "{mapped}");
    // The ranges still open their other addresses.
    for other in [
        "169.254.1.1",
        "100.100.100.100",
        "fd00:ec2::253",
        "10.0.0.1",
    ] {
        assert_eq!(wide.check_ip("x", ip(other)), Ok(()), "{other}");
    }
    // An entry naming the address itself opens it, and nothing else of the kind.
    let named = Guard::new(&HttpConfig {
        allow_cidrs: vec![
            "100.100.100.200".parse().unwrap(),
            "169.254.169.254/32".parse().unwrap(),
        ],
        ..HttpConfig::default()
    });
    assert_eq!(named.check_ip("x", ip("100.100.100.200")), Ok(()));
    assert_eq!(named.check_ip("x", ip("::ffff:100.100.100.200")), Ok(()));
    assert_eq!(named.check_ip("x", ip("169.254.169.254")), Ok(()));
    let e = named.check_ip("x", ip("fd00:ec2::254")).unwrap_err();
    assert!(e.contains("metadata"), "{e}");
}
