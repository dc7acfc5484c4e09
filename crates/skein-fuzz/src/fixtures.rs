//! What the targets share: the agent catalogue they decide against, and the token secret.
//! Nothing here is a real secret: the key below signs tokens of fuzz runs and seeds only.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use skein_core::AgentSet;

/// Signs and opens the resume tokens of the targets and of the seed corpus. A test key,
/// public on purpose: it protects nothing.
pub const TEST_SECRET: &[u8] = b"fuzz-test-secret-not-a-real-key";

/// The demo catalogue of `config/agents`, as shipped.
pub const DEMO_AGENTS: &[(&str, &str)] = &[
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

/// An agent allowed every tool and every orchestration pattern, so that any tool call a
/// model may send reaches the rules that decide it (`team_broadcast` is given by its seat
/// in a team, which the fuzz targets' logs give it).
pub const FUZZER_AGENT: &str = "---
name: fuzzer
description: May call every tool; the agent whose model's calls the fuzz targets decide.
model: scripted:fuzzer
tools: [ask_user, update_plan, read_file, write_file, list_dir, search_files, http_fetch, shell, ask_clarification]
agents: [researcher, writer, chatty, fuzzer]
recursive: true
router:
  destinations: [writer]
limits:
  max_steps: 50
  max_children_per_turn: 4
---
You may call every tool.
";

/// A sub-agent that takes follow-up questions (`chat: true`).
pub const CHATTY_AGENT: &str = "---
name: chatty
description: Answers, and answers follow-up questions.
model: scripted:chatty
chat: true
---
You answer, and you answer follow-up questions.
";

/// Every definition the targets use, as `(origin, text)`.
pub fn agent_files() -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = DEMO_AGENTS
        .iter()
        .map(|(n, t)| (format!("config/agents/{n}"), t.to_string()))
        .collect();
    files.push(("fuzzer.md".into(), FUZZER_AGENT.into()));
    files.push(("chatty.md".into(), CHATTY_AGENT.into()));
    files
}

/// The demo catalogue plus `fuzzer` and `chatty`, validated as a whole.
pub fn catalog() -> skein_core::Result<AgentSet> {
    AgentSet::load(&agent_files(), &[])
}

/// A token in the runtime's format over arbitrary claim bytes, signed with
/// [`TEST_SECRET`]: what a holder of the secret could make. Lets the fuzzer reach the
/// claims parser behind a valid signature.
pub fn sign_raw(claims: &[u8]) -> String {
    let tag = match Hmac::<Sha256>::new_from_slice(TEST_SECRET) {
        Ok(mut m) => {
            m.update(b"skt1");
            m.update(claims);
            m.finalize().into_bytes().to_vec()
        }
        Err(_) => vec![],
    };
    format!("skt1.{}.{}", hex::encode(claims), hex::encode(tag))
}

/// The root the `answers` target pauses on a question, and the id of its token.
pub const PAUSED_ROOT: &str = "fuzz-paused";
pub const PAUSED_TOKEN_ID: &str = "f0f0f0f0f0f0f0f0f0f0f0f0";
/// Seq of the `InputRequested` that pauses it (after `Submitted` and `ModelCalled`).
pub const PAUSED_SEQ: u64 = 3;

/// The questions the paused root asks, as `ask_user` puts them.
pub fn paused_questions() -> serde_json::Value {
    serde_json::json!([
        {"key": "version", "question": "Which Python version?"},
        {"key": "license", "question": "Which license?"},
        "Anything else?"
    ])
}

/// The token that answers the paused root's question.
pub fn paused_token() -> String {
    match skein_core::SessionId::root(PAUSED_ROOT) {
        Ok(session) => skein_core::token::sign(
            TEST_SECRET,
            &skein_core::token::Claims {
                session,
                seq: PAUSED_SEQ,
                nonce: PAUSED_TOKEN_ID.into(),
                kind: skein_core::token::TokenKind::Input,
            },
        ),
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_loads() {
        let c = catalog().unwrap();
        assert!(c.get("fuzzer").is_some() && c.get("orchestrator").is_some());
    }

    #[test]
    fn raw_signing_matches_the_runtime() {
        let claims = skein_core::token::Claims {
            session: skein_core::SessionId::parse("01abc").unwrap(),
            seq: 3,
            nonce: "n".into(),
            kind: skein_core::token::TokenKind::Input,
        };
        let t = skein_core::token::sign(TEST_SECRET, &claims);
        let body = hex::decode(t.split('.').nth(1).unwrap()).unwrap();
        assert_eq!(sign_raw(&body), t);
        assert_eq!(skein_core::token::open(TEST_SECRET, &t).unwrap(), claims);
    }
}
