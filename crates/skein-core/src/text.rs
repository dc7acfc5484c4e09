//! Cutting text to a size in bytes without splitting a character: the one helper every
//! crate uses for messages, previews and lines that must stay short.

/// The longest prefix of `s` that is at most `max` bytes long and ends on a character
/// boundary (all of `s` when it fits).
pub fn clip(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// `s` cut by [`clip`], with `…` after it when something was cut off.
pub fn clip_with_ellipsis(s: &str, max: usize) -> String {
    let kept = clip(s, max);
    if kept.len() == s.len() {
        s.to_string()
    } else {
        format!("{kept}…")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_on_character_boundaries() {
        assert_eq!(clip("héllo", 2), "h"); // 'é' is bytes 1..3
        assert_eq!(clip("héllo", 3), "hé");
        assert_eq!(clip("hi", 5), "hi");
        assert_eq!(clip("hi", 2), "hi");
        assert_eq!(clip("😀", 3), "");
        assert_eq!(clip("", 0), "");
    }

    #[test]
    fn the_ellipsis_marks_only_a_real_cut() {
        assert_eq!(clip_with_ellipsis("héllo", 2), "h…");
        assert_eq!(clip_with_ellipsis("hello", 5), "hello");
        assert_eq!(clip_with_ellipsis("hello!", 5), "hello…");
    }
}
