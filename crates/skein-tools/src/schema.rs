//! A validator for the part of JSON Schema our tools use. The model's arguments are checked
//! before a tool runs, and every complaint names the field and what was wrong with it, so
//! the model can correct itself.
//!
//! Understood keywords: `type` (a name or a list of names: object, string, integer, number,
//! boolean, array, null), `properties`, `required`, `additionalProperties` (`false` or a
//! schema), `enum`, `minimum`, `maximum`, `minLength`, `maxLength`, `items`; `description`,
//! `default` and `title` are annotations. [`check_schema`] refuses anything else, so a tool
//! cannot silently rely on a keyword nobody enforces.
//!
//! The built-in tools do not write their schemas by hand: [`derived`] makes each one from
//! the struct the tool deserializes its arguments into, so the two cannot drift apart.

use schemars::generate::SchemaSettings;
use schemars::JsonSchema;
use serde_json::{Map, Value};

const ANNOTATIONS: &[&str] = &["description", "default", "title"];
const KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "items",
];
const TYPES: &[&str] = &[
    "object", "string", "integer", "number", "boolean", "array", "null",
];

/// The schema of an arguments struct, derived from its definition: field doc comments
/// become descriptions, `#[serde(default)]` or `Option` fields are optional,
/// `deny_unknown_fields` gives `additionalProperties: false`, `#[schemars(length(..))]` and
/// `#[schemars(range(..))]` give the bounds. Sub-schemas are inlined and what only a
/// generator needs (`$schema`, `title`, `format`, the `null` an `Option` admits and its
/// `default: null`) is left
/// out, so the result stays inside what [`validate`] enforces and reads like a hand-written
/// schema. An argument sent as `null` is refused, as before: say nothing to mean "none".
pub fn derived<T: JsonSchema>() -> Value {
    let generator = SchemaSettings::draft2020_12()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator();
    let mut schema = generator.into_root_schema_for::<T>().to_value();
    tidy(&mut schema);
    schema
}

/// Strips generator-only keywords from `schema` and its sub-schemas (see [`derived`]).
fn tidy(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    for k in ["$schema", "title", "format"] {
        obj.remove(k);
    }
    if let Some(Value::Array(names)) = obj.get_mut("type") {
        names.retain(|n| n != "null");
        if let [one] = names.as_slice() {
            let one = one.clone();
            obj.insert("type".into(), one);
        }
    }
    if obj.get("default").is_some_and(Value::is_null) {
        obj.remove("default");
    }
    if let Some(Value::Array(options)) = obj.get_mut("enum") {
        options.retain(|o| !o.is_null());
    }
    if let Some(Value::Object(props)) = obj.get_mut("properties") {
        props.values_mut().for_each(tidy);
    }
    for k in ["items", "additionalProperties"] {
        if let Some(sub) = obj.get_mut(k) {
            tidy(sub);
        }
    }
}

/// Checks `value` against `schema`; every problem found, each naming its field.
pub fn validate(schema: &Value, value: &Value) -> Result<(), Vec<String>> {
    let mut errors = vec![];
    check(schema, value, "", &mut errors);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Checks that `schema` uses only what [`validate`] enforces, and uses it well-formed.
pub fn check_schema(schema: &Value) -> Result<(), String> {
    check_schema_at(schema, "#")
}

fn check_schema_at(schema: &Value, at: &str) -> Result<(), String> {
    let obj = schema
        .as_object()
        .ok_or_else(|| format!("{at}: a schema must be an object"))?;
    for (k, v) in obj {
        match k.as_str() {
            "type" => {
                let names: Vec<&Value> = match v {
                    Value::Array(a) => a.iter().collect(),
                    v => vec![v],
                };
                for n in names {
                    if !n.as_str().is_some_and(|n| TYPES.contains(&n)) {
                        return Err(format!("{at}: unknown type {n}"));
                    }
                }
            }
            "properties" => {
                let props = v
                    .as_object()
                    .ok_or_else(|| format!("{at}: `properties` must be an object"))?;
                for (name, sub) in props {
                    check_schema_at(sub, &format!("{at}/properties/{name}"))?;
                }
            }
            "required" => {
                let names = v
                    .as_array()
                    .ok_or_else(|| format!("{at}: `required` must be an array"))?;
                let props = obj.get("properties").and_then(Value::as_object);
                for n in names {
                    let n = n
                        .as_str()
                        .ok_or_else(|| format!("{at}: `required` holds names"))?;
                    if !props.is_some_and(|p| p.contains_key(n)) {
                        return Err(format!("{at}: required `{n}` is not among the properties"));
                    }
                }
            }
            "additionalProperties" => match v {
                Value::Bool(_) => {}
                sub => check_schema_at(sub, &format!("{at}/additionalProperties"))?,
            },
            "items" => check_schema_at(v, &format!("{at}/items"))?,
            "enum" => {
                if v.as_array().is_none_or(|a| a.is_empty()) {
                    return Err(format!("{at}: `enum` must be a non-empty array"));
                }
            }
            "minimum" | "maximum" => {
                if !v.is_number() {
                    return Err(format!("{at}: `{k}` must be a number"));
                }
            }
            "minLength" | "maxLength" => {
                if v.as_u64().is_none() {
                    return Err(format!("{at}: `{k}` must be a non-negative integer"));
                }
            }
            k if ANNOTATIONS.contains(&k) => {}
            k => {
                return Err(format!(
                    "{at}: keyword `{k}` is not supported (supported: {})",
                    KEYWORDS.join(", ")
                ))
            }
        }
    }
    Ok(())
}

fn field(path: &str) -> String {
    if path.is_empty() {
        "the arguments".to_string()
    } else {
        format!("`{path}`")
    }
}

fn child(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// "a string", "an integer", … with a short rendering of the value.
fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => return "null".into(),
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    let mut shown = v.to_string();
    if shown.len() > 40 {
        shown = format!("{}…", skein_core::text::clip(&shown, 37));
    }
    format!("{kind} ({shown})")
}

fn is_type(v: &Value, name: &str) -> bool {
    match name {
        "object" => v.is_object(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "array" => v.is_array(),
        "null" => v.is_null(),
        "number" => v.is_number(),
        "integer" => match v {
            Value::Number(n) => {
                n.is_i64() || n.is_u64() || n.as_f64().is_some_and(|f| f.fract() == 0.0)
            }
            _ => false,
        },
        _ => true,
    }
}

fn article(name: &str) -> String {
    match name {
        "object" | "integer" | "array" => format!("an {name}"),
        "null" => "null".into(),
        _ => format!("a {name}"),
    }
}

fn check(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    let Some(s) = schema.as_object() else {
        return;
    };
    if let Some(t) = s.get("type") {
        let names: Vec<&str> = match t {
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            Value::String(n) => vec![n.as_str()],
            _ => vec![],
        };
        if !names.is_empty() && !names.iter().any(|n| is_type(value, n)) {
            let wanted: Vec<String> = names.iter().map(|n| article(n)).collect();
            errors.push(format!(
                "{} must be {}, got {}",
                field(path),
                wanted.join(" or "),
                describe(value)
            ));
            return;
        }
    }
    if let Some(options) = s.get("enum").and_then(Value::as_array) {
        if !options.contains(value) {
            let shown: Vec<String> = options.iter().map(Value::to_string).collect();
            errors.push(format!(
                "{} must be one of {}, got {}",
                field(path),
                shown.join(", "),
                describe(value)
            ));
        }
    }
    match value {
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if let Some(min) = s.get("minimum").and_then(Value::as_f64) {
                if x < min {
                    errors.push(format!("{} must be at least {min}, got {n}", field(path)));
                }
            }
            if let Some(max) = s.get("maximum").and_then(Value::as_f64) {
                if x > max {
                    errors.push(format!("{} must be at most {max}, got {n}", field(path)));
                }
            }
        }
        Value::String(text) => {
            let len = text.chars().count() as u64;
            if let Some(min) = s.get("minLength").and_then(Value::as_u64) {
                if len < min {
                    errors.push(format!(
                        "{} must be at least {min} characters long, got {len}",
                        field(path)
                    ));
                }
            }
            if let Some(max) = s.get("maxLength").and_then(Value::as_u64) {
                if len > max {
                    errors.push(format!(
                        "{} must be at most {max} characters long, got {len}",
                        field(path)
                    ));
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = s.get("items") {
                for (i, item) in items.iter().enumerate() {
                    check(item_schema, item, &format!("{path}[{i}]"), errors);
                }
            }
        }
        Value::Object(obj) => check_object(s, obj, path, errors),
        Value::Null | Value::Bool(_) => {}
    }
}

fn check_object(
    s: &Map<String, Value>,
    obj: &Map<String, Value>,
    path: &str,
    errors: &mut Vec<String>,
) {
    let empty = Map::new();
    let props = s
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    if let Some(required) = s.get("required").and_then(Value::as_array) {
        for name in required.iter().filter_map(Value::as_str) {
            if !obj.contains_key(name) {
                errors.push(format!(
                    "{} is required but missing",
                    field(&child(path, name))
                ));
            }
        }
    }
    for (key, v) in obj {
        if let Some(sub) = props.get(key) {
            check(sub, v, &child(path, key), errors);
            continue;
        }
        match s.get("additionalProperties") {
            Some(Value::Bool(false)) => {
                let known: Vec<&str> = props.keys().map(String::as_str).collect();
                let allowed = if known.is_empty() {
                    "none are accepted".to_string()
                } else {
                    format!("accepted: {}", known.join(", "))
                };
                errors.push(format!(
                    "{} is not a known argument ({allowed})",
                    field(&child(path, key))
                ));
            }
            Some(sub @ Value::Object(_)) => check(sub, v, &child(path, key), errors),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::de::DeserializeOwned;
    use serde_json::json;

    use super::*;
    use crate::config::ToolsConfig;
    use crate::{files, http, search, shell, Tool};

    /// The tool's schema is the one derived from `T`, the generator left nothing the
    /// validator does not enforce, and `example` passes the validator and deserializes.
    fn derived_from<T: JsonSchema + DeserializeOwned>(tool: &dyn Tool, example: Value) {
        let name = tool.name();
        let schema = tool.parameters();
        let mut expected = derived::<T>();
        if name == "search_files" {
            // The one bound that comes from the configuration.
            expected["properties"]["max_matches"]["maximum"] =
                schema["properties"]["max_matches"]["maximum"].clone();
        }
        assert_eq!(schema, expected, "{name}: not the derived schema");
        assert_eq!(check_schema(&schema), Ok(()), "{name}");
        assert_eq!(schema["additionalProperties"], json!(false), "{name}");
        assert_eq!(validate(&schema, &example), Ok(()), "{name}: {example}");
        if let Err(e) = serde_json::from_value::<T>(example) {
            panic!("{name}: the example validates but does not deserialize: {e}");
        }
        // A misspelt argument is refused by name.
        let errs = validate(&schema, &json!({"no_such_argument": 1})).unwrap_err();
        assert!(
            errs.iter()
                .any(|e| e.contains("`no_such_argument` is not a known argument")),
            "{name}: {errs:?}"
        );
    }

    #[test]
    fn every_builtin_schema_is_derived_and_takes_its_example() {
        let cfg = ToolsConfig::default();
        derived_from::<files::ListArgs>(&files::ListDir::new(cfg.files.clone()), json!({}));
        derived_from::<files::InfoArgs>(
            &files::GetFileInfo::new(cfg.files.clone()),
            json!({"path": "src/main.rs"}),
        );
        derived_from::<files::ReadArgs>(
            &files::ReadFile::new(cfg.files.clone()),
            json!({"path": "notes.txt", "offset": 10}),
        );
        derived_from::<files::WriteArgs>(
            &files::WriteFile::new(cfg.files.clone()),
            json!({"path": "out/é.txt", "content": "hello"}),
        );
        derived_from::<search::SearchArgs>(
            &search::SearchFiles::new(cfg.search.clone()),
            json!({"pattern": "fn \\w+", "regex": true, "path": "src",
                   "case_sensitive": false, "max_matches": 3}),
        );
        derived_from::<http::FetchArgs>(
            &http::HttpFetch::new(cfg.http.clone()),
            json!({"url": "https://example.com/", "method": "POST",
                   "headers": {"accept": "text/plain"}, "body": "x"}),
        );
        derived_from::<shell::ShellArgs>(
            &shell::Shell::new(cfg.shell.clone()),
            json!({"command": "ls -l"}),
        );
    }

    #[test]
    fn derived_schemas_keep_required_fields_enums_and_bounds() {
        let cfg = ToolsConfig::default();
        let fetch = http::HttpFetch::new(cfg.http.clone()).parameters();
        assert_eq!(fetch["required"], json!(["url"]));
        assert_eq!(
            fetch["properties"]["method"]["enum"],
            json!(["GET", "POST"])
        );
        assert_eq!(fetch["properties"]["method"]["type"], json!("string"));
        assert_eq!(fetch["properties"]["url"]["minLength"], json!(1));
        let errs = validate(
            &fetch,
            &json!({"url": "https://a.example", "method": "PUT"}),
        )
        .unwrap_err();
        assert_eq!(
            errs,
            vec![r#"`method` must be one of "GET", "POST", got a string ("PUT")"#]
        );
        // An `Option` argument is optional, not nullable.
        let errs =
            validate(&fetch, &json!({"url": "https://a.example", "body": null})).unwrap_err();
        assert_eq!(errs, vec!["`body` must be a string, got null"]);

        let search = search::SearchFiles::new(cfg.search.clone()).parameters();
        assert_eq!(search["required"], json!(["pattern"]));
        assert_eq!(search["properties"]["max_matches"]["minimum"], json!(1));
        assert_eq!(
            search["properties"]["max_matches"]["maximum"],
            json!(cfg.search.max_matches.max(1))
        );
        assert_eq!(
            search["properties"]["pattern"]["description"],
            json!("Text to find; a regular expression (Rust syntax) when `regex` is true.")
        );
        let write = files::WriteFile::new(cfg.files.clone()).parameters();
        assert_eq!(write["required"], json!(["path", "content"]));
    }
}
