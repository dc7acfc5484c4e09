//! `model_stream`: a model server's answer as a stream of server-sent events. The bytes
//! are cut into events (whole, and again in two pieces at a point the input chooses: the
//! events must not depend on where the network cut them), each event is folded by the
//! OpenAI and the Anthropic stream readers, and every answer they put together is read
//! by the providers' parsers and folded into a session, as a worker does.

use skein_llm::stream::{AnthropicStream, OpenAiStream, SseParser};
use skein_llm::{anthropic, openai};

use super::model_response::Responses;
use super::{Spec, Target};
use crate::Result;

pub const SPEC: Spec = Spec {
    name: "model_stream",
    about: "streamed model answers (server-sent events; openai and anthropic deltas)",
    max_len: 64 * 1024,
    make: || Ok(Box::new(Streams(Responses::new()?))),
    reshape: |_, _, _| None,
    tokens: &[
        "data: ",
        "event: ",
        "\n\n",
        "\r\n",
        "[DONE]",
        "delta",
        "content",
        "tool_calls",
        "index",
        "arguments",
        "finish_reason",
        "message_start",
        "content_block_start",
        "content_block_delta",
        "text_delta",
        "input_json_delta",
        "partial_json",
        "message_delta",
        "message_stop",
        "stop_reason",
        "tool_use",
        "usage",
        "error",
    ],
};

struct Streams(Responses);

fn events(parts: &[&[u8]]) -> Option<Vec<(String, String)>> {
    let mut p = SseParser::default();
    let mut out = vec![];
    for part in parts {
        out.extend(p.feed(part).ok()?);
    }
    out.extend(p.finish());
    Some(out)
}

impl Target for Streams {
    fn run(&mut self, data: &[u8]) -> bool {
        let Some(whole) = events(&[data]) else {
            return false;
        };
        let cut = data.first().map_or(0, |b| *b as usize * data.len() / 256);
        let (a, b) = data.split_at(cut.min(data.len()));
        // An event that is too long is refused wherever the cut falls; otherwise the
        // events are the same.
        if let Some(split) = events(&[a, b]) {
            assert_eq!(
                whole, split,
                "events depend on where the bytes were cut ({cut})"
            );
        }
        let mut oa = OpenAiStream::default();
        let mut an = AnthropicStream::default();
        let (mut oa_ok, mut an_ok) = (true, true);
        for (event, data) in &whole {
            oa_ok = oa_ok && oa.push(data, &|_| {}).is_ok();
            an_ok = an_ok && an.push(event, data, &|_| {}).is_ok();
        }
        let mut any = false;
        let req = self.0.request().clone();
        if let Some(body) = oa_ok.then(|| oa.finish().ok()).flatten() {
            if let Ok(c) = openai::parse_response(&body, &req, false) {
                self.0.fold(&c);
                any = true;
            }
        }
        if let Some(body) = an_ok.then(|| an.finish().ok()).flatten() {
            if let Ok(c) = anthropic::parse_response(&body, &req, false) {
                self.0.fold(&c);
                any = true;
            }
        }
        any
    }
}

/// Seeds: the streams of the recorded real-server runs and of the provider tests.
pub fn seeds() -> Result<Vec<(String, Vec<u8>)>> {
    let mut out = vec![
        (
            "openai-tool-call.sse".to_string(),
            concat!(
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"function\":{\"name\":\"read_file\",\"arguments\":\"{\\\"pa\"}}]}}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"th\\\":\\\"a\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n",
                "data: [DONE]\n\n"
            )
            .as_bytes()
            .to_vec(),
        ),
        (
            "anthropic-tool-use.sse".to_string(),
            concat!(
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5}}}\n\n",
                "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"read_file\",\"input\":{}}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"path\\\": \\\"a\\\"}\"}}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},\"usage\":{\"output_tokens\":4}}\n\n",
                "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
            )
            .as_bytes()
            .to_vec(),
        ),
    ];
    let dir = crate::seeds::repo_root().join("tests/cassettes/llama-cpp-python-0.3.36");
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name == "request.schema.json" || !name.ends_with(".json") {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            let bodies = v["interactions"].as_array().cloned().unwrap_or_default();
            for (i, it) in bodies.iter().enumerate() {
                if it["content_type"]
                    .as_str()
                    .unwrap_or("")
                    .contains("event-stream")
                {
                    let body = it["body"].as_str().unwrap_or("").as_bytes().to_vec();
                    out.push((format!("{}-{i}.sse", name.trim_end_matches(".json")), body));
                }
            }
        }
    }
    Ok(out)
}
