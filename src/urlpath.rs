//! Request paths as an HTTP engine resolves them. The filter matches routes and the status
//! page on this form, and config validation refuses a status page that is a route in any
//! spelling; kept apart from both so that config does not depend on steer (which depends on
//! config).

/// A path as an HTTP engine resolves it: `%XX` decoded, empty and `.` segments dropped,
/// `..` applied, no trailing slash. `None` if the decoded path is not UTF-8.
pub fn canonical_path(raw: &str) -> Option<String> {
    let decoded = String::from_utf8(percent_decode(raw.as_bytes())).ok()?;
    let mut segs: Vec<&str> = Vec::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                segs.pop();
            }
            s => segs.push(s),
        }
    }
    Some(format!("/{}", segs.join("/")))
}

fn percent_decode(s: &[u8]) -> Vec<u8> {
    let hex = |b: u8| {
        char::from(b)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while let Some(&b) = s.get(i) {
        let pair = match (s.get(i + 1), s.get(i + 2)) {
            (Some(&h), Some(&l)) if b == b'%' => hex(h).zip(hex(l)),
            _ => None,
        };
        match pair {
            Some((h, l)) => {
                out.push(h << 4 | l);
                i += 3;
            }
            None => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn dot_segments_stop_at_the_root() {
        assert_eq!(canonical_path("/"), Some("/".into()));
        assert_eq!(canonical_path("/../.."), Some("/".into()));
    }
}
