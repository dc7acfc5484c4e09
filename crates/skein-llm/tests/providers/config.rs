//! `[models]` from TOML, the registry built from it, and prices.

use std::path::Path;
use std::time::Duration;

use skein_llm::config::ConfigDuration;
use skein_llm::{
    registry_from_config, Error, ModelsConfig, Price, ProviderKind, ProviderSettings, ToolMode,
};

use crate::mock::{Canned, MockServer};
use crate::{request, user, KEY};

const OK: &str = include_str!("../fixtures/openai_text.json");

/// `[models]` out of a whole skein.toml, the way the CLI hands it over.
fn models(toml_text: &str) -> Result<ModelsConfig, toml::de::Error> {
    let doc: toml::Table = toml::from_str(toml_text).unwrap();
    let models = doc
        .get("models")
        .cloned()
        .unwrap_or(toml::Value::Table(Default::default()));
    models.try_into()
}

const EXAMPLE: &str = r#"
[models.providers.openai]
kind = "openai"
base_url = "https://api.openai.com/v1"
api_key_env = "OPENAI_API_KEY"
headers = { "X-Title" = "skein" }
timeout = "120s"
connect_timeout = "10s"
max_retries = 3
tool_choice = "auto"
temperature = 0.3

[models.providers.anthropic]
kind = "anthropic"
base_url = "https://api.anthropic.com"
api_key_env = "ANTHROPIC_API_KEY"
max_tokens = 8192

[models.providers.local]
kind = "openai"
base_url = "http://localhost:11434/v1"
tool_mode = "json"
timeout = "5m"

[models.prices."openai:gpt-4o-mini"]
input_per_mtok = 0.15
output_per_mtok = 0.60
"#;

#[test]
fn example_config_parses_with_its_settings() {
    let m = models(EXAMPLE).unwrap();
    assert_eq!(m.providers.len(), 3);
    let o = &m.providers["openai"];
    assert_eq!(o.timeout, Some(ConfigDuration(Duration::from_secs(120))));
    assert_eq!(o.headers["X-Title"], "skein");
    let s = ProviderSettings::from_config("openai", o).unwrap();
    assert_eq!(s.http.max_retries, 3);
    assert_eq!(s.http.connect_timeout, Duration::from_secs(10));
    assert_eq!(s.temperature, Some(0.3));
    let l = ProviderSettings::from_config("local", &m.providers["local"]).unwrap();
    assert_eq!(l.kind, ProviderKind::OpenAi);
    assert_eq!(l.tool_mode, ToolMode::Json);
    assert_eq!(l.http.timeout, Duration::from_secs(300));
    assert_eq!(l.key, skein_llm::KeySource::None);
    assert_eq!(
        m.prices["openai:gpt-4o-mini"],
        Price {
            input_per_mtok: 0.15,
            output_per_mtok: 0.60,
            ..Default::default()
        }
    );

    let r = registry_from_config(&m, Path::new("config/scripts")).unwrap();
    assert_eq!(r.names(), ["anthropic", "local", "openai", "scripted"]);
    assert_eq!(r.price("openai:gpt-4o-mini").unwrap().input_per_mtok, 0.15);
    assert_eq!(r.price("openai:gpt-4o"), None);
}

#[test]
fn compound_durations_are_read() {
    let m = models(
        "[models.providers.local]\nkind = \"openai\"\nbase_url = \"http://h\"\n\
         timeout = \"1h30m\"\nconnect_timeout = \"1m 30s\"\n",
    )
    .unwrap();
    let s = ProviderSettings::from_config("local", &m.providers["local"]).unwrap();
    assert_eq!(s.http.timeout, Duration::from_secs(5400));
    assert_eq!(s.http.connect_timeout, Duration::from_secs(90));
    let e = models("[models.providers.openai]\nconnect_timeout = \"1h30\"\n").unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.contains("`1h30` is not a duration") && shown.contains("connect_timeout"),
        "{shown}"
    );
}

#[test]
fn empty_config_still_has_the_standard_providers() {
    let r = registry_from_config(&ModelsConfig::default(), Path::new("s")).unwrap();
    assert_eq!(r.names(), ["anthropic", "openai", "scripted"]);
}

#[test]
fn config_mistakes_are_named() {
    let e = models("[models.providers.openai]\napi_key = \"sk-oops\"\n").unwrap_err();
    assert!(e.to_string().contains("unknown field `api_key`"), "{e}");
    let e = models("[models]\nprovider = {}\n").unwrap_err();
    assert!(e.to_string().contains("unknown field"), "{e}");
    let e = models("[models.providers.x]\nkind = \"gemini\"\n").unwrap_err();
    assert!(e.to_string().contains("gemini"), "{e}");
    let e = models("[models.providers.openai]\ntimeout = \"soon\"\n").unwrap_err();
    assert!(e.to_string().contains("not a duration"), "{e}");
    let e = models("[models.prices.\"openai:x\"]\ninput_per_mtok = 1.0\n").unwrap_err();
    assert!(e.to_string().contains("output_per_mtok"), "{e}");

    let dir = Path::new("s");
    let bad = |text: &str| {
        registry_from_config(&models(text).unwrap(), dir)
            .err()
            .unwrap()
    };
    let e = bad("[models.providers.mine]\nbase_url = \"http://h\"\n");
    assert!(
        matches!(&e, Error::Config(m) if m.contains("`kind` is required")),
        "{e}"
    );
    let e = bad("[models.providers.scripted]\nkind = \"openai\"\n");
    assert!(e.to_string().contains("built in"), "{e}");
    let e = bad("[models.providers.l]\nkind = \"openai\"\nbase_url = \"localhost:1\"\n");
    assert!(e.to_string().contains("not an http(s) URL"), "{e}");
    let e = bad("[models.providers.l]\nkind = \"openai\"\nbase_url = \"http://h\"\napi_key_env = \"A\"\napi_key_file = \"/b\"\n");
    assert!(e.to_string().contains("not both"), "{e}");
    let e = bad("[models.prices.gpt]\ninput_per_mtok = 1.0\noutput_per_mtok = 1.0\n");
    assert!(e.to_string().contains("provider:model"), "{e}");
    let e = bad("[models.prices.\"a:b\"]\ninput_per_mtok = -1.0\noutput_per_mtok = 1.0\n");
    assert!(e.to_string().contains("non-negative"), "{e}");
}

#[tokio::test]
async fn registry_applies_prices_and_reads_the_key_file() {
    let server = MockServer::start(vec![Canned::fixture(OK), Canned::fixture(OK)]).await;
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let text = format!(
        r#"
[models.providers.local]
kind = "openai"
base_url = "{url}/v1"
api_key_file = "{key}"

[models.prices."local:gpt-4o-mini"]
input_per_mtok = 0.15
output_per_mtok = 0.60

[models.prices."local:*"]
input_per_mtok = 1.0
output_per_mtok = 2.0
"#,
        url = server.url,
        key = key_file.display()
    );
    let r = registry_from_config(&models(&text).unwrap(), dir.path()).unwrap();

    // The fixture reports 1000 input and 2000 output tokens.
    let c = r
        .complete(&request("local:gpt-4o-mini", vec![user("hi")], vec![]))
        .await
        .unwrap();
    let want = 1000.0 * 0.15 / 1e6 + 2000.0 * 0.60 / 1e6;
    assert!((c.usage.cost - want).abs() < 1e-12, "{}", c.usage.cost);

    let c = r
        .complete(&request("local:qwen2.5:7b", vec![user("hi")], vec![]))
        .await
        .unwrap();
    let want = 1000.0 * 1.0 / 1e6 + 2000.0 * 2.0 / 1e6;
    assert!((c.usage.cost - want).abs() < 1e-12, "{}", c.usage.cost);

    let seen = server.requests();
    assert_eq!(seen[0].headers["authorization"], format!("Bearer {KEY}"));
    assert_eq!(
        seen[1].body["model"], "qwen2.5:7b",
        "only the first `:` splits"
    );
}

#[tokio::test]
async fn unpriced_model_costs_nothing_and_scripted_stays() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hello.yaml"), "turns:\n  - answer: hi\n").unwrap();
    let r = registry_from_config(&ModelsConfig::default(), dir.path()).unwrap();
    let c = r
        .complete(&request("scripted:hello", vec![user("x")], vec![]))
        .await
        .unwrap();
    assert_eq!(c.response.content.as_deref(), Some("hi"));
    assert_eq!(c.usage.cost, 0.0);
    let e = r
        .complete(&request("nope:m", vec![user("x")], vec![]))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::UnknownProvider { .. }), "{e:?}");
}
