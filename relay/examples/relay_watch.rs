//! Watches a relay's gRPC stream like the filter does and prints each update (a debugging aid).
//!
//!     cargo run -p kvroute-relay --example relay_watch -- [http://127.0.0.1:7000] [BLOCK_SIZE]

use kvroute::precise::wire::{Phase, Update, WatchRequest, METHOD, SERVICE};
use tonic::codec::ProstCodec;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:7000".into());
    let block_size = args.next().map_or(Ok(16), |b| b.parse())?;
    let ch = tonic::transport::Endpoint::from_shared(url)?
        .connect()
        .await?;
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await?;
    let path = http::uri::PathAndQuery::try_from(format!("/{SERVICE}/{METHOD}"))?;
    let req = WatchRequest {
        gateway: "relay_watch".into(),
        block_size,
        ..WatchRequest::default()
    };
    let mut s = g
        .server_streaming(
            tonic::Request::new(req),
            path,
            ProstCodec::<WatchRequest, Update>::default(),
        )
        .await?
        .into_inner();
    while let Some(u) = s.message().await? {
        let phase = match Phase::try_from(u.phase) {
            Ok(Phase::Live) => "LIVE",
            Ok(Phase::Snapshot) => "SNAPSHOT",
            Ok(Phase::SnapshotEnd) => "SNAPSHOT_END",
            Err(_) => "?",
        };
        println!("update seq={} epoch={:016x} phase={phase}", u.seq, u.epoch);
        for w in &u.workers {
            println!(
                "  {}: cleared={} stale={} stored={:x?} removed={:x?}",
                w.worker, w.cleared, w.stale, w.stored, w.removed
            );
        }
    }
    Ok(())
}
