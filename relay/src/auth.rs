//! Who may open a Watch stream: gateways that send the shared token as
//! `authorization: Bearer <token>` (Envoy's gRPC client sends it as the stream's initial
//! metadata, see README "Authentication"). A token rather than mutual TLS: the filter can send
//! metadata on the stream it opens without Envoy's TLS configuration, the relay needs no TLS
//! stack or certificates to rotate, and a mesh that already encrypts pod traffic (Istio's
//! mTLS) keeps doing so underneath.

use crate::counter::{add, render_labeled};
use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;

/// Env var holding the token when `--token-file` is not given.
pub const TOKEN_ENV: &str = "KVROUTE_RELAY_TOKEN";
/// Shorter tokens are refused at startup: guessable.
pub const MIN_TOKEN_LEN: usize = 16;

/// Why a stream was refused (the metric's `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `authorization` metadata, or not a bearer token.
    Missing,
    /// A bearer token that is not ours.
    Wrong,
}

#[derive(Default, Debug)]
pub struct Auth {
    token: OnceLock<Vec<u8>>,
    missing: AtomicU64,
    wrong: AtomicU64,
}

impl Auth {
    /// From now on every stream must carry `token`. Only the first call counts.
    pub fn require(&self, token: &str) -> Result<(), String> {
        check_token(token)?;
        self.token
            .set(token.as_bytes().to_vec())
            .map_err(|_| "the relay token was set twice".to_owned())
    }

    pub fn required(&self) -> bool {
        self.token.get().is_some()
    }

    /// Checks a request's `authorization` header value; counts a refusal.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Refusal> {
        let Some(want) = self.token.get() else {
            return Ok(());
        };
        let got = authorization.and_then(|v| {
            let (scheme, rest) = v.split_at_checked(7)?;
            scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
        });
        let refusal = match got {
            None => Refusal::Missing,
            Some(t) if same(t, want) => return Ok(()),
            Some(_) => Refusal::Wrong,
        };
        add(
            match refusal {
                Refusal::Missing => &self.missing,
                Refusal::Wrong => &self.wrong,
            },
            1,
        );
        Err(refusal)
    }

    pub fn render(&self, o: &mut String) {
        render_labeled(
            o,
            "kvroute_relay_unauthenticated_total",
            "gRPC calls refused with UNAUTHENTICATED (reason: missing or wrong token)",
            "reason",
            &[("missing", &self.missing), ("wrong", &self.wrong)],
        );
    }
}

/// A token must be a header value Envoy sends unchanged, and long enough not to be guessed.
pub fn check_token(token: &str) -> Result<(), String> {
    if token.len() < MIN_TOKEN_LEN {
        return Err(format!(
            "the relay token is {} bytes; use at least {MIN_TOKEN_LEN} (e.g. `openssl rand -hex 32`)",
            token.len()
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(
            "the relay token must be printable ASCII without spaces (it travels in a header)"
                .to_owned(),
        );
    }
    Ok(())
}

/// Equality whose time depends on the lengths only, not on where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, x) in b.iter().enumerate() {
        diff |= x ^ a.get(i).copied().unwrap_or(!x);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_only() {
        let a = Auth::default();
        assert_eq!(a.check(None), Ok(()), "no token configured: open");
        assert!(a.require("short").is_err());
        assert!(a.require("has a space in it, long enough").is_err());
        a.require("0123456789abcdef").unwrap();
        assert!(a.require("0123456789abcdefXX").is_err(), "set once");
        assert_eq!(a.check(Some(b"Bearer 0123456789abcdef")), Ok(()));
        assert_eq!(a.check(Some(b"bearer 0123456789abcdef")), Ok(()));
        assert_eq!(a.check(None), Err(Refusal::Missing));
        assert_eq!(a.check(Some(b"0123456789abcdef")), Err(Refusal::Missing));
        assert_eq!(
            a.check(Some(b"Basic 0123456789abcdef")),
            Err(Refusal::Missing)
        );
        for wrong in [
            &b"Bearer 0123456789abcdeF"[..],
            b"Bearer 0123456789abcde",
            b"Bearer 0123456789abcdef0",
            b"Bearer ",
        ] {
            assert_eq!(a.check(Some(wrong)), Err(Refusal::Wrong));
        }
        let mut o = String::new();
        a.render(&mut o);
        assert!(o.contains("kvroute_relay_unauthenticated_total{reason=\"missing\"} 3"));
        assert!(o.contains("kvroute_relay_unauthenticated_total{reason=\"wrong\"} 4"));
    }

    #[test]
    fn same_is_equality() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"ab", b"abc"));
        assert!(!same(b"abcd", b"abc"));
        assert!(same(b"", b""));
    }
}
