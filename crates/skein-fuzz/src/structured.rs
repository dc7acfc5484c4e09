//! Structure-aware edits: a seed read as JSON, msgpack or YAML, one node of its tree
//! changed (boundary numbers, long or multi-byte strings, dropped or added keys, deep
//! nesting), written back in the same format. Reaches the checks behind a successful
//! parse far more often than byte edits do.

use rand::Rng as _;
use serde_json::{Map, Number, Value};

use crate::mutate::{multibyte_char, Dict};
use crate::Rng;

/// A random JSON value, at most `depth` levels deep.
pub fn random_value(rng: &mut Rng, dict: &Dict, depth: u32) -> Value {
    let top = if depth == 0 { 5 } else { 7 };
    match rng.gen_range(0..top) {
        0 => Value::Null,
        1 => Value::Bool(rng.gen()),
        2 => boundary_number(rng),
        3 | 4 => Value::String(awkward_string(rng, dict)),
        5 => Value::Array(
            (0..rng.gen_range(0..4))
                .map(|_| random_value(rng, dict, depth - 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.gen_range(0..4))
                .map(|_| (dict.pick_str(rng), random_value(rng, dict, depth - 1)))
                .collect(),
        ),
    }
}

/// Numbers at the edges of the integer types and of `f64`.
pub fn boundary_number(rng: &mut Rng) -> Value {
    match rng.gen_range(0..14) {
        0 => Value::from(u64::MAX),
        1 => Value::from(i64::MIN),
        2 => Value::from(i64::MAX),
        3 => Value::from(-1),
        4 => Value::from(0),
        5 => Value::from(1u64 << 32),
        6 => Value::from(u64::from(u32::MAX)),
        7 => Value::from(u64::from(u16::MAX) + 1),
        8 => Value::from((1u64 << 53) + 1),
        9 => Number::from_f64(1e308).map_or(Value::Null, Value::Number),
        10 => Number::from_f64(-0.5).map_or(Value::Null, Value::Number),
        11 => Value::from(rng.gen::<u64>()),
        12 => Value::from(rng.gen_range(0..100u64)),
        _ => Value::from(rng.gen::<i64>()),
    }
}

/// Strings that break naive code: long ones, multi-byte characters at chosen byte
/// offsets, control characters, path and subject syntax.
pub fn awkward_string(rng: &mut Rng, dict: &Dict) -> String {
    match rng.gen_range(0..10) {
        0 => String::new(),
        1 => {
            // Long, with a multi-byte character somewhere (often near a boundary).
            let n = [15, 16, 17, 63, 64, 65, 200, 513, 5000][rng.gen_range(0..9)];
            let mut s: String = "a".repeat(n);
            let at = [14, 15, 16, 17, 63, 64][rng.gen_range(0..6)].min(s.len());
            s.insert(at, multibyte_char(rng));
            s
        }
        2 => (0..rng.gen_range(1..40))
            .map(|_| multibyte_char(rng))
            .collect(),
        3 => [
            "\u{1b}]0;title\u{7}",
            "\u{1b}[2K\r",
            "\u{0}",
            "\r\n\r\n",
            "\u{202e}",
        ][rng.gen_range(0..5)]
        .to_string(),
        4 => [
            "../../etc/passwd",
            "/etc/passwd",
            "a.>",
            "*",
            "a/../..",
            ".",
            "~",
        ][rng.gen_range(0..7)]
        .to_string(),
        5 => "x".repeat(1 << rng.gen_range(8..16)),
        _ => dict.pick_str(rng),
    }
}

fn count(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count).sum(),
        Value::Object(o) => o.values().map(count).sum(),
        _ => 0,
    }
}

/// Changes `v` in 1 to 3 places.
pub fn mutate_value(rng: &mut Rng, v: &mut Value, dict: &Dict) {
    // One deep nesting per change at most: the fuzzer's own recursion over the value
    // must stay well inside the stack the targets run on.
    let mut nested = false;
    for _ in 0..rng.gen_range(1..=3) {
        let n = count(v);
        let k = rng.gen_range(0..n);
        edit_node(rng, v, k, dict, &mut nested);
    }
}

fn edit_node(rng: &mut Rng, v: &mut Value, k: usize, dict: &Dict, nested: &mut bool) {
    // The k-th node in pre-order.
    fn walk<'a>(v: &'a mut Value, k: &mut usize) -> Option<&'a mut Value> {
        if *k == 0 {
            return Some(v);
        }
        *k -= 1;
        match v {
            Value::Array(a) => {
                for x in a.iter_mut() {
                    let c = count(x);
                    if *k < c {
                        return walk(x, k);
                    }
                    *k -= c;
                }
                None
            }
            Value::Object(o) => {
                for x in o.values_mut() {
                    let c = count(x);
                    if *k < c {
                        return walk(x, k);
                    }
                    *k -= c;
                }
                None
            }
            _ => None,
        }
    }
    let mut k = k;
    let Some(node) = walk(v, &mut k) else {
        return;
    };
    match rng.gen_range(0..12) {
        0 => *node = boundary_number(rng),
        1 => *node = Value::String(awkward_string(rng, dict)),
        2 => *node = random_value(rng, dict, 3),
        3 => {
            *node = match rng.gen_range(0..4) {
                0 => Value::Null,
                1 => Value::Bool(rng.gen()),
                2 => Value::Array(vec![]),
                _ => Value::Object(Map::new()),
            }
        }
        4 if !*nested => {
            *nested = true;
            // Nest around the decoders' limits (serde_json stops at 128, rmp-serde at
            // 1024).
            let depth = [10, 127, 129, 300, 1023, 1025][rng.gen_range(0..6)];
            let mut inner = std::mem::take(node);
            for _ in 0..depth {
                inner = Value::Array(vec![inner]);
            }
            *node = inner;
        }
        5 | 6 => match node {
            Value::Object(o) if !o.is_empty() && rng.gen_bool(0.5) => {
                let key = o.keys().nth(rng.gen_range(0..o.len())).cloned();
                if let Some(key) = key {
                    o.remove(&key);
                }
            }
            Value::Object(o) => {
                o.insert(dict.pick_str(rng), random_value(rng, dict, 2));
            }
            Value::Array(a) if !a.is_empty() && rng.gen_bool(0.5) => {
                let i = rng.gen_range(0..a.len());
                if rng.gen_bool(0.5) {
                    a.remove(i);
                } else {
                    let copy = a[i].clone();
                    let times = [1, 2, 15, 100][rng.gen_range(0..4)];
                    for _ in 0..times {
                        a.push(copy.clone());
                    }
                }
            }
            Value::Array(a) => a.push(random_value(rng, dict, 2)),
            _ => *node = random_value(rng, dict, 2),
        },
        7 | 8 => match node {
            Value::String(s) => {
                let mut b = s.clone();
                match rng.gen_range(0..4) {
                    0 => b.push_str(&dict.pick_str(rng)),
                    1 => {
                        let at = (0..=b.len())
                            .filter(|i| b.is_char_boundary(*i))
                            .nth(rng.gen_range(0..=b.chars().count()))
                            .unwrap_or(0);
                        b.insert(at, multibyte_char(rng));
                    }
                    2 => b = b.repeat(rng.gen_range(2..20)),
                    _ => b = dict.pick_str(rng),
                }
                *s = b;
            }
            Value::Number(_) => *node = boundary_number(rng),
            Value::Bool(b) => *b = !*b,
            _ => *node = Value::String(awkward_string(rng, dict)),
        },
        9 => {
            // Rename a key to a dictionary word (often another field's name).
            if let Value::Object(o) = node {
                if let Some(key) = o.keys().nth(rng.gen_range(0..o.len().max(1))).cloned() {
                    if let Some(val) = o.remove(&key) {
                        o.insert(dict.pick_str(rng), val);
                    }
                }
            }
        }
        _ => *node = Value::String(dict.pick_str(rng)),
    }
}

/// A JSON seed changed in its structure; none when the seed is not JSON.
pub fn reshape_json(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(seed).ok()?;
    mutate_value(rng, &mut v, dict);
    if rng.gen_bool(0.8) {
        serde_json::to_vec(&v).ok()
    } else {
        pretty_or_compact(&v)
    }
}

/// `v` pretty-printed, or compact when that would pass [`PRETTY_MAX`] bytes. Pretty
/// printing indents every line by its depth: a wide array wrapped a thousand levels deep
/// prints to tens of megabytes, which the byte mutations then scanned (seconds of CPU
/// between two inputs, reported as a hang of the input before them).
fn pretty_or_compact(v: &Value) -> Option<Vec<u8>> {
    let mut out = Capped(Vec::new());
    match serde_json::to_writer_pretty(&mut out, v) {
        Ok(()) => Some(out.0),
        Err(_) => serde_json::to_vec(v).ok(),
    }
}

/// The most bytes a pretty-printed reshape may take (see [`reshape_json`]).
pub const PRETTY_MAX: usize = 1 << 20;

/// A writer that refuses to grow past [`PRETTY_MAX`].
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > PRETTY_MAX {
            return Err(std::io::Error::other("over the cap"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A msgpack seed changed in its structure (maps keep string keys, so fields stay named).
pub fn reshape_msgpack(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let mut v: Value = rmp_serde::from_slice(seed).ok()?;
    mutate_value(rng, &mut v, dict);
    rmp_serde::to_vec_named(&v).ok()
}

/// A YAML document changed in its structure, or textually given an anchor and aliases
/// (what a parser must not expand without bound).
pub fn reshape_yaml(rng: &mut Rng, yaml: &str, dict: &Dict) -> Option<String> {
    if rng.gen_bool(0.25) {
        return Some(alias_lines(rng, yaml));
    }
    let mut v: Value = serde_norway::from_str(yaml).ok()?;
    mutate_value(rng, &mut v, dict);
    serde_norway::to_string(&v).ok()
}

/// Puts an anchor on one `key: value` line and makes other values aliases of it.
fn alias_lines(rng: &mut Rng, yaml: &str) -> String {
    let lines: Vec<&str> = yaml.lines().collect();
    let with_value: Vec<usize> = (0..lines.len())
        .filter(|&i| {
            lines[i]
                .split_once(": ")
                .is_some_and(|(_, v)| !v.trim().is_empty())
        })
        .collect();
    if with_value.is_empty() {
        return yaml.to_string();
    }
    let anchor = with_value[rng.gen_range(0..with_value.len())];
    let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    if let Some((k, v)) = lines[anchor].split_once(": ") {
        out[anchor] = format!("{k}: &fz {v}");
    }
    for _ in 0..rng.gen_range(1..4) {
        let i = with_value[rng.gen_range(0..with_value.len())];
        if i == anchor {
            continue;
        }
        if let Some((k, _)) = lines[i].split_once(": ") {
            let n = [1, 2, 50, 500][rng.gen_range(0..4)];
            let aliases = vec!["*fz"; n].join(", ");
            out[i] = format!("{k}: [{aliases}]");
        }
    }
    let mut s = out.join("\n");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    /// Deep values need more stack than a debug test thread has.
    fn with_stack(f: impl FnOnce() + Send + 'static) {
        std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn(f)
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn json_reshapes_stay_json_and_differ() {
        with_stack(json_reshapes);
    }

    fn json_reshapes() {
        let mut rng = Rng::seed_from_u64(1);
        let dict = Dict::new(&[], &["agent", "mission"]);
        let seed = br#"{"agent":"writer","mission":"m","inputs":{"n":3}}"#;
        let mut differ = 0;
        for _ in 0..500 {
            let out = reshape_json(&mut rng, seed, &dict).unwrap();
            // Valid JSON, unless nested past the parser's limit on purpose.
            let deep = out.iter().filter(|b| **b == b'[').count() >= 120;
            assert!(serde_json::from_slice::<Value>(&out).is_ok() || deep);
            differ += usize::from(out != seed);
        }
        assert!(differ > 400, "{differ}");
    }

    /// A wide value wrapped deep would pretty-print to tens of megabytes: it is printed
    /// compact instead, and a small one still pretty.
    #[test]
    fn a_wide_value_nested_deep_is_not_pretty_printed() {
        with_stack(|| {
            let mut v = Value::Array((0..8000).map(Value::from).collect());
            for _ in 0..1025 {
                v = Value::Array(vec![v]);
            }
            let out = pretty_or_compact(&v).unwrap();
            assert_eq!(out, serde_json::to_vec(&v).unwrap());
            assert!(out.len() <= PRETTY_MAX);
            drop_deep(v);
            let small = serde_json::json!({"answers": [1, 2]});
            assert_eq!(
                pretty_or_compact(&small).unwrap(),
                serde_json::to_vec_pretty(&small).unwrap()
            );
        });
    }

    /// Drops a deeply nested value without recursing once per level.
    fn drop_deep(mut v: Value) {
        while let Value::Array(mut a) = v {
            v = a.pop().unwrap_or(Value::Null);
        }
    }

    #[test]
    fn msgpack_reshapes_decode() {
        with_stack(msgpack_reshapes);
    }

    fn msgpack_reshapes() {
        let mut rng = Rng::seed_from_u64(2);
        let dict = Dict::new(&[], &[]);
        let seed = rmp_serde::to_vec_named(&serde_json::json!({"seq": 1, "prev": "ab"})).unwrap();
        let mut decoded = 0;
        for _ in 0..200 {
            let out = reshape_msgpack(&mut rng, &seed, &dict).unwrap();
            decoded += usize::from(rmp_serde::from_slice::<Value>(&out).is_ok());
        }
        // Only values nested deeper than the decoder's limit are refused.
        assert!(decoded > 180, "{decoded}");
    }

    #[test]
    fn aliases_are_written() {
        let mut rng = Rng::seed_from_u64(3);
        let out = alias_lines(&mut rng, "name: a\nmodel: b:c\ndescription: d\n");
        assert!(out.contains("&fz"), "{out}");
    }
}
