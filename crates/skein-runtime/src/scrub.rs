//! Known secrets kept out of everything a session records: the API keys of the configured
//! model providers and the token-signing secret. A model that echoes its key in an
//! answer, or a tool whose output holds one (`env` in a shell, a page that reflects a
//! header), has it replaced by `***` before the event is written, so no log, export, page
//! or terminal ever shows it.

use serde_json::Value;
use skein_core::ModelResponse;

/// Shorter values are not treated as secrets: replacing every `test` or `1234` in the
/// text of a session would garble it and hide nothing worth hiding.
pub const MIN_SECRET_CHARS: usize = 8;

/// What replaces a secret.
pub const MASK: &str = "***";

/// A set of secret values to scrub, longest first (a secret that holds another goes whole).
#[derive(Debug, Clone, Default)]
pub struct Scrubber {
    secrets: Vec<String>,
}

impl Scrubber {
    pub fn new(values: impl IntoIterator<Item = String>) -> Self {
        let mut secrets: Vec<String> = values
            .into_iter()
            .filter(|s| s.chars().count() >= MIN_SECRET_CHARS)
            .collect();
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Self { secrets }
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// `text` with every secret replaced by [`MASK`]; `None` when it holds none.
    pub fn scrubbed(&self, text: &str) -> Option<String> {
        if !self.secrets.iter().any(|s| text.contains(s.as_str())) {
            return None;
        }
        let mut out = text.to_string();
        for s in &self.secrets {
            out = out.replace(s.as_str(), MASK);
        }
        Some(out)
    }

    /// Scrubs `text` in place.
    pub fn text(&self, text: &mut String) {
        if let Some(t) = self.scrubbed(text) {
            *text = t;
        }
    }

    /// Scrubs every string of `v` (keys too) in place.
    pub fn value(&self, v: &mut Value) {
        match v {
            Value::String(s) => self.text(s),
            Value::Array(items) => items.iter_mut().for_each(|i| self.value(i)),
            Value::Object(map) => {
                let renamed: Vec<(String, String)> = map
                    .keys()
                    .filter_map(|k| self.scrubbed(k).map(|n| (k.clone(), n)))
                    .collect();
                for (old, new) in renamed {
                    if let Some(x) = map.remove(&old) {
                        map.insert(new, x);
                    }
                }
                map.values_mut().for_each(|x| self.value(x));
            }
            _ => {}
        }
    }

    /// Scrubs a model's answer: its text and every tool call's arguments.
    pub fn response(&self, r: &mut ModelResponse) {
        if self.is_empty() {
            return;
        }
        if let Some(c) = &mut r.content {
            self.text(c);
        }
        for call in &mut r.tool_calls {
            self.value(&mut call.args);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn secrets_are_masked_in_text_values_and_answers() {
        let s = Scrubber::new([
            "sk-live-0123456789".to_string(),
            "short".to_string(),
            "sk-live-0123456789-long".to_string(),
        ]);
        assert_eq!(s.scrubbed("nothing"), None);
        assert_eq!(
            s.scrubbed("a sk-live-0123456789-long b sk-live-0123456789 short")
                .unwrap(),
            "a *** b *** short"
        );
        let mut v = json!({"k": ["x sk-live-0123456789"], "sk-live-0123456789": 1});
        s.value(&mut v);
        assert_eq!(v, json!({"k": ["x ***"], "***": 1}));
        let mut r = ModelResponse {
            content: Some("my key is sk-live-0123456789".into()),
            tool_calls: vec![skein_core::ToolCall {
                id: "c1".into(),
                name: "write_file".into(),
                args: json!({"content": "sk-live-0123456789"}),
            }],
            finish_reason: None,
        };
        s.response(&mut r);
        assert_eq!(r.content.as_deref(), Some("my key is ***"));
        assert_eq!(r.tool_calls[0].args["content"], "***");
    }
}
