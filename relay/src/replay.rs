//! Asking an engine's replay socket (vLLM's ROUTER; see `engine` for the wire): a one-off
//! replay, the periodic probe on a kept connection, and what an answer says about the engine
//! compared with the last batch applied.

use crate::zmtp::Dealer;
use bytes::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// Kept for the last applied batch: a replay that shows another payload at its seq comes
/// from a new engine process.
pub(crate) fn payload_hash(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// Asks an engine's replay socket for every batch from `from` on.
pub async fn replay(
    endpoint: &str,
    from: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, String> {
    let work = async {
        let mut d = Dealer::connect(endpoint).await?;
        d.replay(from).await
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no end of replay within {timeout:?}")),
    }
}

/// What a replay from the last applied batch says about the engine.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The engine still buffers our last batch, unchanged: same process. `newest` is the
    /// highest seq it answered.
    Same { newest: Option<u64> },
    /// Our last batch is gone or different. `restart`: the engine's sequence is below it or
    /// differs at it (a new process); otherwise its buffer no longer reaches back to it.
    Changed { restart: bool, why: String },
}

/// Judges a replay from `last.0` against the last applied batch `(seq, payload hash)`.
pub fn judge(last: Option<(u64, u64)>, frames: &[(u64, Bytes)]) -> Verdict {
    let newest = frames.iter().map(|f| f.0).max();
    let Some((seq, hash)) = last else {
        return Verdict::Same { newest };
    };
    match frames.iter().find(|f| f.0 == seq) {
        Some((_, p)) if payload_hash(p) == hash => Verdict::Same { newest },
        Some(_) => Verdict::Changed {
            restart: true,
            why: format!("its batch {seq} differs from the one applied"),
        },
        None if newest.is_none_or(|n| n < seq) => Verdict::Changed {
            restart: true,
            why: match newest {
                Some(n) => format!("its sequence ends at {n}, before batch {seq}"),
                None => format!("it buffers no batch, not even {seq}"),
            },
        },
        None => Verdict::Changed {
            restart: false,
            why: format!("its replay buffer no longer holds batch {seq}"),
        },
    }
}

/// A probe's result, with the connection to reuse and the state it was judged against.
pub(crate) struct ProbeDone {
    pub(crate) conn: Option<Dealer>,
    pub(crate) generation: u64,
    pub(crate) last: Option<(u64, u64)>,
    pub(crate) result: Result<Vec<(u64, Bytes)>, String>,
}

pub(crate) type ProbeFuture = Pin<Box<dyn Future<Output = ProbeDone> + Send>>;

/// One probe: a replay from the last applied batch, on the kept connection when there is one
/// (a new connection per probe would cost a handshake every `--probe-ms`).
pub(crate) fn start_probe(
    conn: Option<Dealer>,
    endpoint: String,
    generation: u64,
    last: Option<(u64, u64)>,
    timeout: Duration,
) -> ProbeFuture {
    Box::pin(async move {
        let from = last.map_or(0, |l| l.0);
        let work = async {
            let mut d = match conn {
                Some(d) => d,
                None => Dealer::connect(&endpoint).await?,
            };
            let frames = d.replay(from).await?;
            Ok::<_, std::io::Error>((d, frames))
        };
        let (conn, result) = match tokio::time::timeout(timeout, work).await {
            Ok(Ok((d, frames))) => (Some(d), Ok(frames)),
            Ok(Err(e)) => (None, Err(e.to_string())),
            Err(_) => (None, Err(format!("no answer within {timeout:?}"))),
        };
        ProbeDone {
            conn,
            generation,
            last,
            result,
        }
    })
}
