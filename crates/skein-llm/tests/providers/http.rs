//! Failures: error kinds, in-process retries, timeouts, and secrets kept out of errors.

use std::time::{Duration, Instant};

use serde_json::json;
use skein_llm::openai::OpenAiProvider;
use skein_llm::{Error, KeySource, Provider, ProviderKind};

use crate::mock::{Canned, MockServer};
use crate::{request, settings, user, KEY};

const OK: &str = include_str!("../fixtures/openai_text.json");

fn provider(url: &str) -> OpenAiProvider {
    OpenAiProvider::new(settings(ProviderKind::OpenAi, url)).unwrap()
}

async fn call(p: &OpenAiProvider) -> Result<skein_llm::Completion, Error> {
    p.complete("m", &request("test:m", vec![user("hi")], vec![]))
        .await
}

#[tokio::test]
async fn rate_limited_then_ok_waits_for_retry_after() {
    let server = MockServer::start(vec![
        Canned::json(429, &json!({"error": {"message": "Rate limit reached"}}))
            .header("retry-after", "1"),
        Canned::fixture(OK),
    ])
    .await;
    let p = provider(&server.url);
    let c = call(&p).await.unwrap();
    assert_eq!(
        c.response.content.as_deref(),
        Some("Paris is the capital of France.")
    );
    let seen = server.requests();
    assert_eq!(seen.len(), 2, "one retry");
    let waited = seen[1].at - seen[0].at;
    assert!(
        waited >= Duration::from_millis(950) && waited < Duration::from_secs(3),
        "waited {waited:?}"
    );
    assert_eq!(seen[0].body, seen[1].body, "the same request again");
}

#[tokio::test]
async fn server_error_then_ok() {
    let server = MockServer::start(vec![
        Canned::raw(500, "internal error"),
        Canned::fixture(OK),
    ])
    .await;
    let c = call(&provider(&server.url)).await.unwrap();
    assert!(c.response.content.is_some());
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn retries_are_bounded_and_the_last_error_is_returned() {
    let server = MockServer::start(vec![
        Canned::raw(503, "busy"),
        Canned::raw(502, "bad gateway"),
        Canned::raw(503, "still busy"),
        Canned::fixture(OK),
    ])
    .await;
    let e = call(&provider(&server.url)).await.unwrap_err();
    assert!(
        matches!(&e, Error::Http { status: 503, message, retry_after: None } if message == "still busy"),
        "{e:?}"
    );
    assert!(e.is_retryable());
    assert_eq!(server.requests().len(), 3, "1 try + max_retries (2)");
}

#[tokio::test]
async fn long_retry_after_goes_back_to_the_runtime() {
    let server = MockServer::start(vec![
        Canned::json(429, &json!({"error": {"message": "slow down"}})).header("retry-after", "120"),
        Canned::fixture(OK),
    ])
    .await;
    let started = Instant::now();
    let e = call(&provider(&server.url)).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(server.requests().len(), 1, "not slept through in process");
    assert!(e.is_retryable());
    assert_eq!(e.retry_after(), Some(Duration::from_secs(120)));
}

#[tokio::test]
async fn timeout_is_its_own_retryable_kind() {
    let server = MockServer::start(vec![Canned::fixture(OK).delay(Duration::from_secs(3))]).await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.http.timeout = Duration::from_millis(200);
    let p = OpenAiProvider::new(s).unwrap();
    let started = Instant::now();
    let e = call(&p).await.unwrap_err();
    assert!(
        matches!(e, Error::Timeout(d) if d == Duration::from_millis(200)),
        "{e:?}"
    );
    assert!(e.is_retryable());
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(
        server.requests().len(),
        1,
        "a timeout is not retried in process"
    );
}

#[tokio::test]
async fn malformed_body_is_malformed() {
    let server = MockServer::start(vec![Canned::raw(200, "{\"choices\": [ oops")]).await;
    let e = call(&provider(&server.url)).await.unwrap_err();
    match &e {
        Error::Malformed(m) => assert!(m.contains("not JSON"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(server.requests().len(), 1);

    let server = MockServer::start(vec![Canned::json(200, &json!({"object": "list"}))]).await;
    let e = call(&provider(&server.url)).await.unwrap_err();
    assert!(
        matches!(&e, Error::Malformed(m) if m.contains("choices") && m.starts_with("test:m")),
        "{e:?}"
    );
}

#[tokio::test]
async fn bad_request_is_not_retried_and_never_shows_the_key() {
    // A provider that echoes the key back in its error message.
    let body = json!({"error": {
        "message": format!("Incorrect API key provided: {KEY}. You can find your API key at https://example.invalid."),
        "type": "invalid_request_error",
        "code": "invalid_api_key"
    }});
    let server = MockServer::start(vec![Canned::json(400, &body), Canned::fixture(OK)]).await;
    let e = call(&provider(&server.url)).await.unwrap_err();
    assert!(matches!(e, Error::Http { status: 400, .. }), "{e:?}");
    assert!(!e.is_retryable());
    assert_eq!(e.retry_after(), None);
    assert_eq!(server.requests().len(), 1, "a 400 is not retried");
    for shown in [e.to_string(), format!("{e:?}")] {
        assert!(!shown.contains(KEY), "{shown}");
        assert!(shown.contains("Incorrect API key provided: ***"), "{shown}");
    }
}

#[tokio::test]
async fn error_object_in_a_200_body_is_an_http_error() {
    let body = json!({"error": {"message": "Provider returned error", "code": 429}});
    let server = MockServer::start(vec![Canned::json(200, &body)]).await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.http.max_retries = 0;
    let e = call(&OpenAiProvider::new(s).unwrap()).await.unwrap_err();
    assert!(
        matches!(&e, Error::Http { status: 429, message, .. } if message == "Provider returned error"),
        "{e:?}"
    );
}

#[tokio::test]
async fn connection_refused_is_connect_and_retried() {
    // A port that was free a moment ago: nothing listens there.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let e = call(&provider(&url)).await.unwrap_err();
    assert!(
        matches!(&e, Error::Connect(m) if m.starts_with("test:")),
        "{e:?}"
    );
    assert!(e.is_retryable());
}

#[tokio::test]
async fn missing_key_is_a_config_error_before_any_request() {
    let server = MockServer::start(vec![Canned::fixture(OK)]).await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.key = KeySource::Env("SKEIN_LLM_TEST_KEY_THAT_IS_NOT_SET".into());
    let e = call(&OpenAiProvider::new(s).unwrap()).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(
        e.to_string().contains("SKEIN_LLM_TEST_KEY_THAT_IS_NOT_SET"),
        "{e}"
    );
    assert!(!e.is_retryable());
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn key_from_env_is_sent() {
    let var = "SKEIN_LLM_TEST_KEY_FROM_ENV";
    std::env::set_var(var, KEY);
    let server = MockServer::start(vec![Canned::fixture(OK)]).await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.key = KeySource::Env(var.into());
    call(&OpenAiProvider::new(s).unwrap()).await.unwrap();
    assert_eq!(
        server.requests()[0].headers["authorization"],
        format!("Bearer {KEY}")
    );
}
