//! `/metrics` (Prometheus text) and `/health` (JSON) over a minimal HTTP/1 server.

use crate::clock::now_ms;
use crate::hub::Hub;
use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

pub fn render_metrics(hub: &Hub) -> String {
    let st = hub.lock();
    let mut o = String::new();
    let now = now_ms();
    // Here and below, tables with one row per metric: `duplicates` reports their rows as
    // alike, which they are by design (each says what its metric is; the logic is in the
    // loops after them).
    let per_engine: &[(&str, &str, &str)] = &[
        (
            "kvroute_relay_engine_connected",
            "gauge",
            "1 while the engine's event stream is connected",
        ),
        (
            "kvroute_relay_batches_total",
            "counter",
            "Event batches received",
        ),
        (
            "kvroute_relay_events_total",
            "counter",
            "KV cache events received",
        ),
        (
            "kvroute_relay_blocks_stored_total",
            "counter",
            "Blocks stored and re-keyed",
        ),
        (
            "kvroute_relay_blocks_removed_total",
            "counter",
            "Indexed blocks removed",
        ),
        (
            "kvroute_relay_gaps_repaired_total",
            "counter",
            "Sequence gaps repaired by replay",
        ),
        (
            "kvroute_relay_gaps_unrepaired_total",
            "counter",
            "Sequence gaps replay could not cover (worker announced cleared)",
        ),
        (
            "kvroute_relay_engine_restarts_total",
            "counter",
            "Sequence resets (engine restarts)",
        ),
        (
            "kvroute_relay_orphan_blocks_total",
            "counter",
            "Stored blocks whose parent was unknown (not re-keyed)",
        ),
        (
            "kvroute_relay_block_size_mismatch_total",
            "counter",
            "Stored blocks of another block size (not re-keyed)",
        ),
        (
            "kvroute_relay_bad_events_total",
            "counter",
            "Stored events whose token count does not match their blocks",
        ),
        (
            "kvroute_relay_unknown_events_total",
            "counter",
            "Events with an unknown tag (skipped)",
        ),
        (
            "kvroute_relay_decode_errors_total",
            "counter",
            "Messages or batches that did not decode",
        ),
        (
            "kvroute_relay_indexed_blocks",
            "gauge",
            "Blocks the engine holds, as indexed",
        ),
        (
            "kvroute_relay_last_event_age_seconds",
            "gauge",
            "Seconds since the engine's last batch (-1 before the first)",
        ),
        (
            "kvroute_relay_engine_task_panics_total",
            "counter",
            "Panics of the engine's task (worker announced stale and cleared, task restarted)",
        ),
        (
            "kvroute_relay_index_evicted_blocks_total",
            "counter",
            "Blocks evicted because the engine's index was full (announced removed)",
        ),
        (
            "kvroute_relay_index_max_blocks",
            "gauge",
            "Most blocks the engine's index holds (kv_blocks x --index-factor)",
        ),
    ];
    for (i, (name, kind, help)) in per_engine.iter().enumerate() {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for w in &st.workers {
            let s = &w.stats;
            let v: f64 = match i {
                0 => f64::from(u8::from(s.connected.load(Relaxed))),
                1 => s.batches.load(Relaxed) as f64,
                2 => s.events.load(Relaxed) as f64,
                3 => s.blocks_stored.load(Relaxed) as f64,
                4 => s.blocks_removed.load(Relaxed) as f64,
                5 => s.gaps_repaired.load(Relaxed) as f64,
                6 => s.gaps_unrepaired.load(Relaxed) as f64,
                7 => s.restarts.load(Relaxed) as f64,
                8 => s.orphans.load(Relaxed) as f64,
                9 => s.size_mismatch.load(Relaxed) as f64,
                10 => s.bad_events.load(Relaxed) as f64,
                11 => s.unknown_events.load(Relaxed) as f64,
                12 => s.decode_errors.load(Relaxed) as f64,
                13 => w.index.blocks.len() as f64,
                14 => match s.last_event_ms.load(Relaxed) {
                    0 => -1.0,
                    t => now.saturating_sub(t) as f64 / 1000.0,
                },
                15 => s.task_panics.load(Relaxed) as f64,
                16 => s.evicted.load(Relaxed) as f64,
                _ => w.index.blocks.max() as f64,
            };
            let _ = writeln!(o, "{name}{{worker=\"{}\"}} {v}", esc(&w.name));
        }
    }
    let connected = st
        .workers
        .iter()
        .filter(|w| w.stats.connected.load(Relaxed))
        .count();
    let hs = &hub.stats;
    let globals: [(&str, &str, &str, f64); 10] = [
        (
            "kvroute_relay_engines_connected",
            "gauge",
            "Engines whose event stream is connected",
            connected as f64,
        ),
        (
            "kvroute_relay_engines",
            "gauge",
            "Engines configured or discovered",
            st.workers.len() as f64,
        ),
        (
            "kvroute_relay_streams_open",
            "gauge",
            "gRPC Watch streams open",
            hs.streams_open.load(Relaxed) as f64,
        ),
        (
            "kvroute_relay_updates_sent_total",
            "counter",
            "Updates sent on Watch streams",
            hs.updates_sent.load(Relaxed) as f64,
        ),
        (
            "kvroute_relay_lagged_resnapshots_total",
            "counter",
            "Fresh snapshots sent to streams that fell behind",
            hs.lagged_resnapshots.load(Relaxed) as f64,
        ),
        (
            "kvroute_relay_indexed_blocks_total",
            "gauge",
            "Blocks indexed over all engines",
            st.indexed_blocks() as f64,
        ),
        (
            "kvroute_relay_state_bytes",
            "gauge",
            "Heap bytes of the block index",
            st.state_bytes() as f64,
        ),
        (
            "kvroute_relay_streams_refused_total",
            "counter",
            "Watch streams refused: over --max-streams",
            hs.streams_refused_total.load(Relaxed) as f64,
        ),
        (
            "kvroute_relay_streams_refused_per_client_total",
            "counter",
            "Watch streams refused: over --max-streams-per-client from one address",
            hs.streams_refused_per_client.load(Relaxed) as f64,
        ),
        (
            "kvroute_relay_snapshot_truncated_blocks_total",
            "counter",
            "Hashes left out of snapshots by --max-snapshot-blocks (deepest first)",
            hs.snapshot_truncated.load(Relaxed) as f64,
        ),
    ];
    for (name, kind, help, v) in globals {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    }
    drop(st);
    hub.share.render(&mut o);
    hub.auth.render(&mut o);
    o
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

pub fn render_health(hub: &Hub) -> String {
    let st = hub.lock();
    let now = now_ms();
    let nats = if hub.share.nats_enabled() {
        if hub.share.stats.nats_connected.load(Relaxed) {
            "\"connected\""
        } else {
            "\"down\""
        }
    } else {
        "null"
    };
    let mut o = format!(
        "{{\"status\":\"ok\",\"block_size\":{},\"epoch\":\"{:016x}\",\"streams_open\":{},\"nats\":{nats},\"peers_known\":{},\"engines\":[",
        hub.block_size,
        hub.epoch,
        hub.stats.streams_open.load(Relaxed),
        hub.share.peers_known()
    );
    for (i, w) in st.workers.iter().enumerate() {
        let s = &w.stats;
        let connected = s.connected.load(Relaxed);
        let status = match (connected, w.stale) {
            (true, false) => "live",
            (true, true) => "syncing",
            (false, _) => "down",
        };
        let age = match s.last_event_ms.load(Relaxed) {
            0 => "null".to_owned(),
            t => format!("{:.3}", now.saturating_sub(t) as f64 / 1000.0),
        };
        let _ = write!(
            o,
            "{}{{\"name\":\"{}\",\"endpoint\":\"{}\",\"replay\":{},\"model\":\"{}\",\"status\":\"{status}\",\"connected\":{connected},\"stale\":{},\"indexed_blocks\":{},\"last_seq\":{},\"last_event_age_s\":{age}}}",
            if i == 0 { "" } else { "," },
            esc(&w.name),
            esc(&w.endpoint),
            w.replay
                .as_deref()
                .map_or("null".to_owned(), |r| format!("\"{}\"", esc(r))),
            esc(&w.model),
            w.stale,
            w.index.blocks.len(),
            s.last_seq.load(Relaxed),
        );
    }
    o.push_str("]}\n");
    o
}

/// Serves GET /metrics and GET /health.
pub async fn serve(hub: Arc<Hub>, listener: TcpListener) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let hub = hub.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            // Read until the end of the request head (bodies are not expected).
            loop {
                let Some(space) = buf.get_mut(n..) else {
                    return;
                };
                match sock.read(space).await {
                    Ok(0) | Err(_) => return,
                    Ok(k) => n += k,
                }
                let head = buf.get(..n).unwrap_or_default();
                if head.windows(4).any(|w| w == b"\r\n\r\n") || n >= buf.len() {
                    break;
                }
            }
            let head = String::from_utf8_lossy(buf.get(..n).unwrap_or_default()).into_owned();
            let mut parts = head.split_whitespace();
            let method = parts.next().unwrap_or("");
            let path = parts.next().unwrap_or("").split('?').next().unwrap_or("");
            let (status, ctype, body) = match (method, path) {
                ("GET", "/metrics") => {
                    ("200 OK", "text/plain; version=0.0.4", render_metrics(&hub))
                }
                ("GET", "/health") => ("200 OK", "application/json", render_health(&hub)),
                ("GET", _) => (
                    "404 Not Found",
                    "text/plain",
                    "try /metrics or /health\n".to_owned(),
                ),
                _ => (
                    "405 Method Not Allowed",
                    "text/plain",
                    "GET only\n".to_owned(),
                ),
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
