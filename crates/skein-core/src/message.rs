//! What a model sees and answers: chat messages, tool calls, usage.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One tool call the model asked for. `id` is the provider's call id (or one the runtime
/// assigned when the provider gave none); it names the call in every later event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    #[serde(default)]
    pub args: Value,
}

/// One model answer: text, tool calls, or both.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelResponse {
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// Token usage and cost. `estimated` is set when a provider reported no usage and the
/// figures were estimated from text length.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    /// US dollars, from the price table in force when the call was made.
    #[serde(default)]
    pub cost: f64,
    #[serde(default)]
    pub estimated: bool,
    /// Of `input_tokens`, those the provider read from its prompt cache. Left out of the
    /// encoding when zero, so usage without caching encodes as it always did.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_read_tokens: u64,
    /// Of `input_tokens`, those the provider wrote to its prompt cache.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_write_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Usage {
    /// Counts come from model servers: a sum too large for a `u64` stays at the maximum
    /// (over any budget) instead of overflowing.
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    pub fn add(&mut self, other: &Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cost += other.cost;
        self.estimated |= other.estimated;
        self.cache_read_tokens = self
            .cache_read_tokens
            .saturating_add(other.cache_read_tokens);
        self.cache_write_tokens = self
            .cache_write_tokens
            .saturating_add(other.cache_write_tokens);
    }
}

/// A chat message in provider-neutral form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    System {
        content: String,
    },
    User {
        content: String,
    },
    Assistant {
        #[serde(default)]
        content: Option<String>,
        #[serde(default)]
        tool_calls: Vec<ToolCall>,
    },
    Tool {
        call_id: String,
        name: String,
        content: String,
        #[serde(default)]
        is_error: bool,
    },
}

/// A tool as the model is told about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments object; shared, since a request's tools are each
    /// turn's and a schema may be large (an MCP server's).
    pub parameters: std::sync::Arc<Value>,
}

/// Facts about the session a provider may use; only the scripted model reads them
/// (real providers see nothing but `messages` and `tools`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RequestMeta {
    pub session: String,
    pub agent: String,
    pub mission: String,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub inputs: Value,
    /// The plan this session owns (`{version, tasks}`) or was handed (`{version, owns}`).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub plan: Value,
}

/// Everything a provider needs for one model turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// `provider:model`, e.g. `scripted:orchestrator` or `openai:gpt-4o-mini`.
    pub model: String,
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Nucleus sampling: only the most likely tokens whose probabilities add up to this.
    /// Left out of the encoding when unset, as are `top_k`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Sample only among this many most likely tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// Ask the provider to cache the stable prefix of the prompt (the system prompt,
    /// the tools and the conversation so far), where its API lets the caller choose
    /// (Anthropic's `cache_control`). Left out of the encoding when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prompt_cache: bool,
    #[serde(default)]
    pub meta: RequestMeta,
}

impl ModelRequest {
    /// blake3 of the request's canonical msgpack form, hex.
    pub fn digest(&self) -> String {
        // Encoded into the hasher through a small buffer: the same bytes as
        // `to_vec_named`, without holding the whole conversation's encoding in memory
        // once more each turn, and without handing the hasher each of the encoding's
        // many small pieces one by one (which cost more than the hashing).
        use std::io::Write as _;
        let mut h = blake3::Hasher::new();
        let mut w = std::io::BufWriter::with_capacity(8 << 10, &mut h);
        if rmp_serde::encode::write_named(&mut w, self).is_err() || w.flush().is_err() {
            return blake3::hash(&[]).to_hex().to_string();
        }
        drop(w);
        h.finalize().to_hex().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::{Message, ModelRequest, RequestMeta, Usage};

    #[test]
    fn a_requests_digest_is_the_blake3_of_its_msgpack_bytes() {
        // Digests are kept in the log and compared by replay: hashing while encoding must
        // give exactly what hashing the encoded bytes gave.
        let req = ModelRequest {
            model: "scripted:leaf".into(),
            messages: vec![
                Message::System {
                    content: "Look around.".into(),
                },
                Message::User {
                    content: "x".repeat(70_000),
                },
            ],
            tools: vec![],
            temperature: Some(0.25),
            max_tokens: Some(512),
            top_p: None,
            top_k: Some(40),
            prompt_cache: true,
            meta: RequestMeta::default(),
        };
        let bytes = rmp_serde::to_vec_named(&req).expect("encode");
        assert_eq!(req.digest(), blake3::hash(&bytes).to_hex().to_string());
        let mut other = req.clone();
        other.top_k = Some(41);
        assert_ne!(req.digest(), other.digest());
    }

    #[test]
    fn usage_sums_saturate_instead_of_overflowing() {
        let huge = Usage {
            input_tokens: u64::MAX - 1,
            output_tokens: 5,
            ..Default::default()
        };
        assert_eq!(huge.total_tokens(), u64::MAX);
        let mut total = huge;
        total.add(&huge);
        assert_eq!(
            (total.input_tokens, total.output_tokens),
            (u64::MAX, 10),
            "a second huge count keeps the total at the maximum, over any budget"
        );
    }
}
