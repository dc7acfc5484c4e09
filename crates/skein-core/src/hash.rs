//! The mission hash: blake3 over a canonical encoding of what determines a sub-agent's
//! answer. Stable across platforms, runs and serde feature sets.
//!
//! Encoding (version 1): the domain tag `skein/mission/v1`, then for each field in this
//! order — definition digest, model, mission, context, inputs, strategy — an 8-byte
//! little-endian length followed by the field's UTF-8 bytes. `context` and `strategy` are
//! the empty string when absent; `inputs` is canonical JSON (object keys sorted by their
//! UTF-8 bytes, no whitespace, `null` when absent).
//!
//! Version 2 adds one more field after those six: the [`RunShape`] as canonical JSON,
//! everything besides the mission that can change a run's answer (the tools left after
//! every narrowing, how much deeper it may delegate, its budget, the limits in force, the
//! agents its path forbids it to start, the request a pattern passes on). Every key the
//! runtime computes now has it; a key without it is a version 1 key.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::limits::{Budget, Limits};

/// What shapes a run besides its mission, definition and model: two runs of one agent on
/// one mission whose shapes differ may answer differently (a tool narrowed away, a
/// delegation refused for depth or budget, an agent already on the path), so they never
/// share a cache entry or a single-flight run. Recorded with a cache hit, so that a person
/// can see why it hit.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RunShape {
    /// The tools the run may call, after its definition, `allowed_tools` and any grant.
    pub tools: Vec<String>,
    /// Delegation levels left under it (`max_depth` minus its depth).
    pub depth_left: u32,
    /// What it may spend.
    pub budget: Budget,
    /// Digest of the runtime's `[limits]` (canonical JSON, blake3, 16 hex digits).
    pub limits: String,
    /// Agents on its path that it could start (directly or through its own children)
    /// and that the ancestry rule therefore refuses, sorted.
    pub on_path: Vec<String>,
    /// Digest of the request a pattern passes on, if it is a pattern's child.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// Digest of the definitions of every agent the run may start, directly or through
    /// the sessions it starts ([`RunShape::reach_digest`]): a cached answer made with a
    /// sub-agent's earlier definition is not the answer its new one gives. None for an
    /// agent that starts nobody (whose keys are as they were before this part existed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reach: Option<String>,
}

impl RunShape {
    /// The digest of `limits` as [`RunShape::limits`] holds it.
    pub fn limits_digest(limits: &Limits) -> String {
        let v = serde_json::to_value(limits).unwrap_or(Value::Null);
        blake3::hash(canonical_json(&v).as_bytes()).to_hex()[..16].to_string()
    }

    /// The digest of the definitions of `reachable` (each agent's name and the digest of
    /// its definition's text, or `-` for one the set lacks) as [`RunShape::reach`] holds
    /// it; none when nothing is reachable.
    pub fn reach_digest<'a>(
        reachable: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
    ) -> Option<String> {
        let mut h = blake3::Hasher::new();
        let mut any = false;
        for (name, digest) in reachable {
            any = true;
            for field in [name, digest.unwrap_or("-")] {
                h.update(&(field.len() as u64).to_le_bytes());
                h.update(field.as_bytes());
            }
        }
        any.then(|| h.finalize().to_hex()[..16].to_string())
    }

    /// The digest of a pattern's request as [`RunShape::request`] holds it.
    pub fn request_digest(request: &str) -> String {
        blake3::hash(request.as_bytes()).to_hex()[..16].to_string()
    }

    fn canonical(&self) -> String {
        canonical_json(&serde_json::to_value(self).unwrap_or(Value::Null))
    }
}

/// The parts of a cache key a person reads: everything the hash covers, the long texts
/// (mission, context, inputs) as one digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyParts {
    pub def_digest: String,
    pub model: String,
    /// blake3 of mission, context and inputs (16 hex digits).
    pub input_digest: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    #[serde(flatten)]
    pub shape: RunShape,
}

#[derive(Debug, Clone, Copy)]
pub struct MissionKey<'a> {
    pub def_digest: &'a str,
    pub model: &'a str,
    pub mission: &'a str,
    pub context: Option<&'a str>,
    pub inputs: &'a Value,
    pub strategy: Option<&'a str>,
    /// Version 2: the shape of the run. None only for version 1 keys.
    pub shape: Option<&'a RunShape>,
}

impl MissionKey<'_> {
    /// The key's parts, for a person to read.
    pub fn parts(&self) -> KeyParts {
        let mut h = blake3::Hasher::new();
        for field in [
            self.mission,
            self.context.unwrap_or(""),
            canonical_json(self.inputs).as_str(),
        ] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        KeyParts {
            def_digest: self.def_digest.to_string(),
            model: self.model.to_string(),
            input_digest: h.finalize().to_hex()[..16].to_string(),
            strategy: self.strategy.map(str::to_string),
            shape: self.shape.cloned().unwrap_or_default(),
        }
    }
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
    if let Some(shape) = k.shape {
        let field = shape.canonical();
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
            shape: None,
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
            shape: None,
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

    #[test]
    fn every_part_of_the_shape_matters() {
        let i = json!({});
        let shape = RunShape {
            tools: vec!["list_dir".into(), "read_file".into()],
            depth_left: 2,
            budget: Budget::default(),
            limits: RunShape::limits_digest(&Limits::default()),
            on_path: vec![],
            request: None,
            reach: None,
        };
        let key = |s: &RunShape| {
            mission_hash(&MissionKey {
                def_digest: "d",
                model: "m",
                mission: "x",
                context: None,
                inputs: &i,
                strategy: None,
                shape: Some(s),
            })
        };
        let h = key(&shape);
        let v1 = mission_hash(&MissionKey {
            def_digest: "d",
            model: "m",
            mission: "x",
            context: None,
            inputs: &i,
            strategy: None,
            shape: None,
        });
        assert_ne!(h, v1, "a shaped key is never a version 1 key");
        let narrowed = RunShape {
            tools: vec!["list_dir".into()],
            ..shape.clone()
        };
        assert_ne!(h, key(&narrowed));
        let shallower = RunShape {
            depth_left: 0,
            ..shape.clone()
        };
        assert_ne!(h, key(&shallower));
        let budgeted = RunShape {
            budget: Budget {
                tokens: Some(10),
                max_steps: None,
            },
            ..shape.clone()
        };
        assert_ne!(h, key(&budgeted));
        let limits = RunShape {
            limits: RunShape::limits_digest(&Limits {
                max_steps: 3,
                ..Limits::default()
            }),
            ..shape.clone()
        };
        assert_ne!(h, key(&limits));
        let on_path = RunShape {
            on_path: vec!["writer".into()],
            ..shape.clone()
        };
        assert_ne!(h, key(&on_path));
        let request = RunShape {
            request: Some(RunShape::request_digest("r")),
            ..shape.clone()
        };
        assert_ne!(h, key(&request));
        let reach = RunShape {
            reach: RunShape::reach_digest([("helper", Some("d1"))]),
            ..shape.clone()
        };
        assert_ne!(h, key(&reach));
        let changed = RunShape {
            reach: RunShape::reach_digest([("helper", Some("d2"))]),
            ..shape.clone()
        };
        assert_ne!(
            key(&reach),
            key(&changed),
            "a sub-agent's new definition makes a new key"
        );
        assert_eq!(RunShape::reach_digest([]), None);
        assert_eq!(h, key(&shape.clone()), "the same shape, the same key");
    }
}
