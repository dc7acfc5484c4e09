//! Small text helpers shared by the tools.

/// Decodes `bytes`, a prefix cut from something longer, as text: a character split by the
/// cut is left out. Returns the text and how many bytes it stands for.
pub fn decode_prefix(bytes: &[u8]) -> (String, usize) {
    let mut used = bytes.len();
    // Look back over at most three bytes for the lead byte of the last character.
    for back in 1..=bytes.len().min(3) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte: the lead is further back
        }
        let need = match b {
            0xF0.. => 4,
            0xE0.. => 3,
            0xC0.. => 2,
            _ => 1,
        };
        if need > back {
            used = bytes.len() - back;
        }
        break;
    }
    (String::from_utf8_lossy(&bytes[..used]).into_owned(), used)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_character_is_left_out() {
        let s = "aé".as_bytes(); // 'é' is two bytes
        assert_eq!(decode_prefix(&s[..2]), ("a".to_string(), 1));
        assert_eq!(decode_prefix(s), ("aé".to_string(), 3));
    }
}
