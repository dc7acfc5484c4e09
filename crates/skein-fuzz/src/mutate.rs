//! Byte-level mutations, and the dictionary they draw tokens from.

use std::collections::BTreeSet;

use rand::Rng as _;

use crate::Rng;

/// Tokens worth inserting whole: words taken from the seeds, plus each target's own.
#[derive(Debug, Clone, Default)]
pub struct Dict {
    words: Vec<Vec<u8>>,
}

/// Tokens useful to every parser: boundaries of numbers, characters that end or escape
/// strings, multi-byte and control characters.
const COMMON: &[&str] = &[
    "0",
    "-1",
    "255",
    "256",
    "65535",
    "65536",
    "2147483647",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "1e308",
    "1e309",
    "-0",
    "0.5",
    "null",
    "true",
    "false",
    "\"",
    "\\",
    "\\u0000",
    "\\ud800",
    "\n",
    "\r\n",
    "\t",
    "é",
    "€",
    "😀",
    "\u{202e}",
    "\u{1b}[2J",
    "\u{7}",
    "\u{0}",
    "..",
    "../",
    "/",
    ".",
    ">",
    "*",
];

impl Dict {
    /// Words of 2 to 32 letters, digits, `_` or `-` found in the seeds, plus `extra` and
    /// the common tokens; at most 4096 of them.
    pub fn new(seeds: &[Vec<u8>], extra: &[&str]) -> Self {
        let mut set: BTreeSet<Vec<u8>> = BTreeSet::new();
        for s in seeds {
            let mut start = None;
            for (i, b) in s
                .iter()
                .enumerate()
                .chain(std::iter::once((s.len(), &b' ')))
            {
                let word = b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-';
                match (word, start) {
                    (true, None) => start = Some(i),
                    (false, Some(st)) => {
                        if (2..=32).contains(&(i - st)) {
                            set.insert(s[st..i].to_vec());
                        }
                        start = None;
                    }
                    _ => {}
                }
            }
        }
        let mut words: Vec<Vec<u8>> = set.into_iter().take(4096).collect();
        words.extend(extra.iter().chain(COMMON).map(|w| w.as_bytes().to_vec()));
        Self { words }
    }

    pub fn len(&self) -> usize {
        self.words.len()
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// A random token (empty when the dictionary is).
    pub fn pick(&self, rng: &mut Rng) -> &[u8] {
        if self.words.is_empty() {
            return b"";
        }
        &self.words[rng.gen_range(0..self.words.len())]
    }

    /// A random token as text.
    pub fn pick_str(&self, rng: &mut Rng) -> String {
        String::from_utf8_lossy(self.pick(rng)).into_owned()
    }
}

const INTERESTING_BYTES: &[u8] = &[
    0x00, 0x01, 0x7f, 0x80, 0xff, 0xfe, 0xc0, 0xc3, 0xe2, 0xf0, b'"', b'\'', b'\\', b'{', b'}',
    b'[', b']', b':', b',', b'.', b'/', b'-', b'&', b'*', b'!', b'|', b'>', b'#', b'%', b'\n',
    b'\r', b'\t', b' ',
];

/// A random character of 2, 3 or 4 bytes in UTF-8.
pub fn multibyte_char(rng: &mut Rng) -> char {
    const CHARS: &[char] = &['é', 'ß', 'Ж', '€', '中', '\u{fffd}', '\u{202e}', '😀', '𝄞'];
    CHARS[rng.gen_range(0..CHARS.len())]
}

fn range(rng: &mut Rng, len: usize) -> (usize, usize) {
    if len == 0 {
        return (0, 0);
    }
    let start = rng.gen_range(0..len);
    let max = (len - start).min(1 << rng.gen_range(0..12));
    (
        start,
        start + rng.gen_range(1..=max.max(1)).min(len - start),
    )
}

/// Applies 1 to 8 random edits to `data`, keeping it at most `max_len` bytes. `others`
/// are corpus entries to splice from.
pub fn mutate_bytes(
    rng: &mut Rng,
    data: &mut Vec<u8>,
    others: &[Vec<u8>],
    dict: &Dict,
    max_len: usize,
) {
    let edits = 1usize << rng.gen_range(0..4);
    for _ in 0..edits {
        edit(rng, data, others, dict);
    }
    data.truncate(max_len);
}

fn edit(rng: &mut Rng, data: &mut Vec<u8>, others: &[Vec<u8>], dict: &Dict) {
    let len = data.len();
    let at = |rng: &mut Rng| if len == 0 { 0 } else { rng.gen_range(0..=len) };
    match rng.gen_range(0..14) {
        0 if len > 0 => {
            let i = rng.gen_range(0..len);
            data[i] ^= 1 << rng.gen_range(0..8);
        }
        1 if len > 0 => {
            let i = rng.gen_range(0..len);
            data[i] = rng.gen();
        }
        2 if len > 0 => {
            let i = rng.gen_range(0..len);
            data[i] = INTERESTING_BYTES[rng.gen_range(0..INTERESTING_BYTES.len())];
        }
        3 => {
            let i = at(rng);
            let n = rng.gen_range(1..=8);
            let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            data.splice(i..i, bytes);
        }
        4 => {
            // A run of one byte: long tokens, deep nesting, big numbers.
            let i = at(rng);
            let b = if len > 0 && rng.gen_bool(0.5) {
                data[rng.gen_range(0..len)]
            } else {
                INTERESTING_BYTES[rng.gen_range(0..INTERESTING_BYTES.len())]
            };
            let max = 1usize << rng.gen_range(1..13);
            let n = rng.gen_range(1..=max);
            data.splice(i..i, std::iter::repeat_n(b, n));
        }
        5 if len > 0 => {
            let (s, e) = range(rng, len);
            data.drain(s..e);
        }
        6 if len > 0 => {
            // Copy a chunk of the input elsewhere in it.
            let (s, e) = range(rng, len);
            let chunk = data[s..e].to_vec();
            let i = at(rng);
            data.splice(i..i, chunk);
        }
        7 if !others.is_empty() => {
            // Splice: our head with another entry's tail.
            let o = &others[rng.gen_range(0..others.len())];
            let cut = at(rng);
            let from = if o.is_empty() {
                0
            } else {
                rng.gen_range(0..o.len())
            };
            data.truncate(cut);
            data.extend_from_slice(&o[from..]);
        }
        8 if !others.is_empty() => {
            // Insert a chunk of another entry.
            let o = &others[rng.gen_range(0..others.len())];
            let (s, e) = range(rng, o.len());
            let i = at(rng);
            data.splice(i..i, o[s..e].iter().copied());
        }
        9 | 10 => {
            let w = dict.pick(rng).to_vec();
            let i = at(rng);
            if rng.gen_bool(0.5) || len == 0 {
                data.splice(i..i, w);
            } else {
                let end = (i + w.len()).min(len);
                data.splice(i..end, w);
            }
        }
        11 => {
            let i = at(rng);
            let mut buf = [0u8; 4];
            let c = multibyte_char(rng)
                .encode_utf8(&mut buf)
                .as_bytes()
                .to_vec();
            data.splice(i..i, c);
        }
        12 => replace_number(rng, data),
        _ if len > 0 => {
            // Swap two bytes.
            let (i, j) = (rng.gen_range(0..len), rng.gen_range(0..len));
            data.swap(i, j);
        }
        _ => data.push(rng.gen()),
    }
}

/// Replaces one run of ASCII digits with a boundary number.
fn replace_number(rng: &mut Rng, data: &mut Vec<u8>) {
    let starts: Vec<usize> = (0..data.len())
        .filter(|&i| data[i].is_ascii_digit() && (i == 0 || !data[i - 1].is_ascii_digit()))
        .collect();
    if starts.is_empty() {
        return;
    }
    let s = starts[rng.gen_range(0..starts.len())];
    let e = (s..data.len())
        .find(|&i| !data[i].is_ascii_digit())
        .unwrap_or(data.len());
    const NUMBERS: &[&str] = &[
        "0",
        "1",
        "2",
        "64",
        "65",
        "513",
        "4294967296",
        "18446744073709551615",
        "99999999999999999999",
        "9223372036854775808",
    ];
    let n = NUMBERS[rng.gen_range(0..NUMBERS.len())];
    data.splice(s..e, n.bytes());
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn mutations_stay_under_the_cap_and_change_the_input() {
        let mut rng = Rng::seed_from_u64(7);
        let seeds = vec![b"{\"agent\": \"writer\", \"mission\": \"x\"}".to_vec()];
        let dict = Dict::new(&seeds, &["extra"]);
        assert!(dict.len() > COMMON.len(), "words were taken from the seeds");
        let mut changed = 0;
        for _ in 0..2000 {
            let mut d = seeds[0].clone();
            mutate_bytes(&mut rng, &mut d, &seeds, &dict, 100);
            assert!(d.len() <= 100);
            changed += usize::from(d != seeds[0]);
        }
        assert!(changed > 1800, "{changed} of 2000 changed");
    }
}
