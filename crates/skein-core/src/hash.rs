//! The mission hash: blake3 over a canonical encoding of what determines a sub-agent's
//! answer. Stable across platforms, runs and serde feature sets.
//!
//! Encoding (version 1): the domain tag `skein/mission/v1`, then for each field in this
//! order — definition digest, model, mission, context, inputs, strategy — an 8-byte
//! little-endian length followed by the field's UTF-8 bytes. `context` and `strategy` are
//! the empty string when absent; `inputs` is canonical JSON (object keys sorted by their
//! UTF-8 bytes, no whitespace, `null` when absent).

use serde_json::Value;

#[derive(Debug, Clone, Copy)]
pub struct MissionKey<'a> {
    pub def_digest: &'a str,
    pub model: &'a str,
    pub mission: &'a str,
    pub context: Option<&'a str>,
    pub inputs: &'a Value,
    pub strategy: Option<&'a str>,
}

pub fn mission_hash(k: &MissionKey<'_>) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"skein/mission/v1");
    let inputs = canonical_json(k.inputs);
    for field in [
        k.def_digest,
        k.model,
        k.mission,
        k.context.unwrap_or(""),
        inputs.as_str(),
        k.strategy.unwrap_or(""),
    ] {
        h.update(&(field.len() as u64).to_le_bytes());
        h.update(field.as_bytes());
    }
    h.finalize().to_hex().to_string()
}

/// JSON with object keys sorted, no insignificant whitespace.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                write_canonical(&map[k.as_str()], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pinned_hash_of_a_fixed_mission() {
        let inputs = json!({"b": [1, 2], "a": {"y": true, "x": null}});
        let k = MissionKey {
            def_digest: "d1",
            model: "scripted:researcher",
            mission: "Research event sourcing",
            context: Some("for a brief"),
            inputs: &inputs,
            strategy: None,
        };
        assert_eq!(
            canonical_json(&inputs),
            r#"{"a":{"x":null,"y":true},"b":[1,2]}"#
        );
        // Pinned: a change here changes every cache key in every deployment.
        assert_eq!(
            mission_hash(&k),
            "fee6e191dd84031f6464d6499bbddb008383d05784941e50b3e68abfeef4178d"
        );
    }

    #[test]
    fn every_field_matters() {
        let i = json!({});
        let base = MissionKey {
            def_digest: "d",
            model: "m",
            mission: "x",
            context: None,
            inputs: &i,
            strategy: None,
        };
        let h = mission_hash(&base);
        assert_ne!(
            h,
            mission_hash(&MissionKey {
                def_digest: "d2",
                ..base
            })
        );
        assert_ne!(
            h,
            mission_hash(&MissionKey {
                model: "m2",
                ..base
            })
        );
        assert_ne!(
            h,
            mission_hash(&MissionKey {
                mission: "y",
                ..base
            })
        );
        assert_ne!(
            h,
            mission_hash(&MissionKey {
                context: Some("c"),
                ..base
            })
        );
        assert_ne!(
            h,
            mission_hash(&MissionKey {
                strategy: Some("s"),
                ..base
            })
        );
        let j = json!({"k": 1});
        assert_ne!(h, mission_hash(&MissionKey { inputs: &j, ..base }));
        // Field boundaries are unambiguous.
        let a = MissionKey {
            mission: "ab",
            context: Some("c"),
            ..base
        };
        let b = MissionKey {
            mission: "a",
            context: Some("bc"),
            ..base
        };
        assert_ne!(mission_hash(&a), mission_hash(&b));
    }
}
