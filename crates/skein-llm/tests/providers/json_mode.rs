//! `tool_mode = "json"`: tools described in the prompt, calls parsed from the text.

use serde_json::{json, Value};
use skein_core::Message;
use skein_llm::anthropic::AnthropicProvider;
use skein_llm::openai::OpenAiProvider;
use skein_llm::{args_error, Provider, ProviderKind, ToolMode, INVALID_TOOL_CALL};

use crate::mock::{Canned, MockServer};
use crate::{request, settings, system, user, weather_tool};

/// A chat completion whose text is `text`, without usage.
fn said(text: &str) -> Canned {
    Canned::json(
        200,
        &json!({
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}]
        }),
    )
}

#[tokio::test]
async fn round_trip_calls_results_and_answer() {
    let server = MockServer::start(vec![
        said("Sure.\n```json\n{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\",}},\n {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}]}\n```"),
        said("{\"answer\": \"Paris 21°C; Oslo unknown.\"}"),
        said("{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": "),
    ])
    .await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.tool_mode = ToolMode::Json;
    let p = OpenAiProvider::new(s).unwrap();

    // Turn 1: the model asks for two calls in a fenced block with a trailing comma.
    let mut msgs = vec![
        system("You are a weather assistant."),
        user("Weather in Paris and Oslo?"),
    ];
    let c1 = p
        .complete("m", &request("test:m", msgs.clone(), vec![weather_tool()]))
        .await
        .unwrap();
    let r1 = &c1.response;
    assert_eq!(r1.content.as_deref(), Some("Sure."));
    assert_eq!(r1.finish_reason.as_deref(), Some("tool_calls"));
    let args: Vec<&Value> = r1.tool_calls.iter().map(|c| &c.args).collect();
    assert_eq!(args, [&json!({"city": "Paris"}), &json!({"city": "Oslo"})]);
    assert!(r1
        .tool_calls
        .iter()
        .all(|c| c.name == "get_weather" && c.id.is_empty()));
    assert!(c1.usage.estimated);

    let b1 = &server.requests()[0].body;
    let o = b1.as_object().unwrap();
    assert!(
        !o.contains_key("tools") && !o.contains_key("tool_choice"),
        "{b1}"
    );
    let sys = b1["messages"][0]["content"].as_str().unwrap();
    assert!(sys.starts_with("You are a weather assistant."), "{sys}");
    assert!(sys.contains("## get_weather") && sys.contains("Current weather of a city."));
    assert!(
        sys.contains(&weather_tool().parameters.to_string()),
        "{sys}"
    );
    assert!(
        sys.contains(r#"{"tool_calls": [{"name": "TOOL_NAME""#) && sys.contains(r#"{"answer": "#)
    );

    // Turn 2: the results go back as a user message; the model answers.
    let mut calls = r1.tool_calls.clone();
    calls[0].id = "t1_1".into();
    calls[1].id = "t1_2".into();
    msgs.push(Message::Assistant {
        content: r1.content.clone(),
        tool_calls: calls,
    });
    msgs.push(Message::Tool {
        call_id: "t1_1".into(),
        name: "get_weather".into(),
        content: "{\"temp_c\": 21}".into(),
        is_error: false,
    });
    msgs.push(Message::Tool {
        call_id: "t1_2".into(),
        name: "get_weather".into(),
        content: "station offline".into(),
        is_error: true,
    });
    let c2 = p
        .complete("m", &request("test:m", msgs.clone(), vec![weather_tool()]))
        .await
        .unwrap();
    assert_eq!(
        c2.response.content.as_deref(),
        Some("Paris 21°C; Oslo unknown.")
    );
    assert!(c2.response.tool_calls.is_empty());
    assert_eq!(c2.response.finish_reason.as_deref(), Some("stop"));

    let sent = server.requests()[1].body["messages"].clone();
    let sent = sent.as_array().unwrap();
    assert_eq!(sent.len(), 4, "{sent:?}");
    assert!(sent
        .iter()
        .all(|m| m["role"] != "tool" && m.get("tool_calls").is_none()));
    let earlier: Value = {
        let text = sent[2]["content"].as_str().unwrap();
        serde_json::from_str(text.trim_start_matches("Sure.").trim()).unwrap()
    };
    assert_eq!(
        earlier["tool_calls"][1]["arguments"],
        json!({"city": "Oslo"})
    );
    assert_eq!(sent[3]["role"], "user");
    let results = sent[3]["content"].as_str().unwrap();
    assert!(
        results.contains("Result of `get_weather` (call t1_1):\n{\"temp_c\": 21}"),
        "{results}"
    );
    assert!(
        results.contains("Error from `get_weather` (call t1_2):\nstation offline"),
        "{results}"
    );

    // Turn 3: a cut-off answer becomes a call the runtime reports back to the model.
    let c3 = p
        .complete("m", &request("test:m", msgs, vec![weather_tool()]))
        .await
        .unwrap();
    let [call] = c3.response.tool_calls.as_slice() else {
        panic!("{:?}", c3.response)
    };
    assert_eq!(call.name, INVALID_TOOL_CALL);
    let (raw, why) = args_error(&call.args).unwrap();
    assert!(raw.starts_with("{\"tool_calls\""));
    assert!(why.contains("cut off"), "{why}");
}

#[tokio::test]
async fn without_tools_the_text_is_the_answer() {
    let server = MockServer::start(vec![said("{\"not\": \"a call\"}")]).await;
    let mut s = settings(ProviderKind::OpenAi, &server.url);
    s.tool_mode = ToolMode::Json;
    let p = OpenAiProvider::new(s).unwrap();
    let c = p
        .complete("m", &request("test:m", vec![user("JSON please")], vec![]))
        .await
        .unwrap();
    assert_eq!(c.response.content.as_deref(), Some("{\"not\": \"a call\"}"));
    assert!(c.response.tool_calls.is_empty());
    let m = &server.requests()[0].body["messages"];
    assert_eq!(
        m.as_array().unwrap().len(),
        1,
        "no tool prompt without tools"
    );
}

#[tokio::test]
async fn anthropic_json_mode_puts_the_prompt_in_system() {
    let answer = json!({
        "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 300, "output_tokens": 20}
    });
    let server = MockServer::start(vec![Canned::json(200, &answer)]).await;
    let mut s = settings(ProviderKind::Anthropic, &server.url);
    s.tool_mode = ToolMode::Json;
    let p = AnthropicProvider::new(s).unwrap();
    let c = p
        .complete(
            "c",
            &request("test:c", vec![user("Rome?")], vec![weather_tool()]),
        )
        .await
        .unwrap();
    assert_eq!(c.response.tool_calls[0].name, "get_weather");
    assert_eq!(c.response.tool_calls[0].args, json!({"city": "Rome"}));
    assert_eq!(c.usage.input_tokens, 300);
    let b = &server.requests()[0].body;
    assert!(b.get("tools").is_none());
    assert!(b["system"].as_str().unwrap().contains("## get_weather"));
}
